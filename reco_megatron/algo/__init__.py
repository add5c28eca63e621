"""Pure ReCo / GRPO-family math on per-token log-probs.

No megatron, no vllm, no torch.distributed here (a test enforces it): every function is a
tensor function testable in one CPU process.
"""

from reco_megatron.algo.token_stats import TokenStats

__all__ = ["TokenStats"]
