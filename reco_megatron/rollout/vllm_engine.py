"""A thin vLLM rollout engine, colocated with training (GPU only; never imported in CI).

Written against vLLM's public ``LLM`` API of **0.33.x** (V1 engine, Model Runner V2), audited
line by line against the 0.33.0 source, not executed here (no GPU in development or CI; the
``vllm``-marked test runs where vLLM and a GPU are present, and ``tests/rollout/fake_vllm.py``
replays the calls below on CPU). What it relies on:

* ``LLM(..., distributed_executor_backend="external_launcher")``: vLLM runs inside the training
  processes (started by torchrun / Slurm) and reuses their ``torch.distributed`` world, building
  tensor-parallel groups of ``tensor_parallel_size`` *consecutive* ranks. **Requirements**: the
  vLLM TP size equals the training TP size, Megatron's rank order keeps TP innermost (its
  default), and *every rank of a TP group calls* :meth:`VLLMEngine.generate` *with the same
  prompts and the same* ``SamplingParams`` *(including the seed)*. Every TP group is its own
  engine holding the whole model: data-parallel replicas get different prompts, while the
  pipeline stages of one replica get the *same* prompts and seeds (the trainer picks prompts
  per data-parallel rank) and generate them redundantly.
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine core in-process (set unless present).
  vLLM re-seeds the process's ``random`` / numpy / torch RNGs while it starts; the engine saves
  and restores them around ``vllm.LLM(...)`` so building it leaves the trainer's RNGs as they were.
* ``enable_sleep_mode=True`` with ``LLM.sleep(level=1)`` (weights to host, KV cache dropped)
  during the update, then ``LLM.wake_up(tags=["weights"])`` before the weight push and
  ``LLM.wake_up(tags=["kv_cache"])`` after it (verl's and NeMo-RL's order: the KV cache is
  not allocated while the push's buffers are).
* ``LLM.apply_model(fn)``: runs ``fn(model)`` on the worker's model in this process; the model's
  ``load_weights(weights)`` takes the same ``(hf_name, full_tensor)`` stream the embedded engine
  takes and shards it for TP itself. It returns the vLLM names it loaded and counts a fused
  parameter (``qkv_proj``, ``gate_up_proj``) loaded once any shard arrived, so the stream is
  checked per Hugging Face tensor on our side first (``expected``, :mod:`.weight_check`); the
  engine then compares vLLM's names with the model's parameters. An unknown ``.weight`` name
  makes vLLM raise ``KeyError`` (an unknown ``.bias`` is skipped), a wrong shape an
  ``AssertionError``: both come back as a ``ValueError`` naming the tensor.
  ``LLM.reset_prefix_cache()`` afterwards (it must return True), so no KV block computed with
  the old weights is reused.
* ``SamplingParams(n, temperature, top_p, top_k, max_tokens, seed, logprobs=0, stop_token_ids)``,
  one per prompt in one ``LLM.generate`` call, always with a seed (vLLM gives the ``n`` children
  ``seed + k``; an unseeded request would draw from the process-global numpy RNG, which the
  trainer shares and which may differ between the ranks of a TP group); seeds are spread by a
  hash (:func:`request_seeds`) so adjacent seeds do not share child seeds. vLLM 0.33 rejects
  ``temperature > 2`` and greedy with ``n > 1`` with ``VLLMValidationError`` (which is *not* a
  ``ValueError``) and silently raises ``0 < temperature < 0.01`` to 0.01: the engine turns
  vLLM's error into a ``ValueError`` naming the setting, rejects the silent change itself, and
  serves greedy ``n > 1`` as one request copied ``n`` times (greedy samples are identical).
  The engine is built with ``logprobs_mode="processed_logprobs"`` and ``skip_tokenizer_init``
  (token ids in and out; the model directory holds no tokenizer): the sampled token's log-prob
  comes after temperature scaling, like the trainer's. Caveat: vLLM's
  "processed" log-probs are taken *after* top-k/top-p truncation (renormalised over the kept
  tokens) while the embedded engine and the trainer use the untruncated distribution; with
  ``top_p=1, top_k=0`` (the RL default) they coincide, otherwise this engine warns once and the
  mismatch metrics show the gap.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from reco_megatron.rollout.base import (
    Completion,
    RolloutEngine,
    SamplingArg,
)
from reco_megatron.rollout.sampling import call_seed
from reco_megatron.rollout.vllm_requests import (
    VLLM_MAX_TEMPERATURE,
    VLLM_MIN_TEMPERATURE,
    completions_from_outputs,
    copy_greedy_samples,
    request_seeds,
    vllm_sampling_kwargs,
)
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
            "skip_tokenizer_init": self.skip_tokenizer_init,
            "distributed_executor_backend": "external_launcher",
            "enable_sleep_mode": True,
            "logprobs_mode": "processed_logprobs",
        }
        if self.return_routed_experts:
            kwargs["enable_return_routed_experts"] = True
        extra = dict(self.extra_llm_kwargs or {})
        clash = sorted(set(extra) & set(kwargs))
        if clash:
            raise ValueError(f"extra_llm_kwargs may not override {clash}; set the fields instead")
        kwargs.update(extra)
        return kwargs


def _export_launcher_env() -> None:
    """``RANK`` / ``LOCAL_RANK`` for vLLM's external launcher, which reads them from the
    environment (torchrun sets them; ``srun`` alone does not). Taken from the initialised
    ``torch.distributed`` world and the current CUDA device; vLLM moves to ``cuda:LOCAL_RANK``,
    so a ``LOCAL_RANK`` that disagrees with the trainer's device is an error."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        os.environ.setdefault("RANK", str(dist.get_rank()))
    if torch.cuda.is_available():
        device = torch.cuda.current_device()
        os.environ.setdefault("LOCAL_RANK", str(device))
        if os.environ["LOCAL_RANK"] != str(device):
            raise RuntimeError(
                f"LOCAL_RANK={os.environ['LOCAL_RANK']} but this process trains on cuda:{device}; "
                "vLLM's external launcher would move to cuda:LOCAL_RANK. Launch with one "
                "process per GPU and LOCAL_RANK = its device index (torchrun does this)."
            )
    missing = [var for var in ("RANK", "LOCAL_RANK") if var not in os.environ]
    if missing:
        raise RuntimeError(
            f"vLLM's external launcher needs {missing} in the environment: initialise "
            "torch.distributed (and CUDA) before building the engine, or launch with torchrun"
        )


@contextlib.contextmanager
def _preserved_rng_states() -> Iterator[None]:
    """Restore ``random``, numpy (when importable), torch and CUDA RNG states on exit."""
    py_state = random.getstate()
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch
        np = None  # type: ignore[assignment]
    np_state = np.random.get_state() if np is not None else None
    torch_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(py_state)
        if np is not None:
            np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


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
        self._validation_error = _vllm_validation_error()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        _export_launcher_env()
        with _preserved_rng_states():  # vLLM re-seeds the global RNGs while it starts
            self.llm = vllm.LLM(**config.llm_kwargs())
        model_config = self.llm.llm_engine.model_config
        self._vocab_size = int(model_config.get_vocab_size())
        self._max_model_len = int(model_config.max_model_len)
        self._warned_truncation = False
        self._weights_loaded = config.load_format != "dummy"
        self._weights_asleep = self._kv_asleep = False
        self._seed = config.seed
        self._calls = 0

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
        arguments. Settings vLLM rejects (``VLLMValidationError``) raise :class:`ValueError`
        naming the setting."""
        params = self._admit(prompt_token_ids, n, sampling)
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
        # Unseeded prompts get the call's derived seed (request_seeds spreads all seeds).
        default = call_seed(self._seed, self._calls)
        self._calls += 1
        params = [p if p.seed is not None else replace(p, seed=default) for p in params]
        seeds = request_seeds(params)
        # vLLM rejects greedy with n > 1: ask once, copy (greedy samples are identical).
        counts = [1 if p.greedy else n for p in params]
        prompts = [{"prompt_token_ids": list(p)} for p in prompt_token_ids]
        kwargs = [
            vllm_sampling_kwargs(count, replace(p, seed=seed))
            for p, seed, count in zip(params, seeds, counts, strict=True)
        ]
        try:
            vllm_params = [self._vllm.SamplingParams(**kw) for kw in kwargs]
            outputs = self.llm.generate(prompts, vllm_params, use_tqdm=False)
        except self._validation_error as err:
            raise ValueError(
                f"vLLM rejected the sampling settings ({type(err).__name__}: {err}); sent "
                f"temperature={params[0].temperature}, top_p={params[0].top_p}, "
                f"top_k={params[0].top_k}, max_new_tokens={params[0].max_new_tokens}. Fix "
                "the rollout settings (rollout.temperature must be in "
                f"[{VLLM_MIN_TEMPERATURE}, {VLLM_MAX_TEMPERATURE}] for vLLM)"
            ) from err
        routed = self.config.return_routed_experts
        return copy_greedy_samples(
            completions_from_outputs(outputs, counts, routed_experts=routed), n
        )

    def _load_weights(self, stream: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Push HF-named full tensors through the model's own ``load_weights`` (TP-sharding
        included); raise naming the tensor vLLM failed on, or the parameters it never filled."""
        last: list[str | None] = [None]

        def tracked() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in stream:
                last[0] = name
                yield name, tensor

        try:
            missing = self.llm.apply_model(lambda model: _load_and_list_missing(model, tracked()))
        except (KeyError, AssertionError, ValueError) as err:
            raise ValueError(
                f"vLLM's load_weights failed on tensor {last[0]!r} ({type(err).__name__}: "
                f"{err}): a name the vLLM model does not have (KeyError) or a shape it does not "
                "expect (AssertionError). The converter and the rollout model disagree; the "
                "engine refuses to generate until a complete update succeeds."
            ) from err
        missing = sorted({name for per_worker in missing for name in per_worker})
        if missing:
            raise ValueError(
                f"update_weights: {len(missing)} vLLM parameter(s) received no tensor and would "
                f"keep their dummy values: {missing[:5]!r}. The stream must hold every weight "
                "of the Hugging Face checkpoint (see reco_megatron.megatron.hf.checkpoint); the "
                "engine refuses to generate until a complete update succeeds."
            )

    def _after_weights_loaded(self) -> None:
        """Drop cached prefixes computed with the old weights."""
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError(
                "vLLM could not reset its prefix cache after the weight update (requests still "
                "running?); cached KV blocks of the old weights would be reused"
            )

    def _release_memory(self) -> None:
        """Level-1 sleep: weights to host memory, KV cache freed."""
        self.llm.sleep(level=1)

    def _restore_memory(self, tag: str) -> None:
        """``wake_up(tags=[tag])``: ``"weights"`` before the push, ``"kv_cache"`` after it."""
        self.llm.wake_up(tags=[tag])

    def close(self) -> None:
        """Shut the in-process engine core down and drop the ``LLM`` object."""
        if self.llm is None:
            return
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        shutdown = getattr(core, "shutdown", None)
        if shutdown is not None:
            shutdown()
        self.llm = None  # type: ignore[assignment]

    def state_dict(self) -> dict[str, Any]:
        """``{"seed", "call_index"}``: unseeded calls after a resume get the seeds they would
        have got (seeded calls, the trainer's, do not depend on it)."""
        return {"seed": self._seed, "call_index": self._calls}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        seed, calls = state.get("seed"), state.get("call_index")
        if not isinstance(seed, int) or not isinstance(calls, int) or calls < 0:
            raise ValueError(f"bad sampler state {dict(state)!r}: seed int, call_index int >= 0")
        self._seed, self._calls = seed, calls


def _vllm_validation_error() -> type[Exception]:
    """vLLM's request-validation error class: ``vllm.exceptions.VLLMValidationError`` (0.33:
    a ``VLLMClientError``, not a ``ValueError``); ``ValueError`` where it does not exist."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:  # older vLLM raised plain ValueError
        return ValueError
    return VLLMValidationError


def _load_and_list_missing(
    model: Any, named_tensors: Iterable[tuple[str, torch.Tensor]]
) -> list[str]:
    """Run inside vLLM's worker: ``model.load_weights`` then the parameters it did not load."""
    loaded = model.load_weights(weights=named_tensors)
    if loaded is None:  # a model class that does not report; nothing to compare
        return []
    return [name for name, _ in model.named_parameters() if name not in loaded]
