"""Decoding without sequence parallelism on a model trained with it.

A decode step feeds one position per row, which cannot be split over the TP group, and
megatron-core's inference path runs dense layers without sequence parallelism (its own
controller switches it off for MoE models the same way, ``set_model_to_sequence_parallel``).
:func:`sequence_parallel_off` switches it off for the duration of a block (the config flag and
the modules' copies of it, restored after); the plain tensor-parallel forward computes the same
function of the same weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_SP_ATTRIBUTES = ("sequence_parallel", "scatter_to_sequence_parallel", "reduce_scatter_embeddings")
"""What megatron-core's modules copy from ``config.sequence_parallel`` at construction
(``ColumnParallelLinear``/``RowParallelLinear``, the embedding and its vocabulary-parallel
table): the attributes ``megatron.core.transformer.utils.set_model_to_sequence_parallel``
switches."""


@contextmanager
def sequence_parallel_off(model: Any) -> Iterator[None]:
    """Run ``model`` (a ``GPTModel`` chunk) without sequence parallelism inside the block.

    Sets ``model.config.sequence_parallel`` (shared by every module of the chunk) and each
    module's own copy (:data:`_SP_ATTRIBUTES`) to False, and restores every value it changed
    on exit, exception or not. A no-op when sequence parallelism is off. Only for forward
    passes that leave no gradients (decoding): parameters keep their marks.
    """
    config = model.config
    if not getattr(config, "sequence_parallel", False):
        yield
        return
    saved = [
        (module, name, vars(module)[name])
        for module in model.modules()
        for name in _SP_ATTRIBUTES
        if name in vars(module)
    ]
    try:
        config.sequence_parallel = False
        for module, name, _ in saved:
            setattr(module, name, False)
        yield
    finally:
        config.sequence_parallel = True
        for module, name, value in saved:
            setattr(module, name, value)
