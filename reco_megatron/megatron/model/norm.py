"""The normalisation layer of megatron's local (no transformer-engine) layer spec, with
sequence parallelism.

megatron-core's local spec builds its norms with ``WrappedTorchNorm``, which asserts
``not config.sequence_parallel``: under sequence parallelism each tensor-parallel rank holds a
slice of the sequence, ``[S/TP, B, H]``, and a norm's weight then receives only that slice's
share of its gradient. transformer-engine's norms (what the GPU spec uses) solve this by
marking their parameters ``param.sequence_parallel = True``; megatron-core's
``finalize_model_grads`` (``_allreduce_non_tensor_model_parallel_grads``, 0.16 and 0.19;
``_allreduce_layernorm_grads`` before) then sums the gradients of every such parameter over
the tensor-parallel group before the optimizer step. :class:`SequenceParallelNorm` does the
same, so ``parallel.sequence_parallel: true`` runs on CPU and on a GPU without
transformer-engine.

The normalisation itself is per token (over ``H``), so a sequence slice needs no
communication in the forward. Statistics are fp32 whatever the activation dtype, as in
transformer-engine: ``torch.nn.functional.rms_norm`` / ``layer_norm`` with the input and the
weight in the parameter dtype accumulate the mean (and variance) in fp32 and round only the
output (torch's "opmath"; CPU and CUDA), and autograd saves the input in its own dtype plus
the fp32 statistics, not an upcast copy. In fp32 the layer is bit-identical to
``torch.nn.RMSNorm`` / ``LayerNorm`` (what the local spec built before); parameter names
(``weight``, ``bias``) and hence checkpoints are unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

NORMALIZATIONS = ("RMSNorm", "LayerNorm")


class SequenceParallelNorm(torch.nn.Module):
    """RMSNorm or LayerNorm (``config.normalization``) over the last dimension, with the
    parameters marked for megatron's tensor-parallel gradient sum under sequence parallelism.

    Built by megatron's layer specs as ``norm(config=..., hidden_size=..., eps=...)``; the
    other keyword arguments megatron's norm builders accept are ignored, as
    ``WrappedTorchNorm`` does. Input ``[..., hidden_size]`` (``[S(/TP), B, H]`` in a
    transformer layer), output the same shape and dtype.
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__()
        normalization = getattr(config, "normalization", "LayerNorm")
        if normalization not in NORMALIZATIONS:
            raise ValueError(
                f"normalization={normalization!r} is not supported by reco-megatron's local "
                f"norm: use one of {', '.join(NORMALIZATIONS)}"
            )
        for flag in ("layernorm_zero_centered_gamma", "memory_efficient_layer_norm"):
            if getattr(config, flag, False):
                raise ValueError(
                    f"{flag}=True is not supported by reco-megatron's local norm (a "
                    "transformer-engine option): set it to False or use the transformer-engine spec"
                )
        self.rms = normalization == "RMSNorm"
        self.hidden_size = int(hidden_size)
        self.eps = float(eps)
        dtype = getattr(config, "params_dtype", torch.float32)
        self.weight = torch.nn.Parameter(torch.ones(self.hidden_size, dtype=dtype))
        self.bias = (
            None if self.rms else torch.nn.Parameter(torch.zeros(self.hidden_size, dtype=dtype))
        )
        # Read by megatron's finalize_model_grads: summed over the TP group when
        # config.sequence_parallel (each rank saw only its slice of the sequence).
        for param in self.parameters():
            param.sequence_parallel = bool(getattr(config, "sequence_parallel", False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (self.hidden_size,)
        if self.rms:
            return F.rms_norm(x, shape, self.weight, self.eps)
        return F.layer_norm(x, shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        kind = "RMSNorm" if self.rms else "LayerNorm"
        return f"{kind}({self.hidden_size}, eps={self.eps})"
