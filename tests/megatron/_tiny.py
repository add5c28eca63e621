"""Tiny GPTModel builders shared by the megatron tests (and, later, the ReCo loss-layer tests).

Everything here runs *inside* a rank started by ``run_distributed``: the CPU backend is enabled,
``parallel_state`` is initialised for the requested TP/PP, and the model is a 2-layer GPT with
the local (torch) layer spec, fp32, RoPE, untied embeddings, dropout 0 unless asked.

Parallel runs are compared with a single-process reference by *copying* the reference weights
into the parallel model (:func:`load_reference`) rather than by relying on identical random
initialisation, so a comparison fails only if the parallel computation differs.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

LAYERS, HIDDEN, HEADS, VOCAB, SEQ = 2, 64, 4, 128, 16
SEED = 1234


def init_parallel(tp: int = 1, pp: int = 1, seed: int = SEED) -> None:
    """Enable the CPU backend, initialise model parallelism and seed the RNG tracker."""
    from reco_megatron.megatron.compat import versions as compat
    from reco_megatron.megatron.compat.cpu_backend import enable_cpu_backend, model_parallel_seed

    enable_cpu_backend()
    compat.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model_parallel_seed(seed)


def tiny_config(tp: int = 1, pp: int = 1, dropout: float = 0.0, **overrides: Any) -> Any:
    """A TransformerConfig for the tiny model (fp32, CPU initialisation)."""
    from megatron.core.transformer import TransformerConfig

    kwargs: dict[str, Any] = dict(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=4 * HIDDEN,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_tiny_gpt(config: Any, seed: int = SEED) -> Any:
    """The tiny GPTModel for this pipeline stage (pre/post process from ``parallel_state``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from reco_megatron.megatron.compat.cpu_backend import validate_cpu_config
    from reco_megatron.megatron.compat.versions import build_gpt_model

    validate_cpu_config(config)
    torch.manual_seed(seed)
    return build_gpt_model(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )


def tiny_batch(batch_size: int, seed: int = 7) -> dict[str, torch.Tensor]:
    """Random tokens ``[B, S]``, next-token labels ``[B, S]``, positions, and a loss mask."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=gen)
    mask = torch.ones(batch_size, SEQ)
    mask[:, -3:] = 0.0  # masked tail: the loss must honour the mask
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(SEQ).expand(batch_size, SEQ).contiguous(),
        "loss_mask": mask,
    }


def split_batch(batch: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    """Split every tensor of ``batch`` into ``parts`` equal micro-batches along dim 0."""
    chunks = {k: v.chunk(parts) for k, v in batch.items()}
    return [{k: chunks[k][i] for k in batch} for i in range(parts)]


def _loss_func(loss_mask: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Token-mean loss of one micro-batch; megatron's schedule divides by num_microbatches."""
    loss = (output.float() * loss_mask).sum() / loss_mask.sum()
    # clone: the schedule divides the returned loss in place by num_microbatches.
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator: Iterator[dict], model: Any) -> tuple[torch.Tensor, Any]:
    """A megatron ``forward_step_func`` for the tiny model (per-token loss output)."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


def run_forward_backward(
    model: Any, micro_batches: list[dict[str, torch.Tensor]], forward_only: bool = False
) -> list[dict]:
    """Run megatron's ``get_forward_backward_func()`` over ``micro_batches``."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    chunks = model if isinstance(model, list) else [model]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=chunks,
        num_microbatches=len(micro_batches),
        seq_length=SEQ,
        micro_batch_size=micro_batches[0]["tokens"].shape[0],
        forward_only=forward_only,
    )


def _layer_offset() -> int:
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    return ps.get_pipeline_model_parallel_rank() * (LAYERS // pp)


def global_name(name: str) -> str:
    """Parameter name in the single-stage model: shift ``layers.<i>`` by this stage's offset."""
    name = name.removeprefix("module.")
    offset = _layer_offset()
    return re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + offset}.", name)


def _tp_shard(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    if not getattr(param, "tensor_model_parallel", False):
        return full
    tp = ps.get_tensor_model_parallel_world_size()
    return full.chunk(tp, dim=param.partition_dim)[ps.get_tensor_model_parallel_rank()]


def load_reference(model: Any, reference: dict[str, torch.Tensor]) -> None:
    """Copy full (TP=1, PP=1) reference weights into this rank's shard of ``model``."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(_tp_shard(reference[global_name(name)], param))


def gather_tp(tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """All-gather a TP-sharded tensor (shaped like ``param``) into the full tensor."""
    from megatron.core import parallel_state as ps

    if not getattr(param, "tensor_model_parallel", False):
        return tensor.detach().clone()
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim)


def full_named(model: Any, what: str = "param") -> dict[str, torch.Tensor]:
    """Full (TP-gathered) parameters or grads of this stage, keyed by single-stage names.

    ``what`` is ``"param"``, ``"grad"`` (``.grad``) or ``"main_grad"`` (DDP's buffer).
    """
    out = {}
    for name, param in model.named_parameters():
        tensor = param if what == "param" else getattr(param, what)
        out[global_name(name)] = gather_tp(tensor, param)
    return out
