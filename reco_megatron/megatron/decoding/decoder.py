"""Decoding on the trainer's own megatron-core model chunks (the ``megatron`` rollout engine).

:class:`MegatronDecoder` runs an autoregressive loop on the ``GPTModel`` chunk the trainer
trains, at the trainer's TP/PP layout, with megatron-core's static KV cache
(``megatron.core.inference.contexts.StaticInferenceContext``): the model's own inference path
(``GPTModel.forward(..., inference_context=ctx)``: the cache append, the RoPE slicing and the
``no_mask`` decode attention are megatron's code). No weight conversion, no second copy of the
model: generation reads the live parameters, so a "weight sync" is only a cache reset.

Why our loop and not megatron's ``TextGenerationController`` (which we ran on CPU, see
``docs/rollout.md``): the controller draws every token of a batch from one ``torch.Generator``
seeded once per controller, takes one ``SamplingParams`` and one termination id for the whole
batch, and reports ``log_softmax(logits)`` before temperature; our protocol needs one random
stream per prompt, per-prompt settings, several stop ids, and log-probs of the
temperature-scaled distribution. The decoder therefore leaves sampling to a callback (the
rollout layer's :func:`reco_megatron.rollout.sampling.sample_next`, handed in by the adapter;
this module never imports the rollout layer) and only does what needs megatron.

Batching follows megatron's static engine: prompts are *right*-padded, the prefill runs up to
the shortest prompt of the chunk, and every later step feeds one position per row -- a row whose
prompt is longer feeds its next prompt token (and ignores the sample) until its prompt is
consumed. Every row therefore attends to exactly its own tokens at their true positions, with
only megatron's causal mask (no padding mask, which the Transformer Engine kernels would not
take from us), and a row's ``t``-th response token always uses uniform ``noise[row, t]``.

Pipeline parallelism: each stage receives the previous stage's hidden states ``[s, b, h]``
(point-to-point over the pipeline group), the last stage samples, and the sampled tokens and
log-probs are broadcast to every stage so all ranks of the replica hold the same completions.
Tensor-parallel ranks run the same rows; logits are gathered over TP
(``runtime_gather_output=True``), so every TP rank samples the same tokens from the same noise.

Sequence parallelism: a decode step feeds one position per row, which cannot be split over the
TP group, and megatron-core's inference path runs dense layers without it (its own controller
switches it off for MoE models the same way, ``set_model_to_sequence_parallel``). The decoder
therefore switches it off for the duration of :meth:`MegatronDecoder.decode`
(:func:`~reco_megatron.megatron.decoding.sequence_parallel.sequence_parallel_off`: the config
flag and the modules' copies of it, restored after) and runs the plain tensor-parallel forward,
which computes the same function of the same weights; the training passes keep sequence
parallelism.

Mixture-of-experts models: with ``routing`` (the trainer's
:class:`~reco_megatron.megatron.model.routing.MoERouting`) the decoder records which experts every
fed position was routed to in every layer and returns them per row (``Decoded.routed_experts``,
``[positions, layers, top-k]``, ``-1`` where a position was never fed: the last sampled token)
for routing replay; pipeline stages exchange their layers' records at the end. With expert
parallelism the ranks of an EP group exchange tokens inside every MoE layer, so they must run
the same number of forwards although they decode different prompts: each step they agree
(one all-reduce over the EP group) whether anyone still decodes, and a rank that has finished
joins with a one-token forward without the KV cache until all have (:meth:`decode_idle` does
the same for a whole call a rank has no rows for).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from reco_megatron.megatron.decoding.sequence_parallel import sequence_parallel_off
from reco_megatron.utils.logging import get_logger

logger = get_logger(__name__)

SampleFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``sample(logits [b, V] fp32, uniforms [b] fp64) -> (tokens [b] long, logprobs [b] fp32)``."""


@dataclass(frozen=True)
class Decoded:
    """One row's result: response tokens, their log-probs, whether a stop id ended it, and
    (MoE models, when recording) the experts of every position, ``[prompt + response, layers,
    top-k]`` int16 with ``-1`` where unknown."""

    token_ids: list[int]
    logprobs: list[float]
    stopped: bool
    routed_experts: torch.Tensor | None = None


class MegatronDecoder:
    """KV-cached decoding on one pipeline stage's ``GPTModel`` (unwrapped from DDP).

    Args:
        chunks: the trainer's model chunks of this stage (``ReCoEngine.unwrapped()``); exactly
            one (the interleaved/virtual pipeline is not supported for decoding).
        vocab_size: the true vocabulary (logits beyond it are Megatron's padding, dropped).
        max_model_len: longest ``prompt + response``; sizes the KV cache.
        max_batch_size: rows per forward; sizes the KV cache.
        pad_id: token fed by rows that already finished (never read: it follows the stop).
        routing: the policy's :class:`~reco_megatron.megatron.model.routing.MoERouting` (MoE
            models); with ``record_routing`` the decoder returns the routed experts.
        record_routing: record each position's experts (routing replay).
    """

    def __init__(
        self,
        chunks: Sequence[Any],
        *,
        vocab_size: int,
        max_model_len: int,
        max_batch_size: int,
        pad_id: int = 0,
        routing: Any = None,
        record_routing: bool = False,
    ) -> None:
        from megatron.core import parallel_state as ps

        if len(chunks) != 1:
            raise ValueError(
                f"the megatron rollout engine decodes on one model chunk per stage, got "
                f"{len(chunks)} (virtual pipeline): set "
                "parallel.virtual_pipeline_model_parallel_size=null or use rollout.engine=embedded"
            )
        self.model = chunks[0]
        self.config = self.model.config
        self.vocab_size = int(vocab_size)
        self.max_model_len = int(max_model_len)
        self.max_batch_size = int(max_batch_size)
        self.pad_id = int(pad_id)
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.first_stage = ps.is_pipeline_first_stage(ignore_virtual=True)
        self.last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        ranks = dist.get_process_group_ranks(self.pp_group) if self.pp_size > 1 else [0]
        stage = ps.get_pipeline_model_parallel_rank()
        self._prev_rank = ranks[stage - 1] if stage > 0 else None
        self._next_rank = ranks[stage + 1] if stage + 1 < len(ranks) else None
        self._last_rank = ranks[-1]
        self.device = next(self.model.parameters()).device
        self._context: Any = None
        if record_routing and routing is None:
            raise ValueError(
                "record_routing needs the model's routing (a mixture-of-experts model)"
            )
        self.routing = routing if record_routing else None
        ep = ps.get_expert_model_parallel_world_size() if routing is not None else 1
        self._ep_group = ps.get_expert_model_parallel_group() if ep > 1 else None

    # ----------------------------------------------------------------- the KV cache
    @property
    def context(self) -> Any:
        """The static inference context (built on first use; holds the KV cache)."""
        if self._context is None:
            from megatron.core.inference.contexts import StaticInferenceContext

            self._context = StaticInferenceContext(self.max_batch_size, self.max_model_len)
        return self._context

    def kv_cache_bytes(self) -> int:
        """Bytes held by the KV cache now (0 after :meth:`free_cache`)."""
        if self._context is None:
            return 0
        total = 0
        for pair in self._context.key_value_memory_dict.values():
            total += sum(t.numel() * t.element_size() for t in pair)
        return total

    def free_cache(self) -> None:
        """Drop the KV cache; the next forward re-allocates it (megatron allocates each layer's
        ``[max_model_len, max_batch_size, kv_heads/TP, head_dim]`` keys and values lazily)."""
        if self._context is not None:
            self._context.key_value_memory_dict.clear()
            self._context.reset()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ----------------------------------------------------------------- one forward
    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """Logits ``[b, V]`` (fp32, true vocabulary) of the last fed position on the last
        stage, ``None`` elsewhere. ``tokens``/``positions``: ``[b, s]``."""
        ctx = self.context
        b, s = tokens.shape
        recv = None
        if not self.first_stage:
            dtype = self.config.pipeline_dtype or self.config.params_dtype
            recv = torch.empty(s, b, self.config.hidden_size, dtype=dtype, device=self.device)
            dist.recv(recv, src=self._prev_rank, group=self.pp_group)
        self.model.set_input_tensor(recv)
        out = self.model(tokens, positions, None, inference_context=ctx, runtime_gather_output=True)
        ctx.increment_sequence_len_offset(s)
        if not self.last_stage:
            dist.send(out.contiguous(), dst=self._next_rank, group=self.pp_group)
            return None
        return out[:, -1, : self.vocab_size].float()

    def _share(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The last stage's sampled tokens and log-probs on every stage."""
        if self.pp_size == 1:
            return tokens, logprobs
        box = torch.stack([tokens.double(), logprobs.double()]).to(self.device)
        dist.broadcast(box, src=self._last_rank, group=self.pp_group)
        return box[0].long(), box[1].float()

    def _idle_forward(self) -> None:
        """A one-token forward without the KV cache: this rank's part of an MoE step of its
        expert-parallel peers (its output is dropped)."""
        tokens = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.device)
        positions = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        recv = None
        if not self.first_stage:
            dtype = self.config.pipeline_dtype or self.config.params_dtype
            recv = torch.empty(1, 1, self.config.hidden_size, dtype=dtype, device=self.device)
            dist.recv(recv, src=self._prev_rank, group=self.pp_group)
        self.model.set_input_tensor(recv)
        out = self.model(tokens, positions, None)
        if not self.last_stage:
            dist.send(out.contiguous(), dst=self._next_rank, group=self.pp_group)
        if self.routing is not None:
            self.routing.take_records()

    def _anyone_decoding(self, mine: bool) -> bool:
        """Whether any rank of the expert-parallel group still decodes (collective there);
        just ``mine`` without expert parallelism."""
        if self._ep_group is None:
            return mine
        from reco_megatron.parallel.collectives import collective_device

        flag = torch.tensor([1 if mine else 0], dtype=torch.int32)
        flag = flag.to(collective_device(self._ep_group))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._ep_group)
        return bool(flag.item())

    def lockstep_calls(self, calls: int) -> int:
        """The most :meth:`decode` calls any rank of the expert-parallel group makes for one
        ``generate`` (collective there); ``calls`` without expert parallelism. A rank with
        fewer calls makes up the difference with :meth:`decode_idle`."""
        if self._ep_group is None:
            return calls
        from reco_megatron.parallel.collectives import collective_device

        most = torch.tensor([calls], dtype=torch.int64).to(collective_device(self._ep_group))
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self._ep_group)
        return int(most.item())

    @torch.no_grad()
    def decode_idle(self) -> None:
        """Take part in the MoE forwards of expert-parallel peers that still decode a call
        this rank has no rows for (returns at once without expert parallelism)."""
        was_training = self.model.training
        self.model.eval()
        try:
            with sequence_parallel_off(self.model):  # as in decode: one position per row
                while self._anyone_decoding(False):
                    self._idle_forward()
        finally:
            self.model.set_input_tensor(None)
            self.model.train(was_training)

    def _record(self, routed: torch.Tensor, start: int, end: int, b: int) -> None:
        """Store the experts of positions ``[start, end)`` of the last forward."""
        assert self.routing is not None
        records = self.routing.take_records()
        for j, layer in enumerate(sorted(records)):
            chosen = records[layer].view(end - start, b, -1).transpose(0, 1)
            routed[:, start:end, j] = chosen.to("cpu", routed.dtype)

    def _routed_all_layers(self, routed: torch.Tensor) -> torch.Tensor:
        """``[b, T, layers, k]`` with every pipeline stage's layers (collective over PP)."""
        if self.pp_size == 1:
            return routed
        from reco_megatron.parallel.collectives import collective_device

        device = collective_device(self.pp_group)
        local = routed.to(device, torch.int32)
        parts = [torch.empty_like(local) for _ in range(self.pp_size)]
        dist.all_gather(parts, local, group=self.pp_group)
        return torch.cat([p.cpu() for p in parts], dim=2).to(routed.dtype)

    # ----------------------------------------------------------------- the loop
    @torch.no_grad()
    def decode(
        self,
        prompts: Sequence[Sequence[int]],
        noise: torch.Tensor,
        stop_ids: Sequence[int],
        sample: SampleFn,
    ) -> list[Decoded]:
        """Decode ``len(prompts) <= max_batch_size`` rows (collective over TP and PP).

        ``noise``: ``[b, max_new_tokens]`` uniforms; row ``r``'s ``t``-th response token is
        drawn with ``noise[r, t]`` by ``sample``. Every rank of the model-parallel group must
        call this with the same arguments. Returns one :class:`Decoded` per row.
        """
        b, max_new = noise.shape
        if b != len(prompts) or not 0 < b <= self.max_batch_size:
            raise ValueError(
                f"{len(prompts)} prompts with noise {tuple(noise.shape)}: need one noise row per "
                f"prompt and 1..max_batch_size={self.max_batch_size} rows"
            )
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        total = int(lengths.max()) + max_new
        if total > self.max_model_len:
            raise ValueError(
                f"longest prompt {int(lengths.max())} + max_new_tokens {max_new} = {total} > "
                f"max_model_len {self.max_model_len}"
            )
        buf = torch.full((b, total), self.pad_id, dtype=torch.long)
        for r, p in enumerate(prompts):
            buf[r, : len(p)] = torch.tensor(list(p), dtype=torch.long)
        stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long)
        routed = None
        if self.routing is not None:
            from reco_megatron.megatron.model.replay_hook import MISSING, routed_dtype

            layers = len(self.routing.routers)
            routed = torch.full(
                (b, total, layers, self.routing.topk),
                MISSING,
                dtype=routed_dtype(self.routing.num_experts),
            )
            self.routing.record_all(True)
        out_tok = torch.zeros(b, max_new, dtype=torch.long)
        out_lp = torch.zeros(b, max_new, dtype=torch.float32)
        count = torch.zeros(b, dtype=torch.long)
        stopped = torch.zeros(b, dtype=torch.bool)
        rows = torch.arange(b)

        was_training = self.model.training
        self.model.eval()
        ctx = self.context
        ctx.reset()
        start, end = 0, int(lengths.min())
        with sequence_parallel_off(self.model):
            finished = False
            try:
                while self._anyone_decoding(not finished):
                    if finished:  # expert-parallel peers still decode
                        self._idle_forward()
                        continue
                    step_tokens = buf[:, start:end].to(self.device)
                    positions = torch.arange(start, end, device=self.device).expand(b, -1)
                    logits = self._forward(step_tokens, positions)
                    if routed is not None:
                        self._record(routed, start, end, b)
                    fed = end
                    active = (lengths <= end) & ~stopped & (count < max_new)
                    if self.last_stage:
                        uniforms = noise[rows, count.clamp(max=max_new - 1)]
                        tok, logp = sample(logits, uniforms.to(logits.device))
                        tok, logp = tok.cpu(), logp.float().cpu()
                    else:
                        tok = torch.empty(b, dtype=torch.long)
                        logp = torch.empty(b, dtype=torch.float32)
                    tok, logp = self._share(tok, logp)
                    tok, logp = tok.cpu(), logp.cpu()
                    idx = rows[active]
                    out_tok[idx, count[idx]] = tok[idx]
                    out_lp[idx, count[idx]] = logp[idx]
                    buf[idx, end] = tok[idx]
                    count[idx] += 1
                    stopped[idx] |= torch.isin(tok[idx], stops)
                    done = stopped | (count >= max_new)
                    if bool(done.all()) or end + 1 >= total:
                        finished = True
                        continue
                    if bool((lengths <= end + 1).all()):
                        ctx.enable_decode_mode()
                    start, end = end, end + 1
            finally:
                ctx.reset()
                self.model.set_input_tensor(None)
                self.model.train(was_training)
                if self.routing is not None:
                    self.routing.record_all(False)
        if routed is not None:
            routed = self._routed_all_layers(routed)
            routed[:, fed:] = MISSING  # positions never fed (the last sampled tokens)
        rows = []
        for r in range(b):
            n = int(count[r])
            rows.append(
                Decoded(
                    token_ids=out_tok[r, :n].tolist(),
                    logprobs=out_lp[r, :n].tolist(),
                    stopped=bool(stopped[r]),
                    routed_experts=None if routed is None else routed[r, : int(lengths[r]) + n],
                )
            )
        return rows
