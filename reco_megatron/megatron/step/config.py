"""How one rollout batch becomes optimizer steps: :class:`UpdateConfig` (the ``update`` section).

The engine that runs it is :class:`reco_megatron.megatron.step.engine.ReCoEngine`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from reco_megatron.parallel.vocab_stats_kernels import IMPLEMENTATIONS


@dataclass(kw_only=True)
class UpdateConfig:
    """How one rollout batch is turned into optimizer steps."""

    minibatches_per_rollout: int = 1
    """Optimizer steps per pass over the rollout batch (>= 2 for ReCo's token ratio to act)."""
    epochs_per_rollout: int = 1
    """Passes over the rollout batch."""
    stats_implementation: str = "auto"
    """Statistics op kernels: ``auto`` (Triton kernels on GPU when Triton imports, else
    ``compiled``; ``eager`` on CPU), ``eager``, ``compiled`` or ``triton``."""

    fused_output_layer: bool = False
    """Run the output layer inside the loss layer, fused with the statistics op, block by
    block, so the logits never exist whole (``parallel.linear_stats``; same losses and
    gradients as the unfused path). Off by default until measured faster on a GPU."""

    max_tokens_per_microbatch: int | None = None
    """Token budget of one micro-batch: each micro-batch runs at its own longest sequence
    (rounded up to ``microbatch_length_multiple``), sequences grouped for the least padding
    with ``rows x length <= budget``, in the old-policy, reference and update passes alike; the
    loss and gradients do not change (docs/megatron-engine.md). At least the longest prompt +
    response. null: fixed micro-batches of ``parallel.micro_batch_size`` sequences at the
    batch's length."""
    microbatch_length_multiple: int = 16
    """With a token budget: micro-batch lengths are rounded up to this multiple (kernel-friendly
    shapes), and to TP with sequence parallelism, 2 x CP with context parallelism."""
    balance_data_parallel: bool = True
    """With a token budget and DP > 1: exchange whole groups between data-parallel ranks
    (within each global mini-batch) so that every rank gets about the same estimated compute,
    attention included."""
    sequence_packing: bool = False
    """With a token budget: pack the sequences of a micro-batch into one row (THD, megatron's
    ``PackedSeqParams``) instead of padded rows, positions restarting per sequence; same
    losses and metrics. Runs with transformer-engine's attention and with torch's (CPU, and
    GPUs without TE: ``model.attention_backend`` ``auto``/``torch``); with
    ``model.attention_backend=local`` the run logs one line and uses padded rows."""

    routing_replay: Literal["off", "record", "replay"] = "off"
    """Mixture-of-experts models: ``record`` has the rollout engine return each token's
    experts and logs how often the trainer's routers choose others (``routing_mismatch``);
    ``replay`` also makes the old-policy pass and the updates use the rollout's experts
    (docs/megatron-engine.md, "Routing replay"); ``off`` neither."""

    measure_unreplayed: bool = False
    """With ``routing_replay: replay``: also run the old-policy pass with the model's own
    routing to log ``logprob_mismatch_free``, the rollout/trainer mismatch replay removes
    (one more forward-only pass per step)."""

    def __post_init__(self) -> None:
        if self.routing_replay not in ("off", "record", "replay"):
            raise ValueError(
                "update.routing_replay must be 'off', 'record' or 'replay', got "
                f"{self.routing_replay!r}"
            )
        for name in (
            "fused_output_layer",
            "balance_data_parallel",
            "sequence_packing",
            "measure_unreplayed",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"update.{name} must be true or false, got {getattr(self, name)!r}"
                )
        if self.sequence_packing and self.max_tokens_per_microbatch is None:
            raise ValueError(
                "update.sequence_packing=true needs update.max_tokens_per_microbatch (the "
                "length of one packed row): set it, e.g. to max_prompt_len + max_new_tokens"
            )
        for name in (
            "minibatches_per_rollout",
            "epochs_per_rollout",
            "microbatch_length_multiple",
            "max_tokens_per_microbatch",
        ):
            value = getattr(self, name)
            if name == "max_tokens_per_microbatch" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"update.{name} must be a positive integer, got {value!r}")
        if self.stats_implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"update.stats_implementation must be one of {', '.join(IMPLEMENTATIONS)}, "
                f"got {self.stats_implementation!r}"
            )
