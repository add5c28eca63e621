"""Which test modules the device check runs with ``pytest -m gpu``, in which step.

A module belongs to the check when its source uses the ``gpu`` marker in any form
(``@pytest.mark.gpu``, ``pytestmark = [pytest.mark.gpu]``, ``marks=pytest.mark.gpu`` in a
parameter, or ``GPU`` from ``tests/gpu/_cuda.py``), found by reading the syntax tree, not by
importing: collecting the whole suite would import modules that need what the GPU image lacks
(hypothesis, pyarrow). A new GPU test module therefore joins the check by itself.

    python benchmarks/gpu/gpu_tests.py kernel     # the kernel / engine modules, one per line
    python benchmarks/gpu/gpu_tests.py trainer    # the modules that run the trainer

The trainer modules (subprocesses of ``reco_megatron.train`` and of the update worker) run in
their own step, after the kernel step, most valuable first.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAINER = (
    "tests/gpu/test_trainer_cuda.py",
    "tests/gpu/test_reco_update_cuda.py",
    "tests/gpu/test_megatron_rollout_cuda.py",
)


def uses_gpu_marker(source: str) -> bool:
    """Whether a module's source refers to the ``gpu`` marker or to ``tests.gpu._cuda.GPU``."""
    for node in ast.walk(ast.parse(source)):
        marker = (
            isinstance(node, ast.Attribute)
            and node.attr == "gpu"
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "mark"
        )
        shared = (
            isinstance(node, ast.ImportFrom)
            and node.module == "tests.gpu._cuda"
            and any(alias.name == "GPU" for alias in node.names)
        )
        if marker or shared:
            return True
    return False


def gpu_test_modules(root: Path = ROOT) -> list[str]:
    """Every ``tests/**/test_*.py`` that uses the marker, relative to ``root``, sorted."""
    return sorted(
        str(p.relative_to(root))
        for p in (root / "tests").rglob("test_*.py")
        if uses_gpu_marker(p.read_text(encoding="utf-8"))
    )


def split(root: Path = ROOT) -> dict[str, list[str]]:
    """``kernel`` and ``trainer`` module lists; a listed trainer module that is missing or
    carries no gpu marker is an error (the list must follow renames)."""
    found = gpu_test_modules(root)
    stale = [m for m in TRAINER if m not in found]
    if stale:
        raise SystemExit(f"gpu_tests.py: TRAINER lists {stale}, not gpu test modules: update it")
    return {"kernel": [m for m in found if m not in TRAINER], "trainer": list(TRAINER)}


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("kernel", "trainer", "all"):
        raise SystemExit("usage: gpu_tests.py kernel|trainer|all")
    parts = split()
    print(
        "\n".join(
            parts["kernel"] + parts["trainer"] if sys.argv[1] == "all" else parts[sys.argv[1]]
        )
    )
