"""The redirections the CPU backend applies to megatron-core, one function per kind.

Each function applies its redirection and returns the :class:`Patch` records it made;
:func:`reco_megatron.megatron.compat.cpu_backend.enable_cpu_backend` decides when to call them
and keeps the record. Nothing here runs at import time.

* :func:`proxy_modules`: the module-level ``torch`` of the listed megatron modules becomes a
  proxy whose ``torch.cuda`` device queries answer CPU and whose factories map ``"cuda"`` to CPU;
* :func:`patch_type_checks`: functions asserting ``.type() == 'torch.cuda.FloatTensor'`` see
  the CUDA type name of CPU tensors during the call only;
* :func:`patch_tied_embedding_setup`: ``Tensor.cuda()`` is the identity while the last pipeline
  stage sets up its tied embedding copy.
"""

from __future__ import annotations

import functools
import importlib
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class Patch:
    """One redirection applied by :func:`enable_cpu_backend`."""

    target: str
    """Dotted name of what was replaced, e.g. ``megatron.core.utils.torch``."""
    reason: str
    """Which CUDA-only call it makes work on CPU."""


# Megatron modules whose module-level ``torch`` is replaced by the CPU proxy, with the call
# that needs it. A module missing from the installed megatron-core is skipped (not recorded).
_PROXIED_MODULES: dict[str, str] = {
    "megatron.core.utils": "GlobalMemoryBuffer allocates on torch.cuda.current_device()",
    "megatron.core.tensor_parallel.mappings": "gather/split along dims allocate on "
    "torch.cuda.current_device()",
    "megatron.core.tensor_parallel.layers": "weight allocation and sequence-parallel gathers "
    "use torch.cuda.current_device()",
    "megatron.core.tensor_parallel.utils": "split/gather helpers allocate on "
    "torch.cuda.current_device()",
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "RoPE frequencies are "
    "created on torch.cuda.current_device()",
    "megatron.core.transformer.attention": "KV buffers allocated on torch.cuda.current_device()",
    "megatron.core.transformer.utils": "get_default_causal_mask (attention_mask=None) builds "
    "the mask with device='cuda'",
    "megatron.core.transformer.dot_product_attention": "attention-mask buffers on "
    "torch.cuda.current_device()",
    "megatron.core.pipeline_parallel.schedules": "total_num_tokens = torch.zeros(..., "
    "device='cuda')",
    "megatron.core.pipeline_parallel.p2p_communication": "torch.cuda.synchronize() after "
    "batched p2p and shape tensors on torch.cuda.current_device()",
    "megatron.core.distributed.distributed_data_parallel": "torch.cuda.synchronize() around "
    "buffer (de)allocation",
    "megatron.core.distributed.param_and_grad_buffer": "grad buffers on "
    "torch.cuda.current_device(); torch.cuda.current_stream() before grad sync (0.19)",
    "megatron.core.optimizer.optimizer": "found_inf / scale tensors created with device='cuda'",
    "megatron.core.optimizer.clip_grads": "grad-norm tensors created with device='cuda'",
    "megatron.core.optimizer.distrib_optimizer": "shard buffers on torch.cuda.current_device()",
    "megatron.core.dist_checkpointing.exchange_utils": "loaded shards exchanged via "
    "torch.empty_like(..., device='cuda')",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": "save finalisation "
    "all-reduces a failure flag created on torch.cuda.current_device()",
    "megatron.core.dist_checkpointing.strategies.fully_parallel": "fully-parallel save/load "
    "exchange buffers on torch.cuda.current_device()",
    "megatron.core.dist_checkpointing.strategies.async_utils": "async-save liveness checks "
    "on torch.cuda.current_device(); torch.cuda.synchronize()",
    "megatron.core.dist_checkpointing.strategies.filesystem_async": "torch.cuda.synchronize() "
    "before writing",
}

_DISTRIB_OPTIMIZER = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer"
_FACTORIES = frozenset(
    {
        "empty",
        "zeros",
        "ones",
        "full",
        "tensor",
        "arange",
        "rand",
        "randn",
        "randint",
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "as_tensor",
    }
)


_TARGET = [torch.device("cpu")]
"""Where the redirected CUDA allocations go: the CPU, or the meta device inside
:func:`allocations_on_meta` (shapes without storage: what a layout would allocate)."""


@contextmanager
def allocations_on_meta() -> Iterator[None]:
    """While active, what the proxied megatron modules would allocate on CUDA (gradient
    buffers, distributed-optimizer shards, ...) is created on the meta device, and meta
    tensors pass megatron's CUDA type checks like CPU tensors: the real code computes every
    shape of a layout that would not fit in memory (``megatron.memory.census``)."""
    _TARGET[0] = torch.device("meta")
    try:
        yield
    finally:
        _TARGET[0] = torch.device("cpu")


def _cpu_device(device: Any) -> Any:
    """Map a CUDA device spec (``"cuda"``, ``"cuda:0"``, ``torch.device("cuda")``) to CPU
    (the meta device inside :func:`allocations_on_meta`)."""
    if isinstance(device, str) and device.startswith("cuda"):
        return _TARGET[0]
    if isinstance(device, torch.device) and device.type == "cuda":
        return _TARGET[0]
    return device


def _redirect_factory(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def factory(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)  # pinning needs a CUDA host allocator
        return fn(*args, **kwargs)

    return factory


class _CpuEvent:
    """A CUDA event on the CPU: every op has completed when it returns, so nothing to wait for."""

    def record(self, stream: Any = None) -> None:
        """Nothing to mark."""

    def synchronize(self) -> None:
        """Already complete."""

    def wait(self, stream: Any = None) -> None:
        """Already complete."""

    def query(self) -> bool:
        return True


class _CpuStream:
    """A side CUDA stream on the CPU (MoE token dispatchers copy split sizes on one): CPU ops
    and gloo collectives are synchronous, so waits are no-ops and events are complete."""

    def wait_stream(self, stream: Any) -> None:
        """Nothing to wait for."""

    def wait_event(self, event: Any) -> None:
        """Nothing to wait for."""

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        """Nothing to wait for."""


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` as seen by a proxied megatron module: device queries answer CPU, streams
    and events are the synchronous stand-ins above."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")

    @staticmethod
    def current_device() -> torch.device:
        return _TARGET[0]

    @staticmethod
    def Stream(*args: Any, **kwargs: Any) -> _CpuStream:
        return _CpuStream()

    @staticmethod
    def Event(*args: Any, **kwargs: Any) -> _CpuEvent:
        return _CpuEvent()

    @staticmethod
    def stream(stream: Any = None) -> Any:
        return nullcontext()

    @staticmethod
    def synchronize(device: Any = None) -> None:
        """Nothing to wait for: CPU ops (and gloo collectives) complete synchronously."""

    @staticmethod
    def current_stream(device: Any = None) -> Any:
        return torch.cpu.current_stream()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _CpuTorch(types.ModuleType):
    """``torch`` as seen by a proxied megatron module; everything else forwards to torch."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, _redirect_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@contextmanager
def _cuda_float_type_names() -> Iterator[None]:
    """While active, ``t.type()`` of a CPU (or meta) tensor names its CUDA type."""
    original = torch.Tensor.type

    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kw: Any) -> Any:
        if dtype is None and not kw and self.device.type in ("cpu", "meta"):
            name = original(self).replace("torch.meta.", "torch.", 1)
            return name.replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kw)

    torch.Tensor.type = type_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]


def _under_cuda_type_names(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with _cuda_float_type_names():
            return fn(*args, **kwargs)

    return call


def patch_type_checks() -> list[Patch]:
    """Run the functions that assert ``.type() == 'torch.cuda.FloatTensor'`` under the alias."""
    out: list[Patch] = []
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as moptimizer

    cls = distrib_optimizer.DistributedOptimizer
    original = cls.__dict__["_build_model_and_main_param_groups"]
    wrapper_type = type(original) if isinstance(original, staticmethod | classmethod) else None
    inner = original.__func__ if wrapper_type else original
    build = _under_cuda_type_names(inner)
    cls._build_model_and_main_param_groups = wrapper_type(build) if wrapper_type else build
    out.append(
        Patch(
            f"{_DISTRIB_OPTIMIZER}._build_model_and_main_param_groups",
            "asserts param.type() == 'torch.cuda.FloatTensor'; CPU tensors report their CUDA "
            "type name during this call only",
        )
    )
    clip = _under_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    for module in (clip_grads, moptimizer):  # optimizer.py imported the name at import time
        if getattr(module, "clip_grad_by_total_norm_fp32", None) is not None:
            module.clip_grad_by_total_norm_fp32 = clip
            out.append(
                Patch(
                    f"{module.__name__}.clip_grad_by_total_norm_fp32",
                    "gradient clipping asserts grad.type() == 'torch.cuda.FloatTensor'; CPU "
                    "tensors report their CUDA type name during this call only",
                )
            )
    return out


@contextmanager
def _tensor_cuda_is_identity() -> Iterator[None]:
    """While active, ``tensor.cuda()`` returns the tensor unchanged (it stays on the CPU)."""
    original = torch.Tensor.cuda

    def cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self

    torch.Tensor.cuda = cuda  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


def patch_tied_embedding_setup() -> list[Patch]:
    """Tied embeddings with PP > 1: the last stage moves its copy to CUDA before syncing it."""
    from megatron.core.models.common.language_module import language_module

    cls = language_module.LanguageModule
    original = cls.setup_embeddings_and_output_layer

    @functools.wraps(original)
    def setup(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _tensor_cuda_is_identity():
            return original(self, *args, **kwargs)

    cls.setup_embeddings_and_output_layer = setup
    return [
        Patch(
            f"{language_module.__name__}.LanguageModule.setup_embeddings_and_output_layer",
            "with tied embeddings and PP > 1 the last stage calls weight.data.cuda() before "
            "all-reducing its copy over the embedding group; Tensor.cuda() is the identity "
            "during this call only",
        )
    ]


def proxy_modules(modules: dict[str, str] | None = None) -> list[Patch]:
    """Replace the module-level ``torch`` of each listed megatron module (``{name: reason}``,
    default :data:`_PROXIED_MODULES`) by the CPU proxy."""
    proxy = _CpuTorch()
    out: list[Patch] = []
    for name, reason in (_PROXIED_MODULES if modules is None else modules).items():
        try:
            module = importlib.import_module(name)
        except ImportError:
            logger.debug("cpu backend: %s not in this megatron-core, not patched", name)
            continue
        if getattr(module, "torch", None) is not torch:
            continue  # module does not use the name `torch`
        module.torch = proxy  # type: ignore[attr-defined]
        out.append(Patch(f"{name}.torch", reason))
    return out
