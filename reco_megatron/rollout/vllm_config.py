"""The colocated vLLM engine's settings, and the keyword arguments they become for ``vllm.LLM``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CPU_KV_CACHE_BYTES = 256 * 2**20
"""KV cache of an engine on CPU when ``kv_cache_memory_bytes`` is unset (256 MiB: ~128k tokens
of ``examples/tiny_cpu.yaml``'s model)."""


@dataclass(kw_only=True)
class VLLMEngineConfig:
    """Settings of :class:`VLLMEngine` (passed to ``vllm.LLM``)."""

    model: str
    """Path of a Hugging Face model directory (config + tokenizer; weights may be dummies
    when ``load_format="dummy"``, since the trainer pushes them)."""

    tensor_parallel_size: int = 1
    """vLLM TP size; must equal the training TP size (see the module docstring)."""

    max_model_len: int = 4096
    """Longest prompt + response in tokens."""

    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take (weights + KV cache) while awake, in (0, 1]
    (unused on CPU, where vLLM would read it as a share of host RAM)."""

    kv_cache_memory_bytes: int | None = None
    """KV cache size per engine in bytes; ``None``: sized from ``gpu_memory_utilization`` on a
    GPU, :data:`CPU_KV_CACHE_BYTES` on CPU. Set, it overrides ``gpu_memory_utilization``."""

    dtype: str = "bfloat16"
    """Weight / activation dtype of the vLLM model."""

    load_format: str = "dummy"
    """``"dummy"`` skips reading weights from disk (they come from ``update_weights``);
    ``"auto"`` loads the checkpoint at ``model``."""

    seed: int = 0
    """vLLM's engine seed; identical on every rank of a TP group."""

    enforce_eager: bool | None = None
    """Run without compiling (GPU: without CUDA graphs; slower, less memory); ``None``: eager on
    CPU (vLLM's inductor compile takes ~45 s at start-up there), compiled on a GPU."""

    rollback_failed_push: bool = True
    """Keep a host copy of the engine's weights during each push and put it back when the push
    fails (else the model is left half old, half new; generation refuses either way until a
    complete push). Costs one copy of the engine's weights in host memory per push."""

    skip_tokenizer_init: bool = True
    """Build no tokenizer: prompts go in as token ids and responses come back as ids. vLLM
    otherwise loads one from ``model`` and fails when the directory has none (the trainer's
    has only ``config.json``)."""

    enable_prefix_caching: bool = True
    """Reuse KV blocks of shared prompt prefixes (the G copies of a prompt); reset on every
    weight update."""

    return_routed_experts: bool = False
    """Mixture-of-experts models: have vLLM return each position's experts
    (``enable_return_routed_experts``, for routing replay; see ``vllm_requests``)."""

    extra_llm_kwargs: dict[str, Any] | None = None
    """More keyword arguments for ``vllm.LLM`` (must not override the ones set here)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty path, got {self.model!r}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be an int >= 1, got {self.tensor_parallel_size!r}"
            )
        if not isinstance(self.max_model_len, int) or self.max_model_len < 2:
            raise ValueError(f"max_model_len must be an int >= 2, got {self.max_model_len!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        kv = self.kv_cache_memory_bytes
        if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv < 2**20):
            raise ValueError(
                f"kv_cache_memory_bytes must be None or an int >= 1 MiB (2**20), got {kv!r}"
            )

    def llm_kwargs(self, *, cpu: bool = False, sleep_mode: bool = True) -> dict[str, Any]:
        """Keyword arguments of ``vllm.LLM`` on a CPU (``cpu``) or GPU platform that has
        ``sleep_mode`` or not (pure; tested without vLLM)."""
        eager = cpu if self.enforce_eager is None else self.enforce_eager
        kwargs: dict[str, Any] = {
            "model": self.model,
            "tensor_parallel_size": self.tensor_parallel_size,
            "max_model_len": self.max_model_len,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "dtype": self.dtype,
            "load_format": self.load_format,
            "seed": self.seed,
            "enforce_eager": eager,
            "enable_prefix_caching": self.enable_prefix_caching,
            "skip_tokenizer_init": self.skip_tokenizer_init,
            "distributed_executor_backend": "external_launcher",
            "enable_sleep_mode": sleep_mode,
            "logprobs_mode": "processed_logprobs",
        }
        if cpu:
            kwargs["enable_chunked_prefill"] = False
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes or CPU_KV_CACHE_BYTES
        elif self.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        if self.return_routed_experts:
            kwargs["enable_return_routed_experts"] = True
        extra = dict(self.extra_llm_kwargs or {})
        clash = sorted(set(extra) & set(kwargs))
        if clash:
            raise ValueError(f"extra_llm_kwargs may not override {clash}; set the fields instead")
        kwargs.update(extra)
        return kwargs
