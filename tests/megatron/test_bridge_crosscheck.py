"""Megatron-Bridge's real conversion code against ours, on CPU over gloo.

Runs where ``megatron.bridge`` imports, or where ``$RECO_TEST_MEGATRON_BRIDGE`` names the
unpacked Megatron-Bridge 0.6.2 wheel (``.ci/run`` provides it; see ``_bridge_shim`` for the two
modules it answers with inert stand-ins). Checked, bit for bit (``torch.equal``: both sides copy
or concatenate the same fp32 values, no arithmetic):

* the rollout weight stream, :func:`bridge_hf_weights` vs our ``all_stage_hf_weights``: Llama
  (untied, GQA) and Qwen2 (tied, QKV bias) at TP 1 and 2, Llama at PP 2;
* the import, :func:`bridge_load_hf` vs our ``load_hf_checkpoint``, at TP 1 and PP 2 (the
  bridge's import at TP > 1 needs CUDA);
* ``checkpoint.hf_converter=auto`` picks the bridge here, and ours for a padded vocabulary.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from reco_megatron.testing.multiprocess import run_distributed
from tests.megatron._bridge_shim import ENV, install
from tests.megatron.test_convert import _build_chunks, build_hf

pytestmark = [pytest.mark.dist, pytest.mark.bridge]

HAVE_BRIDGE = install()
skip_no_bridge = pytest.mark.skipif(
    not HAVE_BRIDGE,
    reason=f"Megatron-Bridge does not import here and ${ENV} names no unpacked wheel (.ci/run "
    "sets it on the main stack; the bridge needs Python >= 3.12)",
)

VOCAB = 128  # no padding at TP 1/2 with make_vocab_size_divisible_by=64


def _named(chunks: list[Any]) -> dict[str, torch.Tensor]:
    from reco_megatron.megatron.hf.convert import global_names

    return {g: p.detach().clone() for c in chunks for _, g, p in global_names(c)}


def _crosscheck(rank: int, world: int, hf_dir: str, tp: int, pp: int, src: str) -> dict:
    if src:
        os.environ[ENV] = src
    assert install(), "megatron.bridge does not import in the rank"
    from reco_megatron.megatron.hf.bridge import bridge_hf_weights, bridge_load_hf
    from reco_megatron.megatron.hf.checkpoint import all_stage_hf_weights, load_hf_checkpoint
    from reco_megatron.megatron.hf.config import model_config_from_hf
    from reco_megatron.megatron.hf.converter import choose_converter

    cfg = model_config_from_hf(hf_dir, make_vocab_size_divisible_by=64)
    ours = _build_chunks(cfg, tp, pp)
    load_hf_checkpoint(hf_dir, ours, cfg)
    out: dict[str, Any] = {
        "auto": choose_converter("auto", cfg, tp=tp, pp=pp, on_gpu=False, importing=tp == 1).name
    }
    padded = model_config_from_hf(hf_dir, make_vocab_size_divisible_by=96)
    out["auto_padded"] = choose_converter(
        "auto", padded, tp=tp, pp=pp, on_gpu=False, importing=False
    )
    ref = [(n, t.clone()) for n, t in all_stage_hf_weights(ours, cfg)]
    got = [(n, t.detach().cpu().clone()) for n, t in bridge_hf_weights(ours, cfg)]
    ref_d, got_d = dict(ref), dict(got)
    out["stream_names_equal"] = sorted(ref_d) == sorted(got_d)
    out["stream_unequal"] = [n for n in ref_d if n in got_d and not torch.equal(ref_d[n], got_d[n])]
    out["stream_len"] = (len(ref), len(got))
    if tp == 1:
        theirs = _build_chunks(cfg, tp, pp)
        bridge_load_hf(hf_dir, theirs, cfg)
        a, b = _named(ours), _named(theirs)
        out["import_unequal"] = [k for k in a if not torch.equal(a[k], b[k])]
    return out


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    out = {}
    for family in ("llama", "qwen2"):
        path = tmp_path_factory.mktemp(f"bridge-{family}")
        model = build_hf(family)
        model.resize_token_embeddings(VOCAB)
        model.save_pretrained(path)
        out[family] = str(path)
    return out


@skip_no_bridge
@pytest.mark.parametrize(
    ("family", "tp", "pp"),
    # Qwen2 is tied: PP > 1 with tied embeddings is outside the range auto gives the bridge.
    [("llama", 1, 1), ("llama", 2, 1), ("llama", 1, 2), ("qwen2", 1, 1), ("qwen2", 2, 1)],
)
def test_bridge_matches_builtin(hf_dirs: dict[str, str], family: str, tp: int, pp: int) -> None:
    src = os.environ.get(ENV, "")
    args = (hf_dirs[family], tp, pp, src)
    for res in run_distributed(_crosscheck, tp * pp, args=args, timeout=600):
        assert res["auto"] == "megatron_bridge"
        assert res["auto_padded"].name == "builtin"
        assert "padded" in res["auto_padded"].reason
        assert res["stream_names_equal"], res["stream_len"]
        assert res["stream_unequal"] == []
        assert res.get("import_unequal", []) == []
