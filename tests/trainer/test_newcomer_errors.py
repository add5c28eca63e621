"""A newcomer's mistakes end before anything is created: exit 2, exactly one ``reco-train:``
line naming the value and the fix, no traceback, no run directory.

Each case goes through the real entry point (``reco_megatron.train.main`` in-process, or the
command in a fresh interpreter where the case needs one): a misspelt reward, a reward that
returns a non-number, the bare command, the defaults' prompts over their own limit, a prompt
file over ``rollout.max_prompt_len``, the examples' ``/path/to/...`` placeholders, and a
Hugging Face directory whose ``config.json`` disagrees with ``model.*``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from reco_megatron.train import main

ROOT = Path(__file__).resolve().parents[2]

BAD_REWARDS = """
def exact(response, gold):
    return float(response == gold)

def text(response, gold):
    return "yes"
"""


def _one_line(code: int, err: str, out: Path) -> str:
    """Exit 2, one ``reco-train:`` line, no traceback, no run directory; the line."""
    assert code == 2, err
    assert "Traceback" not in err, err
    assert not out.exists(), "a run directory was left behind"
    lines = [line for line in err.splitlines() if line.startswith("reco-train:")]
    assert len(lines) == 1 and not err.count("\n  - "), err
    return lines[0]


def _refused(tmp_path: Path, capsys, args: list[str]) -> str:
    out = tmp_path / "run"
    code = main([*args, f"trainer.output_dir={out}"])
    return _one_line(code, capsys.readouterr().err, out)


@pytest.fixture
def bad_rewards(tmp_path: Path, monkeypatch) -> str:
    (tmp_path / "newcomer_rewards.py").write_text(BAD_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return "newcomer_rewards"


def test_a_misspelt_reward_function_is_one_line(tmp_path, capsys, monkeypatch, bad_rewards):
    monkeypatch.chdir(ROOT)
    line = _refused(
        tmp_path, capsys, ["examples/tiny_cpu.yaml", f"reward.reward={bad_rewards}:exactt"]
    )
    assert "has no attribute 'exactt'" in line and "'exact'" in line, line


@pytest.mark.dist  # the trial call runs in a reward worker (a fresh interpreter)
def test_a_reward_returning_a_string_is_refused_before_the_run(
    tmp_path, capsys, monkeypatch, bad_rewards
) -> None:
    monkeypatch.chdir(ROOT)
    line = _refused(
        tmp_path, capsys, ["examples/tiny_cpu.yaml", f"reward.reward={bad_rewards}:text"]
    )
    assert "gave a value that is not a number on a real prompt" in line, line
    assert "returned 'yes'" in line and "target=" in line, line  # the gold of a real prompt


def test_the_bare_command_says_what_to_pass(capsys) -> None:
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("reco-train: no config given: pass one, e.g.") and "tiny_cpu.yaml" in err


def test_the_defaults_prompts_over_their_limit_name_the_count_and_the_longest(
    tmp_path, capsys, monkeypatch
) -> None:
    monkeypatch.chdir(ROOT)
    line = _refused(tmp_path, capsys, [])  # overrides only: the dataclass defaults
    assert "the countdown task (data.countdown): 2000 of 2000 prompts are longer than " in line
    assert "rollout.max_prompt_len=64 (the longest has 74 tokens)" in line, line


def test_a_prompt_file_over_the_limit_names_the_count_and_the_longest(
    tmp_path, capsys, monkeypatch
) -> None:
    monkeypatch.chdir(ROOT)
    rows = [{"prompt": "1 + 1", "answer": "2"}, *[{"prompt": "9 " * 90, "answer": "9"}] * 2]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = _refused(tmp_path, capsys, ["examples/tiny_cpu.yaml", f"data.train_path={path}"])
    assert "2 of 3 prompts are longer than rollout.max_prompt_len=80" in line, line
    assert "data.dataset.on_bad_row=skip" in line


@pytest.mark.dist
def test_the_examples_placeholders_are_one_line(tmp_path) -> None:
    """A fresh interpreter (in-process, an earlier test's one-rank process group would make
    the 8-rank layout the second problem): with a world that fits the example's layout, the
    placeholders are the only problem, in one line."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "reco_megatron.train"),
            *("examples/llama3.1-8b-instruct.yaml", f"trainer.output_dir={out}"),
        ],
        cwd=ROOT,
        env={**_env(), "WORLD_SIZE": "8"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = _one_line(proc.returncode, proc.stderr, out)
    for key in ("data.train_path", "data.tokenizer", "checkpoint.init_hf"):
        assert f"{key}='/path/to/" in line, line
    assert "still the example's placeholder" in line


def _save_llama(path: Path, layers: int = 2) -> Path:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _save_qwen_config(path: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    cfg.save_pretrained(path)
    return path


def test_init_hf_against_a_mismatching_model_section_is_one_line(
    tmp_path, capsys, monkeypatch
) -> None:
    monkeypatch.chdir(ROOT)
    hf = _save_llama(tmp_path / "llama")
    line = _refused(tmp_path, capsys, ["examples/tiny_cpu.yaml", f"checkpoint.init_hf={hf}"])
    assert "disagree with its config.json" in line, line
    assert "model.num_layers=4, config.json 2" in line and "model.hidden_size=128" in line, line


def test_init_hf_takes_the_architecture_from_config_json(tmp_path, monkeypatch) -> None:
    """No model.* given: the Llama and the Qwen configs give the model; a key the user sets
    wins and must agree (else the line above)."""
    from reco_megatron.config import load_config
    from reco_megatron.trainer.config import TrainConfig
    from reco_megatron.trainer.preflight import file_problems

    monkeypatch.chdir(ROOT)
    llama = _save_llama(tmp_path / "llama")
    cfg = load_config(TrainConfig, "examples/tiny_hf.yaml", [f"checkpoint.init_hf={llama}"])
    m = cfg.model
    assert (m.family, m.num_layers, m.hidden_size, m.ffn_hidden_size) == ("llama", 2, 64, 176)
    assert (m.num_query_groups, m.max_position_embeddings, m.norm_epsilon) == (2, 256, 1e-5)
    assert m.make_vocab_size_divisible_by == 64  # the file's run choice is kept
    assert file_problems(cfg) == []

    qwen = _save_qwen_config(tmp_path / "qwen")
    cfg = load_config(TrainConfig, "examples/tiny_hf.yaml", [f"checkpoint.init_hf={qwen}"])
    m = cfg.model
    assert (m.family, m.num_layers, m.norm_epsilon, m.tie_word_embeddings) == (
        "qwen2",
        3,
        1e-6,
        True,
    )
    agreeing = load_config(
        TrainConfig, "examples/tiny_hf.yaml", [f"checkpoint.init_hf={qwen}", "model.num_layers=3"]
    )
    assert agreeing.model == cfg.model


@pytest.mark.dist
def test_the_real_command_with_a_misspelt_reward(tmp_path) -> None:
    """The command a newcomer types, in a fresh interpreter: the line comes before any log."""
    (tmp_path / "my_rewards.py").write_text(BAD_REWARDS)
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "reco_megatron.train", "examples/tiny_cpu.yaml"),
            *("reward.reward=my_rewards:exactt", f"trainer.output_dir={out}"),
        ],
        cwd=ROOT,
        env={**_env(), "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = _one_line(proc.returncode, proc.stderr, out)
    assert "my_rewards:exactt" in line and "has no attribute 'exactt'" in line
    assert proc.stderr.strip() == line, proc.stderr  # nothing logged before it


LAUNCH = ("--nnodes", "1", "--nproc-per-node", "1", "--gpus-per-node", "0")


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("misspelt", "has no attribute 'exactt'"),
        pytest.param("text", "returned 'yes'", marks=pytest.mark.dist),  # a reward worker
        ("long_prompts", "2 of 3 prompts are longer than rollout.max_prompt_len=80"),
        ("init_hf", "model.num_layers=4, config.json 2"),
        ("defaults", "2000 of 2000 prompts are longer than rollout.max_prompt_len=64"),
        ("placeholders", "still the example's placeholder"),
    ],
)
def test_the_launch_check_refuses_the_same_mistakes(
    tmp_path, capsys, monkeypatch, bad_rewards, case: str, needle: str
) -> None:
    """``launch_check`` (what the Slurm scripts and their dry run call before ``srun``) runs
    the same pre-flight: each mistake above is its one line and exit 2, before any job."""
    from reco_megatron import launch_check

    monkeypatch.chdir(ROOT)
    tiny = "examples/tiny_cpu.yaml"
    if case == "long_prompts":
        rows = [{"prompt": "1 + 1", "answer": "2"}, *[{"prompt": "9 " * 90, "answer": "9"}] * 2]
        (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = {
        "misspelt": [tiny, f"reward.reward={bad_rewards}:exactt"],
        "text": [tiny, f"reward.reward={bad_rewards}:text"],
        "long_prompts": [tiny, f"data.train_path={tmp_path / 'p.jsonl'}"],
        "init_hf": [tiny, f"checkpoint.init_hf={tmp_path / 'llama'}"],
        "defaults": [],
        "placeholders": ["--layout-only", "examples/llama3.1-8b-instruct.yaml"],
    }[case]
    sizes = LAUNCH
    if case == "init_hf":
        _save_llama(tmp_path / "llama")
        capsys.readouterr()  # what transformers said while saving it
    if case == "placeholders":  # the example's layout; first as a preview, then checked
        sizes = ("--nnodes", "1", "--nproc-per-node", "8", "--gpus-per-node", "8")
        assert launch_check.main([*sizes, *args]) == 0
        assert capsys.readouterr().out.startswith("TP=2 ")
        args = args[1:]
    code = launch_check.main([*sizes, *args])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "Traceback" not in err, err
    (line,) = err.splitlines()
    assert line.startswith("reco launch check failed: ") and needle in line, line


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WORLD_SIZE")}
