"""Decoding on the trainer's own megatron-core model chunks (the ``megatron`` rollout engine).

:class:`MegatronDecoder` decodes like an inference engine on the ``GPTModel`` chunk the
trainer trains, at the trainer's TP/PP/EP layout, without a weight copy: it owns attention
and the KV cache (:mod:`.attention`: keys rotated once when written, grouped queries without
K/V copies) and calls the live modules for everything else (:mod:`.stage`).

A call (:meth:`MegatronDecoder.decode`):

* **prefill**: every prompt in one forward (right padding, per-row positions), logits of each
  row's last prompt position only, the first response token sampled;
* **decode steps**: one position per row; the sampling (the rollout layer's noise-table
  sampler, handed in as ``sample``), the stop checks and the bookkeeping stay on the device
  (:func:`.state.advance`); the host reads the state every ``sync_every`` steps, stops when
  every row is done and moves the live rows into a smaller batch (:func:`.state.bucket`);
* on a CUDA device each batch size's step is captured as a CUDA graph after a warm-up and
  replayed (:mod:`.graphs`); the CPU runs the same code eagerly.

Row ``r``'s ``t``-th response token uses ``noise[r, t]`` in any batch (as the embedded engine).
Pipeline parallelism: each stage receives the previous stage's hidden states, the last stage
samples and broadcasts tokens and log-probs over the pipeline group, so every stage keeps the
same state. Tensor-parallel ranks run the same rows and sample the same tokens from logits
gathered over TP. Sequence parallelism is switched off while decoding
(:func:`.sequence_parallel.sequence_parallel_off`: one position per row cannot be split).

Mixture-of-experts: with ``routing`` the decoder records the experts of every fed position
(``Decoded.routed_experts``, ``[positions, layers, top-k]``, ``-1`` where never fed) for
routing replay. With expert parallelism the ranks of an EP group exchange tokens inside every
MoE layer, so they run the same number of forwards: at every host read they agree (one
all-reduce) whether anyone still decodes, and a rank without live rows joins with one-token
forwards without the cache (:meth:`decode_idle` does the same for a whole call). Expert
parallel and PP steps, and steps that record routing, stay eager (no CUDA graph).

Prefix cache (:mod:`.prefix`): a prompt that extends a finished row of an earlier call
prefills only its new tokens; the owner calls :meth:`MegatronDecoder.reset_prefix_cache` when
the weights change. Off while recording MoE routing and under expert parallelism.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from reco_megatron.megatron.decoding.graphs import StepGraphs
from reco_megatron.megatron.decoding.groups import StageGroups
from reco_megatron.megatron.decoding.memory import CacheMemory
from reco_megatron.megatron.decoding.prefix import CallPrefixes, PrefixCache
from reco_megatron.megatron.decoding.sequence_parallel import sequence_parallel_off
from reco_megatron.megatron.decoding.stage import StageForward
from reco_megatron.megatron.decoding.state import (
    CallState,
    Decoded,
    Slots,
    advance,
    bucket,
    prompt_batch,
)

SampleFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``sample(logits [b, V] fp32, uniforms [b] fp64) -> (tokens [b] long, logprobs [b] fp32)``,
tensor code only (it runs inside a captured step)."""


class MegatronDecoder:
    """KV-cached decoding on one pipeline stage's ``GPTModel`` (unwrapped from DDP).

    Args:
        chunks: the trainer's model chunks of this stage (``ReCoEngine.unwrapped()``); exactly
            one (the interleaved/virtual pipeline is not supported for decoding).
        vocab_size: the true vocabulary (logits beyond it are Megatron's padding, dropped).
        max_model_len: longest ``prompt + response``.
        max_batch_size: rows per call; None (``auto``): as many as fit in
            ``kv_cache_bytes``.
        kv_cache_bytes: the most the KV cache may take on this rank (None: half the free
            device memory at the first call on CUDA, 4 GiB on the CPU).
        pad_id: token fed in padded prompt positions (never read).
        routing / record_routing: the policy's MoE routing; record each position's experts.
        sync_every: decode steps between two host reads of the state.
        cuda_graphs: capture the decode step on CUDA (dense models, PP 1, no recording).
        prefix_cache_bytes: the most the prefix cache may hold on this rank (None: half of
            :meth:`kv_limit`; 0: off); see :class:`.prefix.PrefixCache`.
    """

    def __init__(
        self,
        chunks: Sequence[Any],
        *,
        vocab_size: int,
        max_model_len: int,
        max_batch_size: int | None = None,
        kv_cache_bytes: int | None = None,
        pad_id: int = 0,
        routing: Any = None,
        record_routing: bool = False,
        sync_every: int = 8,
        cuda_graphs: bool = True,
        prefix_cache_bytes: int | None = None,
    ) -> None:
        from megatron.core import parallel_state as ps

        if len(chunks) != 1:
            raise ValueError(
                f"the megatron rollout engine decodes on one model chunk per stage, got "
                f"{len(chunks)} (virtual pipeline): set "
                "parallel.virtual_pipeline_model_parallel_size=null or use rollout.engine=embedded"
            )
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1 or None (auto), got {max_batch_size}")
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        if record_routing and routing is None:
            raise ValueError("record_routing needs the model's routing (an MoE model)")
        self.model = chunks[0]
        self.vocab_size = int(vocab_size)
        self.max_model_len = int(max_model_len)
        self.max_batch_size = max_batch_size
        self.pad_id = int(pad_id)
        self.sync_every = int(sync_every)
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        ranks = dist.get_process_group_ranks(self.pp_group) if self.pp_size > 1 else [0]
        stage = ps.get_pipeline_model_parallel_rank()
        self.stage = StageForward(
            self.model,
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            pp_group=self.pp_group,
            prev_rank=ranks[stage - 1] if stage > 0 else None,
            next_rank=ranks[stage + 1] if stage + 1 < len(ranks) else None,
        )
        self.device = self.stage.device
        self.routing = routing if record_routing else None
        ep = ps.get_expert_model_parallel_world_size() if routing is not None else 1
        self._ep_group = ps.get_expert_model_parallel_group() if ep > 1 else None
        self.groups = StageGroups(
            self.pp_group, self.pp_size, ranks[-1], self._ep_group, self.device
        )
        self.memory = CacheMemory(self.stage, self.max_model_len, max_batch_size, kv_cache_bytes)
        self._state: CallState | None = None
        graphs = cuda_graphs and self.pp_size == 1 and self._ep_group is None
        self.graphs = StepGraphs(graphs and self.routing is None, self.device)
        on = self.routing is None and ep == 1  # where the prefix cache may be used
        self.prefix_cache = PrefixCache(prefix_cache_bytes, on, ps.get_model_parallel_group())
        self._prefixes: CallPrefixes | None = None  # the call's use of it

    # ----------------------------------------------------------------- the KV cache
    @property
    def _cache(self) -> Any:
        return self.memory.cache

    def kv_cache_bytes(self) -> int:
        """Bytes held by the KV cache now (0 after :meth:`free_cache`)."""
        return self.memory.nbytes()

    def free_cache(self) -> None:
        """Drop the KV cache (and the captured steps that read it); the next call re-allocates."""
        self._state = None
        self.graphs.reset()
        self.memory.free()

    def kv_limit(self) -> int:
        """Bytes the KV cache may take on this rank (``kv_cache_bytes``, or the default)."""
        return self.memory.limit()

    def max_rows(self, length: int) -> int:
        """Rows one call may decode with ``length`` positions (:meth:`CacheMemory.max_rows`)."""
        return self.memory.max_rows(length)

    def reset_prefix_cache(self) -> None:
        """Drop every kept prefix: call it on every rank whenever the weights change."""
        self.prefix_cache.reset()

    # ----------------------------------------------------------------- expert parallel
    def lockstep_calls(self, calls: int) -> int:
        """The most :meth:`decode` calls any rank of the expert-parallel group makes for one
        ``generate`` (collective there); ``calls`` without expert parallelism. A rank with
        fewer calls makes up the difference with :meth:`decode_idle`."""
        return self.groups.most(calls)

    def _idle_forward(self) -> None:
        """This rank's part of its expert-parallel peers' MoE step (output dropped)."""
        self.stage.idle(self.pad_id)
        if self.routing is not None:
            self.routing.take_records()

    @torch.no_grad()
    def decode_idle(self) -> None:
        """Take part in the MoE forwards of expert-parallel peers that still decode a call
        this rank has no rows for (returns at once without expert parallelism)."""
        was_training = self.model.training
        self.model.eval()
        try:
            with sequence_parallel_off(self.model):
                while self.groups.anyone(False):
                    for _ in range(self.sync_every):
                        self._idle_forward()
        finally:
            self.model.set_input_tensor(None)
            self.model.train(was_training)

    # ----------------------------------------------------------------- one call
    def _call_state(self, noise: torch.Tensor, stop_ids: Sequence[int]) -> CallState:
        """The call's state; the previous call's tensors are refilled when the shapes match
        (the captured steps read them), else new ones replace them and the graphs go."""
        new = CallState.new(noise, list(stop_ids), self.device)
        if self._state is not None and self._state.refill(new):
            return self._state
        self.graphs.reset()
        self._state = new
        return new

    def _prefill(
        self, state: CallState, prompts: Sequence[Sequence[int]], window: int, sample: SampleFn
    ) -> Slots:
        """Feed every prompt, past what the prefix cache holds of it (one forward, or one per
        group of rows when the attention scores would be large; one under expert
        parallelism), sample each first token."""
        b, lengths = len(prompts), [len(p) for p in prompts]
        longest = max(lengths)
        prefixes = self._prefixes
        starts = prefixes.load_hits(self._cache) if prefixes is not None else [0] * b
        self.prefix_cache.count(sum(lengths), sum(starts))
        tokens, positions, index_of_last, last = prompt_batch(
            prompts, self.pad_id, self.device, starts, window
        )
        slots = self.graphs.slots(b)
        slots.rows.copy_(torch.arange(b, device=self.device))
        slots.positions.copy_(last)
        rest = tokens.shape[1]
        step = b if self._ep_group is not None else self.stage.prefill_rows(rest, window)
        parts = []
        for lo in range(0, b, step):
            part = slice(lo, min(b, lo + step))
            index = slots.index[part]
            args = (tokens[part], positions[part], index, index_of_last[part], lo)
            parts.append(self.stage.forward(self._cache, window, *args))
            if self.routing is not None:  # the prompt positions of these rows
                valid = [(r, t) for r in range(part.start, part.stop) for t in range(lengths[r])]
                rows = torch.tensor([r for r, _ in valid], device=self.device)
                fed = torch.tensor([t for _, t in valid], device=self.device)
                state.record(self.routing.take_records(), longest, (rows - lo, fed), rows, fed)
        logits = None if parts[0] is None else torch.cat(parts)
        self._sample_and_advance(state, slots, logits, sample)
        return slots

    def _sample_and_advance(
        self, state: CallState, slots: Slots, logits: torch.Tensor | None, sample: SampleFn
    ) -> None:
        n = slots.size
        if logits is not None:
            tokens, logprobs = sample(logits, state.uniforms(slots.rows))
        else:
            tokens = torch.empty(n, dtype=torch.long, device=self.device)
            logprobs = torch.empty(n, dtype=torch.float32, device=self.device)
        tokens, logprobs = self.groups.share(tokens, logprobs)
        advance(state, slots, tokens, logprobs.float())

    def _step(self, state: CallState, slots: Slots, window: int, sample: SampleFn) -> None:
        """One decode step of every slot: tensor code only (captured on CUDA)."""
        fed = slots.positions.clone() if self.routing is not None else None
        logits = self.stage.forward(
            self._cache, window, slots.tokens[:, None], slots.positions[:, None], slots.index
        )
        if fed is not None:
            assert self.routing is not None
            steps = torch.zeros_like(fed)
            entries = (slots.index[:, 0], steps)
            state.record(self.routing.take_records(), 1, entries, slots.rows, fed)
        self._sample_and_advance(state, slots, logits, sample)

    def _shrink(self, state: CallState, slots: Slots) -> Slots | None:
        """Read the state (the host synchronisation of a round): None when every row is
        done, else the batch, moved into a smaller one when half of it or more finished."""
        live = (~state.finished[slots.rows]).cpu()
        if self._prefixes is not None:  # keep finished rows before their slots may go
            rows = slots.rows.cpu().tolist()
            self._prefixes.keep(self._cache, state, rows, (~live).tolist())
        n_live = int(live.sum())
        if n_live == 0:
            return None
        size = bucket(n_live, slots.size)
        if size == slots.size:
            return slots
        order = live.nonzero().flatten().tolist()
        order += [int((~live).nonzero()[0])] * (size - n_live)  # finished rows pad the batch
        index = torch.tensor(order, device=self.device)
        self._cache.compact(index)
        return self.graphs.load(slots.compacted(index))

    @torch.no_grad()
    def decode(
        self,
        prompts: Sequence[Sequence[int]],
        noise: torch.Tensor,
        stop_ids: Sequence[int],
        sample: SampleFn,
        sample_key: Any = None,
    ) -> list[Decoded]:
        """Decode ``len(prompts)`` rows (collective over TP, PP and EP).

        ``noise``: ``[b, max_new_tokens]`` uniforms; row ``r``'s ``t``-th response token is
        drawn with ``noise[r, t]`` by ``sample``. ``sample_key``: a hashable naming ``sample``'s
        settings (captured steps are reused across calls with equal keys; None: no capture).
        Every rank of the model-parallel group calls this with the same arguments.
        """
        b, max_new = noise.shape
        lengths = [len(p) for p in prompts]
        window = self.memory.window(lengths, b, max_new)
        if not self.memory.holds(b, window):
            self.free_cache()
            self.memory.allocate(b, window)
        state = self._call_state(noise, stop_ids)
        if self.routing is not None:
            from reco_megatron.megatron.model.replay_hook import MISSING, routed_dtype

            shape = (b, window, len(self.routing.routers), self.routing.topk)
            dtype = routed_dtype(self.routing.num_experts)
            state.routed = torch.full(shape, MISSING, dtype=dtype, device=self.device)
            self.routing.record_all(True)
        key = None if sample_key is None else (window, max_new, sample_key)
        was_training = self.model.training
        self.model.eval()
        try:
            with sequence_parallel_off(self.model):
                self._loop(state, prompts, window, sample, key)
        finally:
            self.model.set_input_tensor(None)
            self.model.train(was_training)
            if self.routing is not None:
                self.routing.record_all(False)
        routed = None
        if state.routed is not None:
            routed = self.groups.all_layers(state.routed.cpu())
        return state.results(lengths, routed)

    def _loop(
        self,
        state: CallState,
        prompts: Sequence[Sequence[int]],
        window: int,
        sample: SampleFn,
        key: Any,
    ) -> None:
        """Rounds of device-only forwards (the prefill, then decode steps), each followed by
        one host read (:meth:`_shrink`). Under expert parallelism every round is
        ``sync_every`` forwards on every rank of the group (a rank without live rows runs
        :meth:`_idle_forward`) and starts with the group agreeing whether anyone decodes."""
        lockstep = self._ep_group is not None
        self._prefixes = self.prefix_cache.call(prompts, self.kv_limit, self.stage.bytes_per_row(1))
        slots: Slots | None = None
        started = False
        steps_left = state.max_new - 1
        while self.groups.anyone(slots is not None or not started):
            used = 0
            if not started:
                slots = self._prefill(state, prompts, window, sample)
                started, used = True, 1
            limit = self.sync_every - used if lockstep else min(self.sync_every, steps_left)
            for _ in range(limit):
                if slots is None:
                    self._idle_forward()  # this rank is done, expert-parallel peers are not
                    continue
                step = partial(self._step, state, slots, window, sample)
                if key is None:  # an unnamed sampler: nothing to reuse a capture for
                    step()
                else:
                    self.graphs.run((slots.size, key), step)
                steps_left -= 1
            if slots is not None:
                slots = self._shrink(state, slots)
