"""docs/howto.md "Write your own environment in 30 lines" works as written: the class it shows
answers calculator calls token for token, and the run it shows trains multi-turn episodes end
to end with that class loaded from the user's own file."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from reco_megatron.data.countdown import calculator_response
from reco_megatron.data.tokenizer import SentencePieceTokenizer
from tests.tiny_overrides import TINY_RUN

ROOT = Path(__file__).resolve().parents[2]
HOWTO = (ROOT / "docs" / "howto.md").read_text(encoding="utf-8")
SECTION = HOWTO.split("## Write your own environment in 30 lines\n", 1)[1].split("\n## ", 1)[0]


def _block(lang: str) -> str:
    return re.findall(rf"```{lang}\n(.*?)```", SECTION, flags=re.S)[0]


def test_the_howto_environment_is_thirty_lines_and_answers_calls() -> None:
    code = _block("python")
    assert len(code.splitlines()) <= 30
    namespace: dict = {}
    exec(code, namespace)  # the doc's code, as a user would paste it
    tok = SentencePieceTokenizer(ROOT / "examples/tiny/countdown_sp.model")
    env = namespace["Calculator"](tok)
    assert env.reset({"prompt": "", "answer": "", "prompt_ids": [4, 5]}) == [4, 5]
    assert tok.decode(list(env.stop_ids)) == "="
    # the warm-up's calls, token for token: each value is what the text holds after the call
    pieces = ["<4 + 5=", "9>", " <3 * 9=", "27>", " Answer: 3*(4 + 5)"]
    assert "".join(pieces) == calculator_response("3*(4 + 5)")
    for action, value in zip(pieces[0::2], pieces[1::2], strict=False):
        step = env.step(tok.encode(action), "stop")
        assert not step.done and list(step.observation_ids) == tok.encode(value)
    assert env.step([*tok.encode(pieces[-1]), tok.eos_id], "stop").done
    assert tok.decode(list(env.step(tok.encode("<4 + (="), "stop").observation_ids)) == "error>"


@pytest.mark.slow
def test_the_howto_run_trains_episodes_with_the_users_file(tmp_path: Path) -> None:
    (tmp_path / "my_envs.py").write_text(_block("python"))
    args = shlex.split(_block("bash").replace("\\\n", " ").split("reco_megatron.train", 1)[1])
    args = [
        a.replace("my_envs:", f"{tmp_path / 'my_envs.py'}:")
        for a in args
        if not a.startswith("trainer.output_dir=")
    ]
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "reco_megatron.train", *args, *TINY_RUN]
    cmd += ["rollout.max_new_tokens=16", "sft.steps=0", "trainer.max_steps=2", "eval.interval=0"]
    cmd += [f"trainer.output_dir={out}"]
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["env_turns_mean"] >= 1.0 and row["env_failed"] == 0
        assert 0.0 <= row["env_observation_frac"] < 1.0


@pytest.mark.dist  # a fresh interpreter importing torch and megatron-core (the real command)
def test_a_misspelt_environment_stops_the_run_in_one_line_before_anything_exists(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "reco_megatron.train", "examples/calculator_cpu.yaml"]
    cmd += ["rollout.env=my_envz:Calculator", f"trainer.output_dir={out}"]
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if "rollout.env=" in line]
    assert len(lines) == 1 and "cannot be imported" in lines[0]
    assert "Traceback" not in done.stderr and not out.exists()
