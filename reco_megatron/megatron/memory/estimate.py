"""Per-GPU memory of one RL step with vLLM colocated: an estimate and a start-up check.

Pure arithmetic on the model and parallel configs (tested on CPU with numbers); the trainer
calls :func:`colocation_warnings` once when it builds a vLLM engine and logs what it returns.
The phases of one step (``docs/rollout.md``, "Memory of one step"):

* ``generate``: Megatron's resident state (weights, fp32 grad buffer, Adam shards; none of it is
  offloaded) + vLLM awake (``gpu_memory_utilization`` x the GPU: its weights, KV cache, CUDA
  graphs) + the CUDA context.
* ``update``: the resident state + training activations + what a level-1-asleep vLLM keeps.
* ``refit``: the resident state + vLLM's weights (woken without the KV cache) + the transfer
  buffers of the largest tensor + the asleep residual.

:attr:`ColocationBudget.update_if_awake` is the update if vLLM stayed awake, for comparison.

The activation term follows Korthikanti et al. (2022) for a SwiGLU/GQA layer with bf16
activations, sequence parallelism, flash attention and no recomputation:
``s * b * (10 h + 4 kv + 6 F) / (TP * CP)`` bytes per layer, plus fp32 logits and their
gradient on the last stage. Two numbers are assumptions, not measurements
(:data:`VLLM_OTHER_BYTES`, :data:`CONTEXT_BYTES`).

Mixture-of-experts models (``model.moe``): the routed experts are split over EP x expert-TP
ranks (and PP), everything else over TP (and PP); the distributed optimizer shards the
experts' Adam state over their own data-parallel group, ``TP x CP x DP / (EP x expert-TP)``
ranks, the rest over DP. A MoE layer's MLP term is ``k (4 h + 6 F_e / expert-TP) + 8 N``
per token (each token's k copies dispatched in and out, the experts' SwiGLU, fp32 router
logits and probabilities) in place of ``6 F``: an estimate, like the dense one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from reco_megatron.megatron.distributed import ParallelConfig
from reco_megatron.megatron.hf.convert import hf_shapes
from reco_megatron.megatron.model.config import ModelConfig

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
VLLM_OTHER_BYTES = 1 * GIB
"""vLLM's memory besides weights and KV cache (activation workspace, sampler, CUDA graph
pools): what level-1 sleep does not release (it frees only the ``weights`` and ``kv_cache``
allocations). An assumption."""
CONTEXT_BYTES = 2 * GIB
"""CUDA context, NCCL buffers and allocator fragmentation per process: an assumption."""


_REPLICATED = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "mlp.gate.weight")
"""Per-layer parameters every TP rank holds whole: the norms (QK norms included) and the MoE
router (megatron keeps it replicated)."""


def stage_split(model: ModelConfig, parallel: ParallelConfig, stage: int) -> tuple[int, int]:
    """``(dense, expert)`` parameter elements on one rank of pipeline stage ``stage``: exact,
    as megatron builds it.

    Each of its ``L / PP`` layers holds ``1/TP`` of the attention and dense MLP matrices (and
    QKV bias), the whole of its norms and router (replicated over TP), and ``1/(EP x
    expert-TP)`` of the routed experts; the first stage adds its shard of the embedding, the
    last stage the final norm and its shard of the output layer (a copy of the embedding
    when they are tied and PP > 1), both at megatron's padded vocabulary. Checked against
    the models megatron builds (``megatron.memory.census``).
    """
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} is not a pipeline stage of PP {pp}")
    layer = [
        (k, math.prod(v)) for k, v in hf_shapes(model).items() if k.startswith("model.layers.0.")
    ]
    expert = sum(n for k, n in layer if ".mlp.experts." in k)
    replicated = sum(n for k, n in layer if k.endswith(_REPLICATED))
    sharded = sum(n for _, n in layer) - expert - replicated
    layers = model.num_layers // pp
    dense = layers * (sharded // tp + replicated)
    table = model.padded_vocab_size(tp) // tp * model.hidden_size
    if stage == 0:
        dense += table
    if stage == pp - 1:
        dense += model.hidden_size  # final norm
        if not model.tie_word_embeddings or pp > 1:
            dense += table
    ep_etp = parallel.expert_model_parallel_size * parallel.expert_tensor_size()
    return dense, layers * expert // ep_etp


def stage_parameters(model: ModelConfig, parallel: ParallelConfig, stage: int) -> int:
    """Parameter elements on one rank of pipeline stage ``stage`` (:func:`stage_split`)."""
    return sum(stage_split(model, parallel, stage))


@dataclass(frozen=True)
class ModelState:
    """Bytes of one rank's resident model state (what ``megatron.memory.census`` measures)."""

    weights: int
    grads: int
    optimizer: int


def stage_state(
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    data_parallel_size: int,
    stage: int,
    distributed_optimizer: bool = True,
) -> ModelState:
    """Weights (parameter dtype), fp32 gradient buffer (``grad_reduce_in_fp32``) and Adam
    state (fp32 m and v, plus an fp32 master copy of bf16/fp16 parameters; sharded over DP by
    the distributed optimizer, the routed experts' over ``TP x CP x DP / (EP x expert-TP)``)
    of one rank of pipeline stage ``stage``."""
    dense, expert = stage_split(model, parallel, stage)
    shard = dense + expert
    master = 0 if model.params_dtype == "float32" else 4
    opt_shard = shard
    if distributed_optimizer:  # the experts' Adam state over their own data-parallel group
        p = parallel
        expert_dp = max(
            p.tensor_model_parallel_size
            * p.context_parallel_size
            * data_parallel_size
            // (p.expert_model_parallel_size * p.expert_tensor_size()),
            1,
        )
        opt_shard = dense / data_parallel_size + expert / expert_dp
    return ModelState(
        weights=shard * DTYPE_BYTES[model.params_dtype],
        grads=shard * 4,
        optimizer=int(opt_shard * (master + 8)),
    )


@dataclass(frozen=True)
class ColocationBudget:
    """Bytes per GPU of each resident item and of each phase of one step."""

    gpu_bytes: int
    vllm_awake: int
    """``gpu_memory_utilization`` x ``gpu_bytes``: vLLM's whole footprint while awake."""
    weights: int
    grads: int
    optimizer: int
    reference: int
    activations: int
    vllm_weights: int
    refit_buffers: int
    kv_cache: int
    """What is left of ``vllm_awake`` for the KV cache after vLLM's weights (<= 0: none)."""
    kv_tokens: int
    """Tokens the KV cache holds (per vLLM engine, i.e. per TP group)."""

    @property
    def resident(self) -> int:
        """Megatron's state that stays on the GPU for the whole run."""
        return self.weights + self.grads + self.optimizer + self.reference

    @property
    def update_if_awake(self) -> int:
        """The update phase if vLLM stayed awake (no sleep): for comparison."""
        return self.resident + self.activations + self.vllm_awake + CONTEXT_BYTES

    @property
    def phases(self) -> dict[str, int]:
        """Peak bytes of each phase of one step."""
        return {
            "generate": self.resident + self.vllm_awake + CONTEXT_BYTES,
            "update": self.resident + self.activations + VLLM_OTHER_BYTES + CONTEXT_BYTES,
            "refit": self.resident
            + self.vllm_weights
            + self.refit_buffers
            + VLLM_OTHER_BYTES
            + CONTEXT_BYTES,
        }


def parameter_counts(model: ModelConfig) -> tuple[int, int]:
    """``(dense, expert)``: parameters outside and inside the routed experts (whole model)."""
    dense = expert = 0
    for name, shape in hf_shapes(model).items():
        if ".mlp.experts." in name:
            expert += math.prod(shape)
        else:
            dense += math.prod(shape)
    return dense, expert


def colocation_budget(
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    data_parallel_size: int,
    max_seq_len: int,
    gpu_memory_utilization: float,
    gpu_bytes: int,
    distributed_optimizer: bool = True,
    reference_model: bool = False,
    tokens_per_microbatch: int | None = None,
) -> ColocationBudget:
    """The estimate for one rank: the pipeline stage with the most parameters (the first or
    the last, which hold the embedding and the output layer) and the larger of the first
    and last stages' activations. ``tokens_per_microbatch``: positions of one micro-batch
    (``update.max_tokens_per_microbatch``); None: ``micro_batch_size x max_seq_len``, the
    fixed split's."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    cp, mb = parallel.context_parallel_size, parallel.micro_batch_size
    tokens = tokens_per_microbatch or max_seq_len * mb
    dense, experts = parameter_counts(model)
    n = dense + experts
    p_bytes = DTYPE_BYTES[model.params_dtype]
    state = max(
        (
            stage_state(
                model,
                parallel,
                data_parallel_size=data_parallel_size,
                stage=stage,
                distributed_optimizer=distributed_optimizer,
            )
            for stage in range(pp)
        ),
        key=lambda x: x.weights,
    )
    h, f = model.hidden_size, model.ffn_hidden_size
    kv = model.query_groups * model.head_dim
    mlp = 6 * f
    if model.moe is not None:
        moe, etp = model.moe, parallel.expert_tensor_size()
        mlp = moe.router_topk * (4 * h + 6 * moe.ffn_hidden_size / etp) + 8 * moe.num_experts
    per_layer = tokens * (10 * h + 4 * kv + mlp) / (tp * cp)
    vp = parallel.virtual_pipeline_model_parallel_size or 1
    in_flight = model.num_layers * (1 + (pp - 1) / (pp * vp)) if pp > 1 else model.num_layers
    logits = tokens * model.padded_vocab_size(tp) / (tp * cp) * (2 + 4 + 4)
    last_stage = per_layer * model.num_layers / pp + logits
    activations = max(per_layer * in_flight, last_stage)
    largest = max(math.prod(shape) for shape in hf_shapes(model).values())
    vllm_weights = n * p_bytes / tp
    vllm_awake = gpu_memory_utilization * gpu_bytes
    kv_cache = vllm_awake - vllm_weights - VLLM_OTHER_BYTES
    kv_per_token = 2 * model.num_layers * (model.query_groups / tp) * model.head_dim * p_bytes
    return ColocationBudget(
        gpu_bytes=int(gpu_bytes),
        vllm_awake=int(vllm_awake),
        weights=state.weights,
        grads=state.grads,
        optimizer=state.optimizer,
        reference=state.weights if reference_model else 0,
        activations=int(activations),
        vllm_weights=int(vllm_weights),
        refit_buffers=int(3 * largest * p_bytes),  # TP parts, gathered tensor, PP broadcast
        kv_cache=int(kv_cache),
        kv_tokens=max(0, int(kv_cache // kv_per_token)),
    )


def colocation_warnings(budget: ColocationBudget) -> list[str]:
    """One message per phase whose estimated peak exceeds the GPU, and one when vLLM's share
    leaves no KV cache; empty when the estimate fits."""
    out = []
    for phase, need in budget.phases.items():
        if need > budget.gpu_bytes:
            out.append(
                f"estimated {phase} peak {need / GIB:.1f} GiB > GPU {budget.gpu_bytes / GIB:.1f} "
                f"GiB (Megatron resident {budget.resident / GIB:.1f} GiB, vLLM awake "
                f"{budget.vllm_awake / GIB:.1f} GiB, activations {budget.activations / GIB:.1f} "
                "GiB): lower rollout.gpu_memory_utilization, raise TP/PP or DP (Adam shards), "
                "or shorten sequences"
            )
    if budget.kv_cache <= 0:
        out.append(
            f"vLLM's share {budget.vllm_awake / GIB:.1f} GiB does not hold its weights "
            f"{budget.vllm_weights / GIB:.1f} GiB plus a KV cache: raise "
            "rollout.gpu_memory_utilization or TP"
        )
    return out


H100_80GB_BYTES = 81559 * 2**20
"""An H100 80GB as ``nvidia-smi`` lists it (81559 MiB); the docs' tables use it."""


def colocation_table(budgets: dict[str, ColocationBudget]) -> str:
    """A markdown table (GiB per GPU) of the items and phases of each budget."""
    rows = [
        ("Megatron weights", lambda b: b.weights),
        ("fp32 grad buffer", lambda b: b.grads),
        ("Adam (fp32 master, m, v; DP-sharded)", lambda b: b.optimizer),
        ("**resident all step**", lambda b: b.resident),
        ("training activations (update only)", lambda b: b.activations),
        ("vLLM awake (`gpu_memory_utilization` x GPU)", lambda b: b.vllm_awake),
        ("  of which vLLM weights", lambda b: b.vllm_weights),
        ("  of which KV cache", lambda b: b.kv_cache),
        ("refit buffers (largest tensor x 3)", lambda b: b.refit_buffers),
        ("**generate** peak", lambda b: b.phases["generate"]),
        ("**update** peak (vLLM asleep)", lambda b: b.phases["update"]),
        ("**refit** peak (weights awake, no KV)", lambda b: b.phases["refit"]),
        ("update peak if vLLM stayed awake", lambda b: b.update_if_awake),
        ("GPU", lambda b: b.gpu_bytes),
    ]
    labels = list(budgets)
    lines = ["| GiB per GPU | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for name, get in rows:
        values = " | ".join(f"{get(budgets[label]) / GIB:.1f}" for label in labels)
        lines.append(f"| {name} | {values} |")
    tokens = " | ".join(f"{budgets[label].kv_tokens:,}" for label in labels)
    lines.append(f"| KV cache tokens per engine | {tokens} |")
    return "\n".join(lines)
