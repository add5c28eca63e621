"""Prompt data: datasets with row validation, chat templates, resumable sampling, tokenizers,
and the synthetic countdown task. No megatron, no torch.distributed here."""
