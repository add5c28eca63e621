"""Device bugs of the GPU path, caught on CPU.

The first GPU run (issue 13) crashed on three bugs no CPU test could see:

1. the GPU path turned megatron's fusions on whenever CUDA was present, while without
   transformer-engine the model falls back to the local spec, whose torch norm asserts
   ``persist_layer_norm`` off -> :func:`test_gpu_path_without_transformer_engine_builds`
   builds the model exactly as the GPU path does, with transformer-engine made unimportable;
2. ``ReCoEngine._run`` fed the trainer's CPU micro-batches to a CUDA model, and
3. ``ReCoEngine.prepare`` mixed the CPU batch's loss mask with CUDA statistics ->
   the engine tests give it batches made of :class:`tests.megatron._host.HostTensor`, CPU
   tensors that refuse to meet the engine's tensors unless moved with ``.to(device)``, which
   is what a CUDA device does with CPU tensors.

Plus the bf16 local spec: norms in the parameter dtype, no ``rms_norm`` dtype warning.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

from reco_megatron.testing import run_distributed
from tests.megatron import _host, _reco

pytestmark = pytest.mark.dist


# ------------------------------------------------------------------ 1: spec and fusions
def _build_gpu_path_body(rank, world_size, params_dtype):
    from megatron.core.transformer import TransformerConfig

    from reco_megatron.megatron.distributed import ParallelConfig
    from reco_megatron.megatron.model.build import build_model, transformer_config
    from tests.megatron import _tiny

    sys.modules["transformer_engine"] = None  # type: ignore[assignment]  # import -> ImportError
    _tiny.init_parallel()
    model_cfg = _reco.model_config(params_dtype=params_dtype)
    config = transformer_config(model_cfg, ParallelConfig(), on_gpu=True)
    assert isinstance(config, TransformerConfig)
    # The CPU backend answers megatron's torch.cuda.current_device() with the CPU, so the GPU
    # path's config (use_cpu_initialization=False) builds here as it would on CUDA.
    gpt = build_model(model_cfg, config, pre_process=True, post_process=True, on_gpu=True)
    tokens = torch.randint(0, model_cfg.vocab_size, (2, 8))
    positions = torch.arange(8).expand(2, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits = gpt(tokens, positions, None)
    return {
        "fusions": {
            k: getattr(config, k)
            for k in (
                "persist_layer_norm",
                "bias_activation_fusion",
                "bias_dropout_fusion",
                "masked_softmax_fusion",
            )
        },
        "shape": tuple(logits.shape),
        "logits_finite": bool(torch.isfinite(logits.float()).all()),
        "param_dtypes": sorted({str(p.dtype) for p in gpt.parameters()}),
        "warnings": [str(w.message) for w in caught],
    }


def test_gpu_path_without_transformer_engine_builds() -> None:
    """Bug 1: fusions and spec chosen together; TE absent -> local spec, no fusions."""
    got = run_distributed(_build_gpu_path_body, 1, args=("float32",), timeout=120)[0]
    assert not any(got["fusions"].values()), got["fusions"]
    assert got["shape"][:2] == (2, 8) and got["logits_finite"]


def test_bf16_local_spec_norms_in_params_dtype_without_warning() -> None:
    got = run_distributed(_build_gpu_path_body, 1, args=("bfloat16",), timeout=120)[0]
    assert got["param_dtypes"] == ["torch.bfloat16"], got["param_dtypes"]
    assert not [w for w in got["warnings"] if "Mismatch dtype" in w], got["warnings"]
    assert got["logits_finite"]


def test_layer_backend_follows_what_imports(monkeypatch, caplog) -> None:
    from reco_megatron.megatron.distributed import ParallelConfig
    from reco_megatron.megatron.model import build as model_mod

    model = _reco.model_config()
    monkeypatch.setattr(model_mod, "_warned", set())
    monkeypatch.setattr(model_mod, "_transformer_engine_importable", lambda: True)
    assert model_mod.layer_backend(model, on_gpu=True) == "transformer_engine"
    assert model_mod.layer_backend(model, on_gpu=False) == "local"
    assert model_mod.attention_backend(model, on_gpu=False) == "torch"
    local = _reco.model_config(attention_backend="local")
    assert model_mod.layer_backend(local, on_gpu=True) == "local"
    assert model_mod.attention_backend(local, on_gpu=True) == "local"
    cfg = model_mod.transformer_config(model, ParallelConfig(), on_gpu=True)
    assert cfg.persist_layer_norm and cfg.masked_softmax_fusion and cfg.bias_dropout_fusion

    monkeypatch.setattr(model_mod, "_transformer_engine_importable", lambda: False)
    with caplog.at_level("WARNING"):
        assert model_mod.layer_backend(model, on_gpu=True) == "local"
        assert model_mod.layer_backend(model, on_gpu=True) == "local"
    assert sum("transformer-engine is not importable" in r.message for r in caplog.records) == 1
    assert model_mod.attention_backend(model, on_gpu=True) == "torch"
    cfg = model_mod.transformer_config(model, ParallelConfig(), on_gpu=True)
    assert not (cfg.persist_layer_norm or cfg.masked_softmax_fusion or cfg.bias_dropout_fusion)


# ------------------------------------------------------------------ 2 and 3: batches
def _plain_cpu(tensor: torch.Tensor | None) -> bool:
    return tensor is None or (not _host.is_host(tensor) and tensor.device.type == "cpu")


def _engine_body(rank, world_size, what):
    engine = _reco.build_engine()
    batch = _host.host_batch(_reco.dp_share(_reco.rollout_batch()))
    if what == "statistics":
        stats = engine.statistics(batch)
        assert stats and all(_plain_cpu(v) for v in stats.values())
        return sorted(stats)
    if what == "sft":
        return engine.sft_step(batch, lr=1e-3)["loss"]
    prepared, metrics = engine.prepare(batch)
    assert prepared.weights is not None and prepared.old_logprobs is not None
    for name in ("old_logprobs", "old_sum_p2", "weights", "tokens", "loss_mask"):
        assert _plain_cpu(getattr(prepared, name)), name  # returned on the CPU
    if what == "prepare":
        return metrics["logprob_mismatch"]
    steps = engine.train_on_rollout(_host.host_batch(prepared))  # it comes back from the CPU
    return [s["loss"] for s in steps]


def test_statistics_moves_the_batch_to_the_engine_device() -> None:
    """Bug 2: the forward pass must not see the trainer's tensors."""
    assert run_distributed(_engine_body, 1, args=("statistics",), timeout=120)[0] == [
        "entropy",
        "logprob",
        "sum_p2",
    ]


def test_prepare_computes_weights_on_the_engine_device() -> None:
    """Bug 3: the loss mask and the statistics meet on the engine's device."""
    mismatch = run_distributed(_engine_body, 1, args=("prepare",), timeout=120)[0]
    assert mismatch == mismatch  # a number (not NaN): the rollout log-probs were compared


def test_train_and_sft_steps_move_their_batches() -> None:
    losses = run_distributed(_engine_body, 1, args=("train",), timeout=120)[0]
    assert len(losses) == 2 and all(x == x for x in losses)
    assert run_distributed(_engine_body, 1, args=("sft",), timeout=120)[0] > 0


def test_a_misplaced_micro_batch_is_named_where_it_enters_the_model() -> None:
    from reco_megatron.megatron.step.loss_layer import make_forward_step

    mb = _reco.rollout_batch()
    step = make_forward_step(lambda *a: None, ctx=None, device=torch.device("meta"))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"tokens is on cpu but the engine computes on meta"):
        step(iter([mb]), model=None)


def test_engine_device_must_be_usable() -> None:
    from reco_megatron.megatron.device import resolve_device

    assert resolve_device(None) == torch.device("cpu")  # tests hide CUDA
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda:0")
    with pytest.raises(ValueError, match="'cpu' or 'cuda"):
        resolve_device("meta")
