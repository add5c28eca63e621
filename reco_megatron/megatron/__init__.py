"""The Megatron adapter: the only package that imports megatron-core."""
