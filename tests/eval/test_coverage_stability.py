"""examples/coverage/stability.py: dead runs and the c columns of the coverage report, from
hand-made metrics rows."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location(
        "coverage_stability", ROOT / "examples/coverage/stability.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(rewards, c=None, masked=None):
    rows = []
    for i, r in enumerate(rewards, start=1):
        row = {"step": i, "reward_mean": r, "reward_nonzero_frac": 1.0 if r else 0.0}
        row["token_ratio_max"] = None if c is None else c[i - 1]
        row["clip_frac_c"] = None if masked is None else masked[i - 1]
        rows.append(row)
    return rows


def test_dead_from_needs_k_consecutive_steps() -> None:
    st = _module()
    assert st.dead_from(_rows([0.1, 0, 0, 0.2, 0, 0, 0]), k=4) is None
    assert st.dead_from(_rows([0.1, 0, 0.2, 0, 0, 0, 0]), k=4) == 4
    # rows of older code have no reward_nonzero_frac: countdown rewards are 0 or 1
    old = [{"step": s, "reward_mean": r} for s, r in enumerate([0.3, 0, 0], start=1)]
    assert st.dead_from(old, k=2) == 2


def test_stability_table() -> None:
    st = _module()
    alive = _rows([0.2] * 6, c=[1.0, 2.0, 30.0, 1.5, 1.1, 1.0], masked=[0, 0.002, 0, 0, 0, 0])
    dead = _rows([0.2] + [0] * 5, c=[1.0, 152.0, 1, 1, 1, 1], masked=[0] * 6)
    table = st.stability_table(
        {"reco": [alive, dead, []], "grpo": [_rows([0.2] * 6)]},
        {"reco": [False, True, False], "grpo": [False]},
        c_max=10.0,
    )
    reco = next(line for line in table.splitlines() if line.startswith("| reco |"))
    cells = [c.strip() for c in reco.strip("|").split("|")]
    assert cells == [
        "reco", "3", "1 of 2 (2); 1 without metrics", "1 of 3", f"{100 * 0.002 / 12:.3f}",
        "91", "152", "2 of 12",
    ]  # fmt: skip
    grpo = next(line for line in table.splitlines() if line.startswith("| grpo |"))
    assert grpo.endswith("| 1 | 0 of 1 | 0 of 1 | - | - | - | - |")
