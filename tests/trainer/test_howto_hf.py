"""docs/howto.md's new tasks run as written: the reward it shows scores the tiny task's
answers apart (so a group's rewards differ and the run learns), and "Start from a Hugging
Face model" trains a model made with ``save_pretrained`` with no ``model.*`` given."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOWTO = (ROOT / "docs" / "howto.md").read_text(encoding="utf-8")


def _section(title: str) -> str:
    return HOWTO.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_the_howto_reward_tells_the_tiny_tasks_answers_apart() -> None:
    from reco_megatron.data.countdown import generate

    namespace: dict = {}
    exec(_blocks(_section("Plug in your reward"), "python")[0], namespace)  # the doc's code
    reward = namespace["uses_the_numbers"]
    problems = generate(20, seed=1234, n_numbers=4, max_number=5, target_range=(5, 16))
    scores = {reward(p.response(s), p.gold) for p in problems for s in p.solutions}
    assert scores == {0.0, 1.0}  # solutions using every number, and those using fewer
    every = [p.response("+".join(map(str, p.numbers))) for p in problems]
    assert {reward(r, p.gold) for r, p in zip(every, problems, strict=True)} == {1.0}
    assert {reward("Answer: 1+1", p.gold) for p in problems} == {0.0}


@pytest.mark.dist
@pytest.mark.slow
def test_start_from_a_hugging_face_model_as_the_howto_says(tmp_path: Path) -> None:
    """The section's two commands (the model, then the run), with a short run's step count."""
    make, train = (
        _blocks(_section("Start from a Hugging Face model"), "bash")[1]
        .strip()
        .split("\n.venv/bin/python -m reco_megatron.train ")
    )
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    code = make.split('-c "', 1)[1].rsplit('"', 1)[0]
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True, timeout=300)
    args = [a.replace("hf_tiny", str(tmp_path / "hf_tiny")) for a in shlex.split(train)]
    out = tmp_path / "run"
    args = [a for a in args if not a.startswith("trainer.output_dir=")]
    cmd = [sys.executable, "-m", "reco_megatron.train", *args]
    cmd += ["sft.steps=0", "trainer.max_steps=2", "eval.interval=0", "trainer.loggers=[]"]
    cmd += ["rollout.prompts_per_step=4", "rollout.group_size=4", "parallel.micro_batch_size=4"]
    cmd += ["data.countdown.n_train=64", "data.countdown.n_eval=8", f"trainer.output_dir={out}"]
    assert not any(a.startswith("model.") for a in cmd), "the how-to sets no model.*"
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    saved = (out / "config.yaml").read_text()
    assert "num_layers: 2" in saved and "hidden_size: 64" in saved  # from config.json
