"""Megatron-Bridge's Qwen3 / Qwen3-MoE conversion against ours, on CPU over gloo.

As ``test_bridge_crosscheck.py`` (same shim, same skip): the rollout weight stream of
:func:`bridge_hf_weights` equals our ``all_stage_hf_weights`` bit for bit, and the bridge's
import equals ours, for Qwen3-MoE (QK layernorm, decoupled head width, experts) at EP 2:
experts gathered over the expert-parallel group, and the import at EP 2 places every expert
on its rank. Measured also when written, not run in CI: Qwen3 dense at TP 1 (stream and
import) and TP 2 (stream), Qwen3-MoE at EP 1: equal.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from reco_megatron.testing.multiprocess import run_distributed
from tests.megatron._bridge_shim import ENV, install
from tests.megatron.test_bridge_crosscheck import VOCAB, skip_no_bridge
from tests.megatron.test_convert_qwen3 import build_hf

pytestmark = [pytest.mark.dist, pytest.mark.bridge]


def _crosscheck(rank: int, world: int, hf_dir: str, tp: int, ep: int, src: str) -> dict:
    if src:
        os.environ[ENV] = src
    assert install(), "megatron.bridge does not import in the rank"
    from reco_megatron.megatron.distributed import ParallelConfig, initialize_parallel
    from reco_megatron.megatron.hf.bridge import bridge_hf_weights, bridge_load_hf
    from reco_megatron.megatron.hf.checkpoint import all_stage_hf_weights, load_hf_checkpoint
    from reco_megatron.megatron.hf.config import model_config_from_hf
    from reco_megatron.megatron.hf.converter import choose_converter
    from reco_megatron.megatron.hf.sharding import global_names
    from reco_megatron.megatron.model.build import build_model, transformer_config

    cfg = model_config_from_hf(hf_dir, make_vocab_size_divisible_by=64)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    initialize_parallel(parallel, seed=1)

    def chunks() -> list[Any]:
        config = transformer_config(cfg, parallel, on_gpu=False)
        return [build_model(cfg, config, pre_process=True, post_process=True, on_gpu=False)]

    ours = chunks()
    load_hf_checkpoint(hf_dir, ours, cfg)
    out: dict[str, Any] = {
        "auto": choose_converter("auto", cfg, tp=tp, pp=1, on_gpu=False, importing=tp == 1).name
    }
    ref = dict((n, t.clone()) for n, t in all_stage_hf_weights(ours, cfg))
    got = dict((n, t.detach().cpu().clone()) for n, t in bridge_hf_weights(ours, cfg))
    out["stream_names_equal"] = sorted(ref) == sorted(got)
    out["stream_unequal"] = [n for n in ref if n in got and not torch.equal(ref[n], got[n])]
    if tp == 1:
        theirs = chunks()
        bridge_load_hf(hf_dir, theirs, cfg)
        a = {g: p.detach() for c in ours for _, g, p in global_names(c)}
        b = {g: p.detach() for c in theirs for _, g, p in global_names(c)}
        out["import_unequal"] = [k for k in a if not torch.equal(a[k], b[k])]
    return out


@skip_no_bridge
@pytest.mark.parametrize(("family", "tp", "ep"), [("qwen3_moe", 1, 2)])
def test_bridge_matches_builtin(tmp_path, family: str, tp: int, ep: int) -> None:
    model = build_hf(family)
    model.resize_token_embeddings(VOCAB)
    model.save_pretrained(tmp_path)
    args = (str(tmp_path), tp, ep, os.environ.get(ENV, ""))
    for res in run_distributed(_crosscheck, tp * ep, args=args, timeout=600):
        assert res["auto"] == "megatron_bridge"
        assert res["stream_names_equal"]
        assert res["stream_unequal"] == []
        assert res.get("import_unequal", []) == []
