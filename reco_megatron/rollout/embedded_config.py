"""The embedded (``transformers``) engine's settings and the model it builds from them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

if TYPE_CHECKING:  # transformers loads on first use
    from transformers import PretrainedConfig


@dataclass(kw_only=True)
class EmbeddedEngineConfig:
    """Settings of :class:`EmbeddedEngine`."""

    max_model_len: int | None = None
    """Longest ``prompt + response``; ``None`` takes the HF config's
    ``max_position_embeddings``."""

    max_batch_size: int = 64
    """Rows (prompt copies) per forward pass; bounds memory, never changes the samples."""

    seed: int = 0
    """Base seed of the sampler; call ``k`` without ``SamplingParams.seed`` uses a seed
    derived from ``(seed, k)``."""

    device: str = "cpu"
    """Torch device of the model (``"cpu"`` or ``"cuda:N"``)."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype; log-probs are always computed in fp32 from the logits."""

    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """``transformers`` attention kernel; both give the same log-probs to ~1e-6 on CPU."""

    eos_token_ids: tuple[int, ...] | None = None
    """Token ids that end a response; ``None`` takes ``eos_token_id`` of the HF config."""

    def __post_init__(self) -> None:
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise ValueError(
                f"max_model_len must be an int >= 2 or None, got {self.max_model_len!r}"
            )
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {self.max_batch_size!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.attn_implementation not in ("sdpa", "eager"):
            raise ValueError(
                f"attn_implementation must be 'sdpa' or 'eager', got {self.attn_implementation!r}"
            )
        if self.eos_token_ids is not None:
            self.eos_token_ids = tuple(self.eos_token_ids)


def build_hf_model(
    hf_config: Mapping[str, object] | PretrainedConfig, cfg: EmbeddedEngineConfig
) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

    if isinstance(hf_config, PretrainedConfig):
        config = hf_config
    elif isinstance(hf_config, Mapping):
        fields = dict(hf_config)
        if "model_type" not in fields:
            raise ValueError(
                f"hf_config needs a 'model_type' (e.g. 'llama'); got keys {sorted(fields)[:10]}"
            )
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    else:
        raise TypeError(f"hf_config must be a dict or PretrainedConfig, got {type(hf_config)}")
    # Random init draws from the global RNG: fork it so building an engine leaves it untouched.
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(
            config, dtype=DTYPES[cfg.dtype], attn_implementation=cfg.attn_implementation
        )
    return model.to(cfg.device).eval()
