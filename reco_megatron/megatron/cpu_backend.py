"""Run the real megatron-core on CPU (gloo): the embedded CPU default of reco-megatron.

megatron-core assumes CUDA in a handful of places that are not about computation: it asks
``torch.cuda.current_device()`` where to allocate buffers, hard-codes ``device="cuda"`` for a
few scalars, calls ``torch.cuda.synchronize()`` / ``torch.cuda.current_stream()`` around
communication, checks ``param.type() == 'torch.cuda.FloatTensor'`` in the distributed
optimizer and keeps its model-parallel RNG states as CUDA generator states. On a machine
without CUDA each of these raises. :func:`enable_cpu_backend` redirects exactly these, and
nothing that can already work:

* it replaces the module-level name ``torch`` *inside the listed megatron modules* by a thin
  proxy whose ``torch.cuda.current_device / synchronize / current_stream`` answer for the CPU
  and whose tensor factories map ``device="cuda"`` to the CPU; ``torch`` itself, and every
  other module, is untouched;
* it wraps ``DistributedOptimizer._build_model_and_main_param_groups`` so that, for the
  duration of that call only, a CPU float32 parameter reports the type name the check expects;
* it installs :class:`CpuRNGStatesTracker` as megatron's model-parallel RNG tracker.

Every patch is recorded (:func:`applied_patches`); ``docs/cpu-backend.md`` lists them with the
megatron-core versions that need them, and a test checks the two agree. When CUDA is
available, :func:`enable_cpu_backend` logs one line and changes nothing (unless ``force``).

Usage::

    from reco_megatron.megatron.cpu_backend import enable_cpu_backend, model_parallel_seed
    enable_cpu_backend()                 # no-op on a GPU machine
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_seed(1234)            # CPU tracker here, megatron's CUDA seeding on GPU
"""

from __future__ import annotations

import functools
import importlib
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from reco_megatron.megatron.cpu_rng import CpuRNGStatesTracker, install_cpu_rng_tracker
from reco_megatron.utils.logging import get_logger

__all__ = [
    "CpuRNGStatesTracker",
    "Patch",
    "applied_patches",
    "cpu_backend_enabled",
    "enable_cpu_backend",
    "model_parallel_seed",
    "validate_cpu_config",
]

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

_patches: list[Patch] = []
_state: dict[str, bool] = {"enabled": False, "decided": False}


def _cpu_device(device: Any) -> Any:
    """Map a CUDA device spec (``"cuda"``, ``"cuda:0"``, ``torch.device("cuda")``) to CPU."""
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _redirect_factory(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def factory(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)  # pinning needs a CUDA host allocator
        return fn(*args, **kwargs)

    return factory


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` as seen by a proxied megatron module: device queries answer CPU."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

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
    """While active, ``t.type()`` of a CPU tensor names its CUDA type (e.g. FloatTensor)."""
    original = torch.Tensor.type

    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kw: Any) -> Any:
        if dtype is None and not kw and self.device.type == "cpu":
            return original(self).replace("torch.", "torch.cuda.", 1)
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


def _patch_type_checks() -> None:
    """Run the functions that assert ``.type() == 'torch.cuda.FloatTensor'`` under the alias."""
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as moptimizer

    cls = distrib_optimizer.DistributedOptimizer
    original = cls.__dict__["_build_model_and_main_param_groups"]
    wrapper_type = type(original) if isinstance(original, staticmethod | classmethod) else None
    inner = original.__func__ if wrapper_type else original
    build = _under_cuda_type_names(inner)
    cls._build_model_and_main_param_groups = wrapper_type(build) if wrapper_type else build
    _patches.append(
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
            _patches.append(
                Patch(
                    f"{module.__name__}.clip_grad_by_total_norm_fp32",
                    "gradient clipping asserts grad.type() == 'torch.cuda.FloatTensor'; CPU "
                    "tensors report their CUDA type name during this call only",
                )
            )


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


def _patch_tied_embedding_setup() -> None:
    """Tied embeddings with PP > 1: the last stage moves its copy to CUDA before syncing it."""
    from megatron.core.models.common.language_module import language_module

    cls = language_module.LanguageModule
    original = cls.setup_embeddings_and_output_layer

    @functools.wraps(original)
    def setup(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _tensor_cuda_is_identity():
            return original(self, *args, **kwargs)

    cls.setup_embeddings_and_output_layer = setup
    _patches.append(
        Patch(
            f"{language_module.__name__}.LanguageModule.setup_embeddings_and_output_layer",
            "with tied embeddings and PP > 1 the last stage calls weight.data.cuda() before "
            "all-reducing its copy over the embedding group; Tensor.cuda() is the identity "
            "during this call only",
        )
    )


def _proxy_modules() -> None:
    proxy = _CpuTorch()
    for name, reason in _PROXIED_MODULES.items():
        try:
            module = importlib.import_module(name)
        except ImportError:
            logger.debug("cpu backend: %s not in this megatron-core, not patched", name)
            continue
        if getattr(module, "torch", None) is not torch:
            continue  # module does not use the name `torch`
        module.torch = proxy  # type: ignore[attr-defined]
        _patches.append(Patch(f"{name}.torch", reason))


def enable_cpu_backend(force: bool = False) -> bool:
    """Make megatron-core run on CPU with gloo; returns whether the backend is active.

    Idempotent: the first call decides and logs once, later calls return the same answer.
    With CUDA available (and ``force`` false) it changes nothing and logs that. ``force=True``
    applies the patches even where CUDA is available (tests of the CPU path on a GPU box).
    """
    if _state["enabled"] or (_state["decided"] and not force):
        return _state["enabled"]
    _state["decided"] = True
    if torch.cuda.is_available() and not force:
        logger.info("CUDA is available: megatron-core runs on GPU, CPU backend not enabled")
        return False
    _proxy_modules()
    _patch_type_checks()
    _patch_tied_embedding_setup()
    install_cpu_rng_tracker()
    _patches.append(
        Patch(
            "megatron.core.tensor_parallel.random._CUDA_RNG_STATE_TRACKER",
            "megatron keeps model-parallel RNG states as CUDA generator states; replaced by "
            "CpuRNGStatesTracker (forks torch's CPU generator)",
        )
    )
    _state["enabled"] = True
    import megatron.core

    logger.info(
        "CPU backend enabled for megatron-core %s: %d patches (see docs/cpu-backend.md)",
        getattr(megatron.core, "__version__", "?"),
        len(_patches),
    )
    return True


def cpu_backend_enabled() -> bool:
    """Whether :func:`enable_cpu_backend` has applied its patches in this process."""
    return _state["enabled"]


def applied_patches() -> list[Patch]:
    """The patches applied in this process, in order (empty when the backend is off)."""
    return list(_patches)


def model_parallel_seed(seed: int) -> None:
    """Seed the default and model-parallel RNG states on CPU or GPU.

    On GPU (backend off) this is megatron's ``model_parallel_cuda_manual_seed(seed)``. On CPU it
    mirrors it on torch's CPU generator: the default generator gets ``seed`` (data-parallel
    state), and the tracker gets ``seed + 2718 + tp_rank`` (model-parallel state, differs across
    TP ranks) and ``seed + 1024 + 100 * ep_rank + etp_rank`` (expert state). Call it after
    ``initialize_model_parallel``.
    """
    if not _state["enabled"]:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
        return
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    tracker = install_cpu_rng_tracker()
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(
        mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME,
        seed + 2718 + ps.get_tensor_model_parallel_rank(),
    )
    expert_seed = (
        seed
        + 1024
        + 100 * ps.get_expert_model_parallel_rank()
        + ps.get_expert_tensor_parallel_rank()
    )
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, expert_seed)


def validate_cpu_config(config: Any) -> None:
    """Reject TransformerConfig options the CPU backend cannot run, saying what to change.

    Raises ``ValueError`` when the backend is active and ``config`` asks for something that
    needs CUDA-only kernels. Does nothing when the backend is off.
    """
    if not _state["enabled"]:
        return
    problems = []
    if getattr(config, "sequence_parallel", False):
        problems.append(
            "sequence_parallel=True: not supported with the CPU layer spec "
            "(get_gpt_layer_local_spec, torch LayerNorm), where megatron-core fails to run it; "
            "set sequence_parallel=False on CPU (keep it for GPU runs with the Transformer "
            "Engine spec)"
        )
    if getattr(config, "fp16", False):
        problems.append(
            "fp16=True: fp16 loss scaling keeps its scale on CUDA; use fp32 or bf16=True on CPU"
        )
    if problems:
        raise ValueError("CPU backend cannot run this config:\n- " + "\n- ".join(problems))
