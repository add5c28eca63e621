"""The model: its config and family table, the megatron-core build (dense and MoE blocks, the
sequence-parallel norm, torch's attention for the local spec), MoE routing replay and the
distributed optimizer."""
