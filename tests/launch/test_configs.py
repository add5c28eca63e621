"""The example configs load, carry the public architecture numbers, and scale by parallelism."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from reco_megatron.config import load_config
from reco_megatron.launch_check import check_layout, main
from reco_megatron.trainer.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

# Public HF config.json facts: (hidden, layers, heads, kv heads, ffn, vocab, rope theta,
# rope scaling, rms eps, tied).
ARCH = {
    "llama3.1-8b-instruct.yaml": (4096, 32, 32, 8, 14336, 128256, 500000.0, 8.0, 1e-5, False),
    "llama3.1-70b.yaml": (8192, 80, 64, 8, 28672, 128256, 500000.0, 8.0, 1e-5, False),
    "qwen2.5-math-1.5b.yaml": (1536, 28, 12, 2, 8960, 151936, 10000.0, None, 1e-6, True),
    "qwen2.5-math-7b.yaml": (3584, 28, 28, 4, 18944, 152064, 10000.0, None, 1e-6, False),
}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_loads(path: Path) -> None:
    cfg = load_config(TrainConfig, path)
    if path.name in ARCH:
        m = cfg.model
        got = (
            m.hidden_size,
            m.num_layers,
            m.num_attention_heads,
            m.query_groups,
            m.ffn_hidden_size,
            m.vocab_size,
            m.rotary_base,
            m.rope_scaling_factor,
            m.norm_epsilon,
            m.tie_word_embeddings,
        )
        assert got == ARCH[path.name]
        assert cfg.rollout.engine == "vllm" and cfg.rollout.group_size == 8
        assert cfg.rollout.temperature == 1.0 and cfg.optimizer.lr == 1e-6
        assert cfg.reward.reward == "math" and cfg.checkpoint.init_hf
        assert cfg.update.minibatches_per_rollout >= 2  # the token ratio acts from step 2


def test_all_model_configs_present() -> None:
    assert set(ARCH) <= {p.name for p in EXAMPLES}


def test_8b_to_70b_changes_only_model_and_parallel() -> None:
    a = yaml.safe_load((ROOT / "examples/llama3.1-8b-instruct.yaml").read_text())
    b = yaml.safe_load((ROOT / "examples/llama3.1-70b.yaml").read_text())
    # The two paths naming the model's files differ by necessity; nothing else may.
    for d in (a, b):
        d["checkpoint"].pop("init_hf")
        d["data"].pop("tokenizer")
    changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    assert changed == ["model", "parallel"]
    assert b["parallel"]["tensor_model_parallel_size"] == 8
    assert b["parallel"]["pipeline_model_parallel_size"] > 1


@pytest.mark.parametrize(
    ("name", "nodes", "line"),
    [
        ("llama3.1-8b-instruct.yaml", 1, "TP=2 PP=1 CP=1 DP=4 WORLD=8"),
        ("llama3.1-8b-instruct.yaml", 4, "TP=2 PP=1 CP=1 DP=16 WORLD=32"),
        ("llama3.1-70b.yaml", 4, "TP=8 PP=4 CP=1 DP=1 WORLD=32"),
        ("qwen2.5-math-1.5b.yaml", 1, "TP=1 PP=1 CP=1 DP=8 WORLD=8"),
        ("qwen2.5-math-7b.yaml", 2, "TP=2 PP=1 CP=1 DP=8 WORLD=16"),
    ],
)
def test_layout_fits(name: str, nodes: int, line: str) -> None:
    layout = check_layout(
        str(ROOT / "examples" / name), [], nnodes=nodes, nproc_per_node=8, gpus_per_node=8
    )
    assert layout.line() == line


@pytest.mark.parametrize(
    "name",
    [
        "llama3.1-8b-instruct.yaml",
        "qwen2.5-math-7b.yaml",
        "llama3.1-70b.yaml",
        "qwen2.5-math-1.5b.yaml",
    ],
)
def test_examples_train_on_token_budget_micro_batches(name: str) -> None:
    # token-budget micro-batches (and balanced DP ranks) are on in the large examples; the
    # budget holds the longest prompt + response, and a launch check runs the batch checks
    cfg = load_config(TrainConfig, ROOT / "examples" / name)
    u, r = cfg.update, cfg.rollout
    assert u.max_tokens_per_microbatch >= r.max_prompt_len + r.max_new_tokens
    assert u.balance_data_parallel
    with pytest.raises(ValueError, match="max_tokens_per_microbatch=2048 is below the longest"):
        check_layout(
            str(ROOT / "examples" / name),
            ["update.max_tokens_per_microbatch=2048"],
            nnodes=4,
            nproc_per_node=8,
            gpus_per_node=8,
        )


@pytest.mark.parametrize(
    ("overrides", "nodes", "nproc", "gpus", "needle"),
    [
        (["parallel.tensor_model_parallel_size=16"], 2, 8, 8, "must stay inside a node"),
        ([], 1, 8, 8, "not divisible by TP x PP x CP"),  # 70B on one node
        ([], 4, 16, 8, "only 8 GPUs per node"),
        (["parallel.pipeline_model_parallel_size=3"], 3, 8, 8, "num_layers=80"),
    ],
)
def test_layout_fails_fast(
    overrides: list[str], nodes: int, nproc: int, gpus: int, needle: str
) -> None:
    with pytest.raises(ValueError, match=needle):
        check_layout(
            str(ROOT / "examples/llama3.1-70b.yaml"),
            overrides,
            nnodes=nodes,
            nproc_per_node=nproc,
            gpus_per_node=gpus,
        )


def test_cli_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    tiny = str(ROOT / "examples/tiny_cpu.yaml")
    assert main(["--nnodes", "1", "--nproc-per-node", "2", tiny]) == 0
    assert capsys.readouterr().out.strip() == "TP=1 PP=1 CP=1 DP=2 WORLD=2"
    bad = ["--nnodes", "1", "--nproc-per-node", "3", tiny, "parallel.tensor_model_parallel_size=2"]
    assert main(bad) == 2
    assert "world size 3 is not divisible" in capsys.readouterr().err
    assert main(["--nnodes", "1", "--nproc-per-node", "1", tiny, "model.nope=1"]) == 2


def test_one_key_for_the_prompt_budget() -> None:
    """``rollout.max_prompt_len`` is the prompt budget: the trainer reads its prompt files
    with it (the config itself is never changed), and ``data.dataset.max_prompt_len``, a key
    of older configs, is refused with the key that replaced it."""
    from reco_megatron.config import ConfigError, config_to_dict

    cfg = load_config(TrainConfig, ROOT / "examples/tiny_cpu.yaml", [])
    assert cfg.prompt_dataset().max_prompt_len == cfg.rollout.max_prompt_len == 80
    assert "max_prompt_len" not in config_to_dict(cfg)["data"]["dataset"]
    for value in (80, 40):
        with pytest.raises(ConfigError, match=r"delete data\.dataset\.max_prompt_len"):
            load_config(
                TrainConfig,
                ROOT / "examples/tiny_cpu.yaml",
                [f"data.dataset.max_prompt_len={value}"],
            )
