"""Decoding with the trainer's own Megatron model (the ``megatron`` rollout engine's half that
touches megatron-core): a decoder that owns attention and the KV cache and calls the live
modules for the rest, at the trainer's TP/PP/EP layout (:class:`.decoder.MegatronDecoder`)."""
