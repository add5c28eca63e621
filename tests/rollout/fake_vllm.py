"""A CPU stand-in for the slice of vLLM 0.33's public API that ``VLLMEngine`` calls.

vLLM cannot run here (no GPU), so this module replays, on CPU, the behaviours of vLLM 0.33.0
that the adapter has to cope with, each read from the 0.33.0 source (paths relative to the
``vllm`` package):

* ``LLM(**kwargs)`` accepts only known engine arguments (``EngineArgs`` is a dataclass: an
  unknown key is a ``TypeError``), needs ``RANK`` and ``LOCAL_RANK`` under
  ``external_launcher`` (``v1/executor/uniproc_executor.py:186-197``), reads ``config.json``
  (``architectures`` required; ``max_model_len <= max_position_embeddings``), and re-seeds the
  process's ``random`` / numpy / torch RNGs (``utils/torch_utils.py:528-539``).
* ``SamplingParams`` rejects ``temperature > 2`` and greedy with ``n > 1`` and raises a
  positive temperature below 0.01 to 0.01 (``sampling_params.py:560-568, 668-673, 770-773``).
* ``apply_model(fn)`` returns ``[fn(model)]`` (one worker per process); the model keeps vLLM's
  fused ``qkv_proj`` / ``gate_up_proj`` parameters, and ``load_weights(weights)`` stacks the HF
  names into them, skips ``rotary_emb.inv_freq`` and a tied ``lm_head.weight``, returns the
  vLLM names it loaded and checks nothing (``model_executor/models/utils.py:451-502``).
* ``generate`` takes one ``SamplingParams`` per prompt; the ``n`` children of a seeded request
  use ``seed + k`` (``v1/engine/parallel_sampling.py``); ``logprobs=0`` gives one
  ``{token_id: Logprob}`` per sampled token.

Sampling itself is delegated to the embedded engine over the *unfused* weights, so a fused
layout the loader got wrong changes the generations (the tests compare with teacher forcing).
"""

from __future__ import annotations

import json
import os
import random
import types
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import torch

from reco_megatron.rollout import EmbeddedEngine, EmbeddedEngineConfig
from reco_megatron.rollout import SamplingParams as OurSamplingParams

ENGINE_ARGS = {
    "model", "tensor_parallel_size", "max_model_len", "gpu_memory_utilization", "dtype",
    "load_format", "seed", "enforce_eager", "enable_prefix_caching",
    "distributed_executor_backend", "enable_sleep_mode", "logprobs_mode", "skip_tokenizer_init",
    "max_num_seqs",
}  # fmt: skip
STACKED = {".q_proj": (".qkv_proj", 0), ".k_proj": (".qkv_proj", 1), ".v_proj": (".qkv_proj", 2),
           ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)}  # fmt: skip


class SamplingParams:
    FIELDS = ("n", "temperature", "top_p", "top_k", "max_tokens", "seed", "stop_token_ids",
              "logprobs", "detokenize")  # fmt: skip

    def __init__(self, **kw):
        unknown = set(kw) - set(self.FIELDS)
        if unknown:
            raise TypeError(f"SamplingParams got unexpected keyword arguments {sorted(unknown)}")
        self.__dict__.update(kw)
        if self.temperature > 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if 0 < self.temperature < 0.01:
            self.temperature = 0.01  # vLLM does this silently
        if self.temperature == 0 and self.n > 1:
            raise ValueError("n must be 1 when using greedy sampling")


class FusedModel(torch.nn.Module):
    """vLLM's parameter layout of a Llama/Qwen2 model, loaded from HF names."""

    def __init__(self, hf_state: dict[str, torch.Tensor], tied: bool) -> None:
        super().__init__()
        self.tied = tied
        self.parts: dict[str, list[tuple[str, int]]] = {}  # fused name -> [(hf name, rows)]
        shapes: dict[str, list[torch.Size]] = {}
        for name, tensor in hf_state.items():
            if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
                continue
            fused = _fused_name(name)
            self.parts.setdefault(fused, []).append((name, tensor.shape[0]))
            shapes.setdefault(fused, []).append(tensor.shape)
        self.store = torch.nn.ParameterDict()
        for fused, parts in shapes.items():
            rows = sum(s[0] for s in parts)
            dummy = torch.randn(rows, *parts[0][1:])  # load_format="dummy": random values
            self.store[fused.replace(".", "__")] = torch.nn.Parameter(dummy, requires_grad=False)

    def named_parameters(self, *args, **kwargs):
        for key, p in self.store.items():
            yield key.replace("__", "."), p

    def load_weights(self, weights):
        loaded = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (self.tied and name == "lm_head.weight"):
                continue
            fused = _fused_name(name)
            if fused not in self.parts:
                continue  # vLLM ignores what it cannot place
            offset = 0
            for part, rows in self.parts[fused]:
                if part == name:
                    self.store[fused.replace(".", "__")][offset : offset + rows].copy_(tensor)
                offset += rows
            loaded.add(fused)
        return loaded

    def unfused(self) -> dict[str, torch.Tensor]:
        out = {}
        for fused, parts in self.parts.items():
            full, offset = self.store[fused.replace(".", "__")], 0
            for name, rows in parts:
                out[name] = full[offset : offset + rows].clone()
                offset += rows
        return out


def _fused_name(hf_name: str) -> str:
    for old, (new, _) in STACKED.items():
        if old + "." in hf_name:
            return hf_name.replace(old + ".", new + ".")
    return hf_name


class LLM:
    instances: ClassVar[list[LLM]] = []
    reset_result = True

    def __init__(self, model: str, **kwargs):
        unknown = set(kwargs) - ENGINE_ARGS
        if unknown:
            raise TypeError(f"EngineArgs.__init__() got unexpected keyword arguments {unknown}")
        if kwargs.get("distributed_executor_backend") == "external_launcher":
            for var in ("RANK", "LOCAL_RANK"):
                int(os.environ[var])  # KeyError like vLLM when missing
        config = json.loads((Path(model) / "config.json").read_text())
        if not config.get("architectures"):
            raise ValueError("config.json has no 'architectures'")
        max_len = kwargs.get("max_model_len") or config["max_position_embeddings"]
        if max_len > config["max_position_embeddings"]:
            raise ValueError(f"max_model_len {max_len} > max_position_embeddings")
        self.kwargs, self.config, self.calls = kwargs, config, []
        self.asleep = False
        seed = kwargs.get("seed", 0)
        random.seed(seed)
        torch.manual_seed(seed)
        self.hf = EmbeddedEngine(config, EmbeddedEngineConfig(max_model_len=max_len))
        tied = bool(config.get("tie_word_embeddings", False))
        self.model = FusedModel(self.hf.model.state_dict(), tied)
        self.llm_engine = SimpleNamespace(
            model_config=SimpleNamespace(
                get_vocab_size=lambda: config["vocab_size"], max_model_len=max_len
            ),
            engine_core=SimpleNamespace(shutdown=lambda: self.calls.append("shutdown")),
        )
        LLM.instances.append(self)

    def apply_model(self, fn):
        self.calls.append("apply_model")
        return [fn(self.model)]

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")
        return LLM.reset_result

    def sleep(self, level=1):
        self.calls.append(f"sleep({level})")
        self.asleep = True

    def wake_up(self, tags=None):
        self.calls.append("wake_up")
        self.asleep = False
        return True

    def generate(self, prompts, sampling_params, *, use_tqdm=True):
        assert not self.asleep, "generate while asleep"
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params]
        params = params * len(prompts) if len(params) == 1 else params
        assert len(params) == len(prompts)
        self.calls.append(("generate", [(p.n, p.seed, p.temperature) for p in params]))
        self.hf.update_weights(self.model.unfused().items())
        outputs = []
        for prompt, p in zip(prompts, params, strict=True):
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
                c = self.hf.generate([prompt["prompt_token_ids"]], 1, ours)[0][0]
                pairs = zip(c.token_ids, c.logprobs, strict=True)
                steps = [{t: SimpleNamespace(logprob=lp)} for t, lp in pairs]
                samples.append(
                    SimpleNamespace(
                        token_ids=c.token_ids, logprobs=steps, finish_reason=c.finish_reason
                    )
                )
            outputs.append(SimpleNamespace(outputs=samples))
        return outputs


def module() -> types.ModuleType:
    """A fresh ``vllm`` module object to put in ``sys.modules``."""
    mod = types.ModuleType("vllm")
    mod.LLM = LLM
    mod.SamplingParams = SamplingParams
    LLM.instances = []
    LLM.reset_result = True
    return mod
