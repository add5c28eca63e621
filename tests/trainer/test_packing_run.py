"""The tiny example trains the same with sequence packing on as off (CPU, torch's attention:
``model.attention_backend=auto``).

Two runs of ``examples/tiny_cpu.yaml`` (the tiny sizes of every trainer test, no warm-up, 3
steps, 4 prompts x 4 responses, 2 mini-batches per rollout) with the same token budget of 96
positions per micro-batch: padded rows, and ``update.sequence_packing=true`` (several
responses per packed row, positions restarting per sequence, attention inside each sequence).
Every column of ``metrics.jsonl`` that does not measure wall-clock time or the micro-batching
itself must agree: the sampled responses, rewards, lengths, pass@k and diversity exactly
(the rollout engine samples from the exported weights with one seed per prompt), the losses,
statistics, weights and gradient norms to 1e-4 (fp32 summation order: the fused attention
tiles a packed row differently from a padded one, ~1e-7 relative per step, as in
``test_loop``). The micro-batching columns describe the micro-batches and are left out (here
the untrained model's responses all run to the length limit, so packing saves no padding).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reco_megatron.testing import run_distributed
from reco_megatron.train import main
from reco_megatron.trainer.reporting.step_metrics import is_wall_clock
from tests.tiny_overrides import TINY_RUN

pytestmark = [pytest.mark.dist, pytest.mark.slow]

TINY = [
    *TINY_RUN,
    "sft.steps=0",
    "trainer.max_steps=3",
    "model.attention_backend=auto",  # torch's on CPU (the example pins local for the README)
    "update.max_tokens_per_microbatch=96",
    "update.microbatch_length_multiple=8",
]
SCHEDULE = ("pad_frac", "microbatches_per_rank", "tokens_computed", "dp_tokens", "old_tokens")
"""Columns that describe the micro-batches themselves (prefixes): packing changes them."""
EXACT = ("reward_mean", "response_len_mean", "unique_frac", "pass@1", "pass@4", "step")


def _run(rank, world_size, out: str, extra: list[str]) -> int:
    """Train; returns how many passes ran as packed rows."""
    from reco_megatron.megatron.step import schedule

    packed = []
    original = schedule.make_packed_forward_step

    def counted(*args, **kwargs):
        packed.append(1)
        return original(*args, **kwargs)

    schedule.make_packed_forward_step = counted
    code = main(["examples/tiny_cpu.yaml", *TINY, f"trainer.output_dir={out}", *extra])
    assert code == 0
    return len(packed)


def _rows(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [{k: v for k, v in r.items() if not is_wall_clock(k)} for r in rows]


def test_packing_on_equals_packing_off_in_every_metric(tmp_path: Path) -> None:
    off, on = tmp_path / "off", tmp_path / "on"
    assert run_distributed(_run, 1, args=(str(off), []), timeout=900) == [0]
    packed = run_distributed(_run, 1, args=(str(on), ["update.sequence_packing=true"]), timeout=900)
    assert packed[0] >= 3 * 3  # every pass of every step: the old-policy pass, 2 updates
    rows_off, rows_on = _rows(off), _rows(on)
    assert len(rows_off) == len(rows_on) == 3
    for a, b in zip(rows_off, rows_on, strict=True):
        assert a.keys() == b.keys()
        compared = 0
        for key, value in a.items():
            if key.startswith(SCHEDULE) or not isinstance(value, int | float):
                continue
            compared += 1
            if key in EXACT:
                assert b[key] == value, key
            else:
                assert b[key] == pytest.approx(value, abs=1e-4, rel=1e-4, nan_ok=True), key
        assert compared > 20
        assert b["pad_frac"] <= a["pad_frac"]
