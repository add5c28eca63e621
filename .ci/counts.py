"""Print what each stack's test steps in .ci/run run, from one collection (about 13 s).

    python .ci/counts.py SUBSET_DIR [SUBSET_DIR ...]

SUBSET_DIRs: the folders whose `dist` tests the compat stack runs. The selections below mirror
the `-m` expressions of .ci/run; a test outside them ran on the main stack only.
"""

from __future__ import annotations

import collections
import sys

import pytest


class _Collect:
    def __init__(self) -> None:
        self.items: list[pytest.Item] = []

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.items = list(session.items)


def main(subset: list[str]) -> int:
    plugin = _Collect()
    args = ["--collect-only", "-q", "-p", "no:cacheprovider", "-o", "addopts=--strict-markers"]
    rc = pytest.main(args, plugins=[plugin])
    if rc not in (0, 5):
        print(f"collection failed (pytest exit {rc})", file=sys.stderr)
        return 1
    quick = dist_here = 0
    left: collections.Counter[str] = collections.Counter()
    for item in plugin.items:
        marks = {m.name for m in item.iter_markers()}
        if "slurm" in marks:
            continue
        path = item.nodeid.split("::", 1)[0]
        if "slow" in marks:
            left["slow"] += 1
        elif "dist" not in marks:
            quick += 1
        elif any(path == s or path.startswith(s.rstrip("/") + "/") for s in subset):
            dist_here += 1
        else:
            left["dist in " + path.split("/")[1] if "/" in path else path] += 1
    rest = ", ".join(f"{n} {k}" for k, n in sorted(left.items()))
    print(f"\ncompat stack runs {quick} quick and {dist_here} dist tests;", end=" ")
    print(f"left to the main stack: {rest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
