"""Rewards: math answers (math-verify), countdown expressions, custom functions by import
path, and an isolating process pool (timeout, memory limit). No megatron, no
torch.distributed, and no eval/exec of model output anywhere in here."""
