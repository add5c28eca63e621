"""The Qwen3-30B-A3B example: architecture, layouts at 2 and 4 nodes, the Slurm dry run."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from reco_megatron.config import load_config
from reco_megatron.launch_check import check_layout
from reco_megatron.trainer.config import TrainConfig
from tests.launch.test_slurm_scripts import _dry_run, _fake_allocation

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples/qwen3-30b-a3b.yaml")


def test_example_is_qwen3_30b_a3b() -> None:
    # Qwen/Qwen3-30B-A3B config.json: hidden 2048, 48 layers, 32 heads x head_dim 128, 4 kv
    # heads, 128 experts of width 768, 8 per token, renormalised, vocabulary 151936, theta 1e6
    m = load_config(TrainConfig, EXAMPLE).model
    assert (m.family, m.hidden_size, m.num_layers, m.num_attention_heads) == (
        "qwen3_moe",
        2048,
        48,
        32,
    )
    assert (m.query_groups, m.head_dim, m.vocab_size, m.rotary_base) == (4, 128, 151936, 1e6)
    assert m.moe is not None
    assert (m.moe.num_experts, m.moe.router_topk, m.moe.ffn_hidden_size) == (128, 8, 768)
    assert m.moe.norm_topk_prob and m.moe.capacity_factor is None


@pytest.mark.parametrize(
    ("nodes", "line"),
    [(2, "TP=4 PP=1 CP=1 DP=4 EP=4 WORLD=16"), (4, "TP=4 PP=1 CP=1 DP=8 EP=4 WORLD=32")],
)
def test_layout_fits(nodes: int, line: str) -> None:
    layout = check_layout(EXAMPLE, [], nnodes=nodes, nproc_per_node=8, gpus_per_node=8)
    assert layout.line() == line


_EP16 = ["parallel.expert_model_parallel_size=16", "parallel.expert_tensor_parallel_size=1"]
_ETP16 = ["parallel.expert_tensor_parallel_size=16"]


@pytest.mark.parametrize(
    ("overrides", "nodes", "needle"),
    [
        (["parallel.expert_model_parallel_size=3"], 2, "EP x expert-TP = 3 x 4 does not divide"),
        (["parallel.expert_model_parallel_size=8"], 2, "EP x expert-TP = 8 x 4 does not divide"),
        (["parallel.sequence_parallel=false"], 2, "needs parallel.sequence_parallel=true"),
        (
            ["model.moe.num_experts=120", *_EP16],
            2,
            "num_experts=120 is not divisible by parallel.expert_model_parallel_size=16",
        ),
        (
            ["model.moe.ffn_hidden_size=760", _ETP16[0], "parallel.expert_model_parallel_size=1"],
            2,
            "ffn_hidden_size=760 is not divisible by parallel.expert_tensor_parallel_size=16",
        ),
        (["model.moe=null"], 2, "has mixture-of-experts layers: set model.moe"),
    ],
)
def test_bad_layouts_fail_fast(overrides: list[str], nodes: int, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        check_layout(EXAMPLE, overrides, nnodes=nodes, nproc_per_node=8, gpus_per_node=8)


@pytest.mark.dist
@pytest.mark.parametrize("nodes", [4])  # 2 nodes: test_layout_fits (in-process, no torch start)
def test_slurm_dry_run(tmp_path: Path, nodes: int) -> None:
    env = _fake_allocation(tmp_path, [f"gpu{i:03d}" for i in range(1, nodes + 1)])
    res = _dry_run("slurm/reco_qwen3_30b_a3b.sh", env, "trainer.max_steps=3")
    assert res.returncode == 0, res.stderr
    cmd = shlex.split(res.stdout.strip())
    assert cmd[:2] == ["srun", f"--nodes={nodes}"]
    tail = cmd[cmd.index("reco_megatron.train") + 1 :]
    assert tail[0] == "examples/qwen3-30b-a3b.yaml" and tail[-1] == "trainer.max_steps=3"
    assert f"EP=4 WORLD={8 * nodes}" in res.stderr
