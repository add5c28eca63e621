"""A thin vLLM rollout engine, colocated with training (GPU only; never imported in CI).

Written against vLLM's public ``LLM`` API of the **0.10.2 - 0.11.x** line (V1 engine), read
from its source, not executed here (no GPU in development or CI; the ``vllm``-marked test runs
where vLLM and a GPU are present). What it relies on:

* ``LLM(..., distributed_executor_backend="external_launcher")``: vLLM runs inside the training
  processes (started by torchrun / Slurm) and reuses their ``torch.distributed`` world, building
  tensor-parallel groups of ``tensor_parallel_size`` *consecutive* ranks. **Requirements**: the
  vLLM TP size equals the training TP size, Megatron's rank order keeps TP innermost (its
  default), and *every rank of a TP group calls* :meth:`VLLMEngine.generate` *with the same
  prompts and the same* ``SamplingParams`` *(including the seed)*; ranks of different TP groups
  (data-parallel replicas, pipeline stages) are independent engines and get different prompts.
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine core in-process (set unless present).
* ``enable_sleep_mode=True`` with ``LLM.sleep(level=1)`` (weights to host, KV cache dropped)
  and ``LLM.wake_up()``.
* ``LLM.apply_model(fn)``: runs ``fn(model)`` on the worker's model in this process; the model's
  ``load_weights(weights)`` takes the same ``(hf_name, full_tensor)`` stream the embedded engine
  takes and shards it for TP itself. ``LLM.reset_prefix_cache()`` afterwards, so no KV block
  computed with the old weights is reused.
* ``SamplingParams(n, temperature, top_p, top_k, max_tokens, seed, logprobs=0, stop_token_ids)``
  with the engine built with ``logprobs_mode="processed_logprobs"`` (added in 0.10.2): the
  sampled token's log-prob comes after temperature scaling, like the trainer's. Caveat: vLLM's
  "processed" log-probs are taken *after* top-k/top-p truncation (renormalised over the kept
  tokens) while the embedded engine and the trainer use the untruncated distribution; with
  ``top_p=1, top_k=0`` (the RL default) they coincide, otherwise this engine warns once and the
  mismatch metrics show the gap.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from reco_megatron.rollout.base import (
    Completion,
    RolloutEngine,
    SamplingArg,
    SamplingParams,
    validate_requests,
)
from reco_megatron.rollout.sampling import call_seed
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)


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
    """Fraction of GPU memory vLLM may take (weights + KV cache) while awake, in (0, 1]."""

    dtype: str = "bfloat16"
    """Weight / activation dtype of the vLLM model."""

    load_format: str = "dummy"
    """``"dummy"`` skips reading weights from disk (they come from ``update_weights``);
    ``"auto"`` loads the checkpoint at ``model``."""

    seed: int = 0
    """vLLM's engine seed; identical on every rank of a TP group."""

    enforce_eager: bool = False
    """Disable CUDA graphs (slower, less memory, easier debugging)."""

    enable_prefix_caching: bool = True
    """Reuse KV blocks of shared prompt prefixes (the G copies of a prompt); reset on every
    weight update."""

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

    def llm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``vllm.LLM`` (pure; tested without vLLM)."""
        kwargs: dict[str, Any] = {
            "model": self.model,
            "tensor_parallel_size": self.tensor_parallel_size,
            "max_model_len": self.max_model_len,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "dtype": self.dtype,
            "load_format": self.load_format,
            "seed": self.seed,
            "enforce_eager": self.enforce_eager,
            "enable_prefix_caching": self.enable_prefix_caching,
            "distributed_executor_backend": "external_launcher",
            "enable_sleep_mode": True,
            "logprobs_mode": "processed_logprobs",
        }
        extra = dict(self.extra_llm_kwargs or {})
        clash = sorted(set(extra) & set(kwargs))
        if clash:
            raise ValueError(f"extra_llm_kwargs may not override {clash}; set the fields instead")
        kwargs.update(extra)
        return kwargs


def vllm_sampling_kwargs(n: int, sampling: SamplingParams) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one call (pure; tested without vLLM).

    ``logprobs=0`` returns only the sampled token's log-prob; ``top_k=-1`` disables top-k in
    vLLM (our ``0``); ``detokenize=False`` because the trainer works on token ids.
    """
    return {
        "n": n,
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "max_tokens": sampling.max_new_tokens,
        "seed": sampling.seed,
        "stop_token_ids": list(sampling.stop_token_ids),
        "logprobs": 0,
        "detokenize": False,
    }


def request_seeds(params: Sequence[SamplingParams]) -> list[int | None]:
    """The seed each prompt's request carries: its own, except that a seed already used by an
    earlier prompt of the call becomes ``call_seed(seed, k)`` for its ``k``-th repeat.

    vLLM gives every request a generator seeded with its ``seed`` (and the ``n`` children of a
    request distinct derived seeds), so one ``SamplingParams(seed=s)`` shared by all prompts
    would hand every prompt the same random numbers; the embedded engine instead continues one
    stream. Either way no two prompts of a call share noise. ``None`` stays ``None`` (vLLM's
    engine RNG).
    """
    seen: dict[int, int] = {}
    seeds: list[int | None] = []
    for p in params:
        if p.seed is None:
            seeds.append(None)
            continue
        repeat = seen.get(p.seed, 0)
        seen[p.seed] = repeat + 1
        seeds.append(p.seed if repeat == 0 else call_seed(p.seed, repeat))
    return seeds


def completions_from_outputs(outputs: Sequence[Any], n: int) -> list[list[Completion]]:
    """Convert vLLM ``RequestOutput`` objects (one per prompt, in order) to completions.

    Reads only public fields: ``output.outputs[j].token_ids``, ``.logprobs`` (one mapping per
    sampled token, ``token_id -> Logprob(logprob=...)``) and ``.finish_reason``. An ``"abort"``
    or a missing log-prob raises: the trainer must never train on a half-reported sample.
    """
    result = []
    for i, request in enumerate(outputs):
        samples = list(request.outputs)
        if len(samples) != n:
            raise RuntimeError(f"vLLM returned {len(samples)} samples for prompt {i}, asked {n}")
        group = []
        for j, sample in enumerate(samples):
            token_ids = [int(t) for t in sample.token_ids]
            if sample.logprobs is None or len(sample.logprobs) != len(token_ids):
                raise RuntimeError(
                    f"prompt {i} sample {j}: vLLM gave no per-token log-probs for "
                    f"{len(token_ids)} tokens (is logprobs=0 set?)"
                )
            logprobs = [
                float(step[tok].logprob)
                for step, tok in zip(sample.logprobs, token_ids, strict=True)
            ]
            if sample.finish_reason not in ("stop", "length"):
                raise RuntimeError(
                    f"prompt {i} sample {j}: finish_reason {sample.finish_reason!r} "
                    "(aborted request?)"
                )
            group.append(
                Completion(
                    prompt_index=i,
                    sample_index=j,
                    token_ids=token_ids,
                    logprobs=logprobs,
                    finish_reason=sample.finish_reason,
                )
            )
        result.append(group)
    return result


class VLLMEngine(RolloutEngine):
    """vLLM colocated in the training processes; see the module docstring for requirements."""

    def __init__(self, config: VLLMEngineConfig) -> None:
        try:
            import vllm
        except ImportError as err:
            raise ImportError(
                "VLLMEngine needs vLLM: install the GPU extra (pip install 'reco-megatron[gpu]') "
                "on a CUDA machine, or use the embedded engine (EmbeddedEngine) on CPU"
            ) from err
        self.config = config
        self._vllm = vllm
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.llm = vllm.LLM(**config.llm_kwargs())
        model_config = self.llm.llm_engine.model_config
        self._vocab_size = int(model_config.get_vocab_size())
        self._max_model_len = int(model_config.max_model_len)
        self._warned_truncation = False
        self._weights_loaded = config.load_format != "dummy"
        self._asleep = False

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def generate(
        self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingArg
    ) -> list[list[Completion]]:
        """One batched ``LLM.generate`` with one ``vllm.SamplingParams`` per prompt (per-request
        seeds, :func:`request_seeds`). Every rank of the TP group must call this with identical
        arguments."""
        params = validate_requests(
            prompt_token_ids,
            n,
            sampling,
            max_model_len=self._max_model_len,
            vocab_size=self._vocab_size,
        )
        if self._asleep:
            raise RuntimeError("the engine is asleep: call wake() before generate()")
        if not self._weights_loaded:
            raise RuntimeError("no weights loaded (load_format='dummy'): call update_weights()")
        truncated = [p for p in params if p.top_p < 1.0 or p.top_k > 0]
        if truncated and not self._warned_truncation:
            logger.warning(
                "vLLM reports log-probs after top-p/top-k truncation (top_p=%s, top_k=%s) while "
                "the trainer uses the untruncated temperature-scaled distribution; expect a "
                "train/rollout log-prob mismatch. Use top_p=1, top_k=0 for on-policy RL.",
                truncated[0].top_p,
                truncated[0].top_k,
            )
            self._warned_truncation = True
        vllm_params = [
            self._vllm.SamplingParams(**vllm_sampling_kwargs(n, replace(p, seed=seed)))
            for p, seed in zip(params, request_seeds(params), strict=True)
        ]
        prompts = [{"prompt_token_ids": list(p)} for p in prompt_token_ids]
        outputs = self.llm.generate(prompts, vllm_params, use_tqdm=False)
        return completions_from_outputs(outputs, n)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Push HF-named full tensors through the model's own ``load_weights`` (TP-sharding
        included), then drop cached prefixes computed with the old weights."""
        if self._asleep:
            raise RuntimeError(
                "wake() the engine before update_weights(): level-1 sleep keeps weights on the host"
            )
        self.llm.apply_model(lambda model: model.load_weights(weights=named_tensors))
        self.llm.reset_prefix_cache()
        self._weights_loaded = True

    def sleep(self) -> None:
        """Level-1 sleep: weights to host memory, KV cache freed."""
        if not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def wake(self) -> None:
        """Weights back on the GPU and the KV cache re-allocated."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        """Drop the ``LLM`` object; GPU memory is freed when the process group goes."""
        self.llm = None  # type: ignore[assignment]
