"""docs/howto.md, "Compare with GRPO without a second warm-up", run as written (with a short
run's sizes): the ReCo run's post-SFT checkpoint starts the GRPO baseline, which runs no
warm-up of its own and starts from the same weights."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_overrides import TINY_RUN

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
HOWTO = (ROOT / "docs" / "howto.md").read_text(encoding="utf-8")
SHORT = [*TINY_RUN, "sft.steps=4", "sft.batch_size=8", "trainer.max_steps=1", "eval.interval=0"]


def _command(title: str) -> list[str]:
    """The section's first bash command, its arguments after ``-m reco_megatron.train``."""
    section = HOWTO.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return shlex.split(block.replace("\\\n", " "))[3:]


def _train(args: list[str], runs: Path) -> subprocess.CompletedProcess:
    args = [a.replace("runs/", f"{runs}/") for a in args]
    cmd = [sys.executable, "-m", "reco_megatron.train", *args]
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_grpo_starts_from_the_reco_runs_post_sft_checkpoint(tmp_path: Path) -> None:
    reco = _train(["examples/tiny_cpu.yaml", *SHORT, "trainer.output_dir=runs/tiny_cpu"], tmp_path)
    assert reco.returncode == 0, reco.stderr[-3000:]
    assert (tmp_path / "tiny_cpu/checkpoints/step_00000000").is_dir()

    howto = _command("Compare with GRPO without a second warm-up")
    assert "loss.preset=grpo" in howto and "sft.steps=0" in howto, howto
    baseline = _train([*howto[:1], *SHORT, *howto[1:]], tmp_path)  # the how-to's keys win
    assert baseline.returncode == 0, baseline.stderr[-3000:]
    out = tmp_path / "tiny_grpo"
    assert not (out / "checkpoints/step_00000000").exists()  # no warm-up of its own
    saved = (out / "config.yaml").read_text()
    assert "objective: ppo_clip" in saved
    assert f"init_megatron: {tmp_path}/tiny_cpu/checkpoints/step_00000000" in saved
    # Same weights and seeds at the first RL step: the same responses and the same policy
    # entropy in both runs (the entropy told the seeded start apart when init_megatron was
    # dropped from the command, tried: 4.846 vs 4.844).
    first, base = _rows(tmp_path / "tiny_cpu")[0], _rows(out)[0]
    for key in ("reward_mean", "response_len_mean", "unique_frac", "entropy_mean"):
        assert base[key] == pytest.approx(first[key], rel=1e-5), key
