"""A tiny Llama built from a config (no download) and a teacher-forced log-prob reference."""

from __future__ import annotations

import torch

TINY_LLAMA: dict = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "max_position_embeddings": 64,
    "eos_token_id": 2,
    "bos_token_id": 1,
}


def tiny_model(seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A fp32 ``LlamaForCausalLM`` with random weights drawn from ``seed``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {**TINY_LLAMA, **overrides}
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def teacher_forced_logprobs(
    model: torch.nn.Module, prompt: list[int], response: list[int], temperature: float
) -> torch.Tensor:
    """``[T]``: log softmax(logits / T) of response token t given prompt + response[:t].

    One unpadded forward over prompt + response; the logits at position ``len(prompt) - 1 + t``
    predict response token ``t``.
    """
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0].double()
    scale = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits / scale, dim=-1)
    rows = logp[len(prompt) - 1 : len(prompt) - 1 + len(response)]
    return rows.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
