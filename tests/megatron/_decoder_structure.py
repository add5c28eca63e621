"""Counting what one decode step does (aten ops, bytes written, host reads), for the structure
tests: a :class:`torch.utils._python_dispatch.TorchDispatchMode` sees every aten op a step
dispatches, eagerly on the CPU, which is what a GPU step launches as kernels."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = {
    "aten::_local_scalar_dense",  # .item(), int(t), bool(t), .tolist()
    "aten::is_nonzero",
    "aten::nonzero",  # output size depends on values: a read-back on CUDA
    "aten::masked_select",
    "aten::equal",
    "aten::_assert_async",
}
INDEXED_WRITES = {"aten::index_put_", "aten::index_put", "aten::_index_put_impl_"}


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class StepCounter(TorchDispatchMode):
    """Counts non-view aten ops, bytes they write (an indexed write counts its values, not
    the tensor it writes into) and host reads (:data:`SYNC_OPS`, plus copies to the CPU from
    another device)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.bytes_written = 0
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        if name in SYNC_OPS:
            self.syncs.append(name)
        if name == "aten::_to_copy" and isinstance(args[0], torch.Tensor):
            target = kwargs.get("device")
            if (
                target is not None
                and torch.device(target).type == "cpu"
                and args[0].device.type != "cpu"
            ):
                self.syncs.append("copy to cpu")
        if getattr(func, "is_view", False):
            return out
        self.ops += 1
        self.bytes_written += _nbytes(args[2]) if name in INDEXED_WRITES else _nbytes(out)
        return out


def profile_body(rank: int, world: int, layers: int, sync_every: int = 8) -> dict[str, Any]:
    """Decode one prompt of 4 tokens for 70 new tokens on a tiny Llama of ``layers`` layers;
    returns per decode step ``(ops, bytes written, host reads)`` and the number of host
    rounds."""
    from functools import partial

    from reco_megatron.megatron.decoding.decoder import MegatronDecoder
    from reco_megatron.rollout.base import SamplingParams
    from reco_megatron.rollout.sampling import sample_next
    from tests.megatron import _reco

    engine = _reco.build_engine(
        model=_reco.model_config(num_layers=layers, max_position_embeddings=128)
    )
    decoder = MegatronDecoder(
        engine.unwrapped(), vocab_size=_reco.VOCAB, max_model_len=128, sync_every=sync_every
    )
    steps: list[tuple[int, int, list[str]]] = []
    rounds = [0]
    step, shrink = decoder._step, decoder._shrink

    def counted_step(*args: Any) -> None:
        with StepCounter() as counter:
            step(*args)
        steps.append((counter.ops, counter.bytes_written, counter.syncs))

    def counted_shrink(*args: Any) -> Any:
        rounds[0] += 1
        return shrink(*args)

    decoder._step, decoder._shrink = counted_step, counted_shrink
    setting = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=70)
    noise = torch.rand(3, 70, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rows = decoder.decode([[5, 6, 7, 8]] * 3, noise, [], partial(sample_next, sampling=setting))
    return {"steps": steps, "rounds": rounds[0], "lengths": [len(r.token_ids) for r in rows]}
