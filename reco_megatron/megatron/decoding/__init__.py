"""Decoding with the trainer's own Megatron model (the ``megatron`` rollout engine's half that
touches megatron-core): a KV-cached, TP/PP-aware sampler."""
