"""The routers of a mixture-of-experts model: routing replay, routing records, router metrics.

**Replay** is :class:`~reco_megatron.megatron.model.replay_hook.ReplayHook`, one per router of
the policy.

**Token order.** A router sees ``[s, b, h]`` hidden states flattened to ``s * b`` tokens,
sequence-major; with sequence parallelism each TP rank holds its ``s / TP`` consecutive
positions. The rollout's experts arrive per sequence as ``routed_experts [B, S, L, k]`` (input
position ``t`` of ``RolloutBatch.input_ids``, global layer ``l``), so the target of layer ``l``
for a micro-batch is ``routed[:, :, l].transpose(0, 1)`` sliced to this rank's positions.

**Metrics.** Over a training step the routers' token counts give ``moe_load_imbalance`` (per
layer ``max_e n_e / mean_e n_e``, 1 = balanced, averaged over layers; ``_max``: worst layer)
and ``moe_dropped_frac`` (assignments dropped over capacity); megatron's own tracker gives the
auxiliary loss (``moe_aux_loss``, mean over layers and micro-batches; 1 = balanced). In the
old-policy pass, the routers' free choices against the rollout's give ``routing_mismatch``
(share of response tokens routed to another expert set in at least one layer) and
``routing_mismatch_layer`` (share of token x layer decisions that differ).

**Auxiliary loss scale.** With ``calculate_per_token_loss`` megatron scales the auxiliary loss
for a loss normalised by *all* tokens of the batch; ours is normalised by response tokens or
sequences (``loss_layer``). :meth:`MoERouting.micro_batches` therefore sets the coefficient the
routers read for each micro-batch to ``coeff x D / (M x DP x T)`` (``D`` the global loss
denominator, ``M`` micro-batches per rank, ``T`` the token count megatron multiplies the
auxiliary loss by: the router's local tokens, times TP x CP on megatron-core 0.19): the
gradient is then that of ``coeff x`` the auxiliary loss averaged over micro-batches and
data-parallel ranks (megatron's convention without per-token loss), whatever the aggregation
or the split.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from reco_megatron.megatron.model.replay_hook import ReplayHook
from reco_megatron.parallel.batch import RolloutBatch
from reco_megatron.parallel.collectives import collective_device


class MoERouting:
    """The routers of one model replica's chunks on this rank (policy only), with their
    replay hooks and token counters.

    Args:
        chunks: the ``GPTModel`` chunks of this pipeline stage (unwrapped).
        num_layers: layers of the whole model (the ``L`` of ``routed_experts``).
        sequence_parallel: whether each TP rank routes its own ``s / TP`` positions.
    """

    def __init__(self, chunks: Sequence[Any], *, num_layers: int, sequence_parallel: bool) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.router import TopKRouter

        from reco_megatron.megatron.compat.versions import moe_aux_loss_counts_tp_cp

        self.num_layers = num_layers
        self.sequence_parallel = sequence_parallel
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.cp_size = ps.get_context_parallel_world_size()
        self._aux_counts_tp_cp = moe_aux_loss_counts_tp_cp()
        self.chunks: list[dict[int, ReplayHook]] = []
        self.routers: dict[int, Any] = {}
        self.num_experts = self.topk = 0
        self.config: Any = None
        for chunk in chunks:
            hooks: dict[int, ReplayHook] = {}
            for module in chunk.modules():
                if not isinstance(module, TopKRouter):
                    continue
                layer = int(module.layer_number) - 1
                hook = ReplayHook(layer)
                module.router_replay = hook
                module.register_forward_hook(self._count)
                module._reco_layer = layer
                hooks[layer] = hook
                self.routers[layer] = module
                self.num_experts, self.topk = module.config.num_moe_experts, module.topk
                self.config = module.config
            self.chunks.append(hooks)
        if self.config is not None and self.config.moe_aux_loss_coeff:
            # the coefficient as configured; micro_batches() overwrites the live one per pass
            self.config._reco_aux_loss_coeff = float(self.config.moe_aux_loss_coeff)
        self.counting = False
        self._counts = torch.zeros(num_layers, max(self.num_experts, 1), dtype=torch.float64)
        self._routed = torch.zeros(num_layers, dtype=torch.float64)
        self._pending: list[tuple[RolloutBatch, Any] | None] = [None] * len(self.chunks)
        self._micro_batches = 0
        self._steering = False
        self._diffs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    # ----------------------------------------------------------------- token order
    def _positions(self, seq: int) -> slice:
        """This rank's positions of a sequence of length ``seq`` (SP shard or all)."""
        if not self.sequence_parallel or self.tp_size == 1:
            return slice(0, seq)
        per = seq // self.tp_size
        return slice(self.tp_rank * per, (self.tp_rank + 1) * per)

    def _targets(self, routed: torch.Tensor, layer: int, seq: int) -> torch.Tensor:
        """``[s_local * b, k]`` target experts of ``layer`` in the router's token order."""
        per_layer = routed[:, :seq, layer].transpose(0, 1)[self._positions(seq)]
        return per_layer.reshape(-1, per_layer.shape[-1])

    def _aux_tokens(self, mb: RolloutBatch) -> float:
        """The token count megatron multiplies a micro-batch's auxiliary loss by."""
        shard = (self.tp_size if self.sequence_parallel else 1) * self.cp_size
        local = mb.num_sequences * mb.seq_length / shard
        return local * (self.tp_size * self.cp_size if self._aux_counts_tp_cp else 1)

    # ----------------------------------------------------------------- passes
    @staticmethod
    def pass_options(mode: str, batch: RolloutBatch) -> dict[str, bool]:
        """``update.routing_replay`` applied to ``batch``: ``replay`` the rollout's experts,
        ``measure`` the mismatch; raises when the batch carries no rollout routing."""
        if mode == "off":
            return {}
        if batch.routed_experts is None:
            raise ValueError(
                f"update.routing_replay={mode!r} but the rollout batch carries no routed "
                "experts: the rollout engine must record them (rollout.engine=megatron, or vLLM "
                "with routed-experts return; docs/rollout.md)"
            )
        return {"replay": mode == "replay", "measure": True}

    def aux_scaling(self, config: Any, coeff: float, local_denominator: float) -> dict[str, Any]:
        """What :meth:`micro_batches` needs to scale a training pass's auxiliary loss: the
        pass's global loss denominator (this rank's share summed over DP x CP, collective)."""
        from megatron.core import parallel_state as ps

        total = torch.tensor([local_denominator], dtype=torch.float64)
        group = ps.get_data_parallel_group(with_context_parallel=True)
        if dist.get_world_size(group) > 1:
            total = total.to(collective_device(group))
            dist.all_reduce(total, group=group)
        return {
            "config": config,
            "coeff": coeff,
            "denominator": max(float(total.item()), 1.0),
            "data_parallel": ps.get_data_parallel_world_size(),
        }

    def micro_batches(
        self,
        mbs: Sequence[RolloutBatch],
        num_chunks: int,
        *,
        replay: bool,
        measure: bool,
        train: bool,
        shares: Sequence[Any],
    ) -> Any:
        """The data iterator(s) megatron's schedule draws ``mbs`` from (one per model chunk
        with a virtual pipeline), preparing the routers for each micro-batch as it is drawn:
        replay targets (``replay``), recording of the free choices for :meth:`mismatch`
        (``measure``) and, in a training pass (``train``), the token counters and the
        auxiliary-loss coefficient (``shares``: each micro-batch's loss-denominator share;
        collective over DP x CP when the auxiliary loss is on). Call :meth:`end_pass` after
        the schedule returns."""
        self._pending = [None] * len(self.chunks)
        self.counting = train
        self._micro_batches = len(mbs) if train else self._micro_batches
        self._steering = replay or measure
        aux = None
        config = self.config
        coeff = getattr(config, "_reco_aux_loss_coeff", None) if config is not None else None
        if train and coeff:
            aux = self.aux_scaling(config, coeff, sum(float(x) for x in shares))
        iterators = [
            self._drive(i if i < len(self.chunks) else 0, mbs, replay, measure, aux)
            for i in range(num_chunks)
        ]
        return iterators[0] if num_chunks == 1 else iterators

    def _drive(
        self,
        chunk: int,
        mbs: Sequence[RolloutBatch],
        replay: bool,
        measure: bool,
        aux: dict[str, Any] | None,
    ) -> Iterator[RolloutBatch]:
        hooks = self.chunks[chunk] if self.chunks else {}
        for mb in mbs:
            self._settle(chunk)
            routed = mb.routed_experts if (replay or measure) else None
            if (replay or measure) and routed is None:
                raise RuntimeError(
                    "routing replay/record needs the rollout's routed experts in the batch "
                    "(RolloutBatch.routed_experts); the rollout engine did not return them"
                )
            for layer, hook in hooks.items() if (replay or measure) else ():
                hook.target = self._targets(routed, layer, mb.seq_length) if replay else None
                hook.record = measure
                hook.recorded.clear()
            if aux is not None:
                aux["config"].moe_aux_loss_coeff = (
                    aux["coeff"]
                    * aux["denominator"]
                    / (len(mbs) * aux["data_parallel"] * self._aux_tokens(mb))
                )
            if measure:
                self._pending[chunk] = (mb, routed)
            yield mb

    def end_pass(self) -> None:
        """Close the pass: compare the last micro-batch's records, clear every target, stop
        counting, restore the configured auxiliary-loss coefficient."""
        self.counting = False
        coeff = getattr(self.config, "_reco_aux_loss_coeff", None)
        if coeff is not None:
            self.config.moe_aux_loss_coeff = coeff
        for chunk in range(len(self.chunks)):
            self._settle(chunk)
            for hook in self.chunks[chunk].values() if self._steering else ():
                hook.target, hook.record = None, False
                hook.recorded.clear()
        self._steering = False

    def _settle(self, chunk: int) -> None:
        """Compare the recorded free choices of the chunk's last micro-batch with its
        targets: per token, how many of this rank's layers chose another expert set."""
        pending = self._pending[chunk] if chunk < len(self._pending) else None
        if pending is None:
            return
        self._pending[chunk] = None
        mb, routed = pending
        b, seq = mb.num_sequences, mb.seq_length
        positions = self._positions(seq)
        differs = torch.zeros(b, seq, dtype=torch.int32)
        known = torch.zeros(b, seq, dtype=torch.bool)
        want = routed[:, :seq].to("cpu", torch.long).sort(dim=-1).values  # [b, s, L, k]
        known[:, positions] = (want[:, positions] >= 0).all(-1).all(-1)
        for layer, hook in self.chunks[chunk].items():
            if not hook.recorded:
                continue
            got = hook.recorded[-1].to("cpu").view(-1, b, self.topk).transpose(0, 1)
            differs[:, positions] += (got != want[:, positions, layer]).any(-1).int()
            hook.recorded.clear()
        if not self.sequence_parallel and self.tp_rank > 0:
            differs.zero_()  # every TP rank routed every position: count them once
        mask = mb.loss_mask.to("cpu").bool()
        self._diffs.append((differs, known & mask, mask))

    @staticmethod
    def mismatch_ratios(metrics: dict[str, float]) -> dict[str, float]:
        """The reduced :meth:`mismatch` sums as shares of the tokens with a known routing."""
        if "routing_known" in metrics:
            known = max(metrics.pop("routing_known"), 1.0)
            metrics["routing_mismatch"] = metrics.pop("routing_mismatch_num") / known
            metrics["routing_mismatch_layer"] = metrics.pop("routing_mismatch_layer_num") / known
        return metrics

    def mismatch(self) -> dict[str, torch.Tensor]:
        """Routing mismatch of the pass just ended as sums over this rank's response tokens
        with a known rollout routing (``routing_known``, ``routing_mismatch_num``: tokens with
        another expert set in some layer, ``routing_mismatch_layer_num``: differing token x
        layer decisions / layers); collective over ``group`` (TP x PP: every rank of the
        replica holds some layers or positions)."""
        from megatron.core import parallel_state as ps

        group = ps.get_model_parallel_group()
        if not self._diffs:
            return {}
        differs = torch.cat([d.reshape(-1) for d, _, _ in self._diffs])
        known = torch.cat([k.reshape(-1) for _, k, _ in self._diffs])
        self._diffs = []
        if group is not None and dist.get_world_size(group) > 1:
            device = collective_device(group)
            differs = differs.to(device)
            dist.all_reduce(differs, group=group)  # layers over PP, positions over SP
            flag = known.to(device, torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            differs, known = differs.cpu(), flag.cpu().bool()
        moe_layers = max(len(self.routers_global()), 1)
        n = known.sum()
        return {
            "routing_known/sum": n.double(),
            "routing_mismatch_num/sum": ((differs > 0) & known).sum().double(),
            "routing_mismatch_layer_num/sum": (differs * known).sum().double() / moe_layers,
        }

    def routers_global(self) -> range:
        """Global indices of the MoE layers (every layer is one)."""
        return range(self.num_layers)

    # ----------------------------------------------------------------- rollout records
    def record_all(self, on: bool) -> None:
        """Record every router's free choice on every forward (the rollout engine)."""
        for hooks in self.chunks:
            for hook in hooks.values():
                hook.record, hook.target = on, None
                hook.recorded.clear()

    def take_records(self) -> dict[int, torch.Tensor]:
        """``{global layer: [tokens, k]}`` choices of the last forward (records cleared)."""
        out = {}
        for hooks in self.chunks:
            for layer, hook in hooks.items():
                if hook.recorded:
                    out[layer] = hook.recorded[-1]
                hook.recorded.clear()
        return out

    # ----------------------------------------------------------------- router metrics
    def _count(self, module: Any, inputs: Any, output: Any) -> None:
        if not (self.counting and torch.is_grad_enabled() and module.training):
            return
        _, routing_map = output
        layer = module._reco_layer
        self._counts[layer] += routing_map.detach().sum(0).to("cpu", torch.float64)
        self._routed[layer] += routing_map.shape[0] * self.topk

    def step_metrics(self) -> dict[str, float]:
        """Router metrics of the training pass just run (counters reset); collective over the
        world (every rank calls it)."""
        from megatron.core import parallel_state as ps

        from reco_megatron.megatron.compat.versions import clear_moe_aux_losses, moe_aux_losses

        micro_batches = max(self._micro_batches, 1)
        data_parallel = ps.get_data_parallel_world_size()

        aux = moe_aux_losses().get("load_balancing_loss")
        aux_layers = torch.zeros(self.num_layers, dtype=torch.float64)
        if aux is not None:
            aux_layers += aux.detach().to("cpu", torch.float64)[: self.num_layers]
        clear_moe_aux_losses()
        packed = torch.cat([self._counts.reshape(-1), self._routed, aux_layers])
        self._counts.zero_()
        self._routed.zero_()
        if dist.is_initialized() and dist.get_world_size() > 1:
            packed = packed.to(collective_device())
            dist.all_reduce(packed)
            packed = packed.cpu()
        e, n = self._counts.shape[1], self.num_layers
        counts = packed[: n * e].view(n, e)
        routed = packed[n * e : n * e + n]
        aux_sum = packed[n * e + n :]
        out: dict[str, float] = {}
        used = routed > 0
        if bool(used.any()):
            imbalance = counts[used].max(dim=1).values / counts[used].mean(dim=1).clamp(min=1e-12)
            out["moe_load_imbalance"] = float(imbalance.mean())
            out["moe_load_imbalance_max"] = float(imbalance.max())
            out["moe_dropped_frac"] = float(1.0 - counts.sum() / routed.sum())
        if aux is not None:
            dup = 1 if self.sequence_parallel else self.tp_size  # TP ranks without SP repeat it
            out["moe_aux_loss"] = float(aux_sum.sum() / (n * micro_batches * data_parallel * dup))
        return out
