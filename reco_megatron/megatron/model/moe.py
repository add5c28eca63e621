"""Mixture-of-experts: the typed config of a model's MoE layers and what megatron-core needs.

:class:`MoEConfig` is the ``model.moe`` block (names as in a Hugging Face Qwen3-MoE
``config.json`` where one exists); :func:`moe_transformer_kwargs` turns it and the parallel
layout into the ``TransformerConfig`` fields of megatron-core's MoE layer. Every decoder layer
is an MoE layer (Qwen3-MoE: ``decoder_sparse_step: 1``, ``mlp_only_layers: []``): a top-k
router in fp32, ``num_experts`` routed SwiGLU experts of width ``ffn_hidden_size``, optionally
a shared expert (with a sigmoid gate, as Qwen2-MoE) and an auxiliary load-balancing loss.

The experts are megatron's local ``SequentialMLP`` (one matmul pair per expert, no
grouped-GEMM kernel, so no transformer-engine is needed); tokens reach the experts of other
expert-parallel ranks through megatron's ``alltoall`` dispatcher (or ``allgather``), which runs
over NCCL on GPU and over gloo on CPU (see ``docs/cpu-backend.md``).

Router normalisation, in megatron's terms: Qwen3-MoE's ``norm_topk_prob: true`` (softmax over
all experts, keep the top k, renormalise them to sum to 1) is megatron's softmax router with
``moe_router_pre_softmax=False`` (top k of the logits, softmax over those k): the same
probabilities. ``norm_topk_prob: false`` keeps the unnormalised top-k of the full softmax,
megatron's ``moe_router_pre_softmax=True``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

ROUTER_DTYPES = ("fp32", "fp64")


@dataclass(kw_only=True)
class MoEConfig:
    """The mixture-of-experts layers of a model (``model.moe``; every layer is MoE)."""

    num_experts: int = 8
    """Routed experts per layer (HF ``num_experts``)."""
    router_topk: int = 2
    """Experts each token is sent to (HF ``num_experts_per_tok``)."""
    ffn_hidden_size: int = 32
    """Width of one expert's SwiGLU (HF ``moe_intermediate_size``)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing probabilities to sum to 1 (Qwen3-MoE: true)."""
    shared_expert_ffn_hidden_size: int | None = None
    """Width of a shared expert every token also goes through (HF Qwen2-MoE
    ``shared_expert_intermediate_size``); None: no shared expert (Qwen3-MoE)."""
    shared_expert_gate: bool = False
    """Scale the shared expert's output by ``sigmoid(x . w)`` (Qwen2-MoE: true)."""
    aux_loss_coeff: float = 0.0
    """Coefficient of the auxiliary load-balancing loss (Switch Transformer form, as HF
    ``router_aux_loss_coef``); 0 disables it. It enters the gradient as coefficient x its mean
    over micro-batches and data-parallel ranks, whatever the policy loss's normaliser."""
    capacity_factor: float | None = None
    """Expert capacity as a multiple of the even share of tokens; tokens over it are dropped
    (counted in ``moe_dropped_frac``). None: dropless, as Qwen3-MoE is trained."""
    router_dtype: Literal["fp32", "fp64"] = "fp32"
    """Precision of the router's logits and softmax (fp32 even for bf16 models)."""

    def __post_init__(self) -> None:
        for name in ("num_experts", "router_topk", "ffn_hidden_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"moe.{name} must be a positive integer, got {value!r}")
        if self.router_topk > self.num_experts:
            raise ValueError(
                f"moe.router_topk={self.router_topk} is larger than moe.num_experts="
                f"{self.num_experts}: a token cannot go to more experts than exist"
            )
        shared = self.shared_expert_ffn_hidden_size
        if shared is not None and (isinstance(shared, bool) or not isinstance(shared, int)):
            raise ValueError(
                f"moe.shared_expert_ffn_hidden_size must be a positive integer or null, "
                f"got {shared!r}"
            )
        if shared is not None and shared < 1:
            raise ValueError(f"moe.shared_expert_ffn_hidden_size must be >= 1, got {shared}")
        if self.shared_expert_gate and shared is None:
            raise ValueError(
                "moe.shared_expert_gate=true needs a shared expert: set "
                "moe.shared_expert_ffn_hidden_size (or the gate to false)"
            )
        if not isinstance(self.aux_loss_coeff, int | float) or self.aux_loss_coeff < 0:
            raise ValueError(f"moe.aux_loss_coeff must be >= 0, got {self.aux_loss_coeff!r}")
        cap = self.capacity_factor
        if cap is not None and (not isinstance(cap, int | float) or cap <= 0):
            raise ValueError(f"moe.capacity_factor must be > 0 or null, got {cap!r}")
        if self.router_dtype not in ROUTER_DTYPES:
            raise ValueError(
                f"moe.router_dtype must be one of {ROUTER_DTYPES}, got {self.router_dtype!r}"
            )

    def check_expert_parallel(self, ep: int, etp: int) -> None:
        """Raise with the fix when the experts cannot be split over ``ep`` x ``etp`` ranks."""
        if self.num_experts % ep:
            raise ValueError(
                f"moe.num_experts={self.num_experts} is not divisible by "
                f"parallel.expert_model_parallel_size={ep}: use an EP size that divides the "
                "expert count"
            )
        if self.ffn_hidden_size % etp:
            raise ValueError(
                f"moe.ffn_hidden_size={self.ffn_hidden_size} is not divisible by "
                f"parallel.expert_tensor_parallel_size={etp}: use an expert TP size that "
                "divides the expert width (1 keeps experts whole)"
            )


def moe_transformer_kwargs(moe: MoEConfig, parallel: Any) -> dict[str, Any]:
    """The ``TransformerConfig`` fields of the MoE layers (megatron-core 0.16 and 0.19).

    ``parallel`` is the :class:`~reco_megatron.megatron.distributed.ParallelConfig`. Routing
    replay needs no field here: :mod:`reco_megatron.megatron.model.routing` gives each router its
    replay hook after the model is built.
    """
    kwargs: dict[str, Any] = dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.router_topk,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_router_load_balancing_type="aux_loss" if moe.aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=float(moe.aux_loss_coeff),
        moe_router_dtype=moe.router_dtype,
        moe_expert_capacity_factor=moe.capacity_factor,
        moe_token_dispatcher_type=parallel.moe_token_dispatcher,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_size(),
    )
    if moe.shared_expert_ffn_hidden_size is not None:
        kwargs.update(
            moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
            moe_shared_expert_gate=moe.shared_expert_gate,
            moe_shared_expert_overlap=False,
        )
    return kwargs
