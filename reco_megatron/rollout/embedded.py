"""The embedded rollout engine: ``transformers`` on CPU (or one GPU), the debug default.

Why ``transformers``: the model is built from the policy's Hugging Face config and receives its
weights through :meth:`EmbeddedEngine.update_weights` -- the very ``(hf_name, full_tensor)``
stream vLLM's ``load_weights`` receives on a GPU cluster. A CPU run therefore exercises the
Megatron -> HF export end to end, and a name or layout error shows up on a laptop.

Why our own KV-cached loop instead of ``model.generate``: (1) ``generate`` samples with
``torch.multinomial`` on the *global* RNG, so results would depend on whatever else consumed
it; here every call draws its noise from a :class:`torch.Generator` seeded by (engine seed,
call index) or ``SamplingParams.seed``, and the engine's sampler state is two integers
(:meth:`state_dict`); (2) ``generate``'s ``output_scores`` are the logits *after* top-p/top-k
warping, while the trainer needs ``log softmax(logits / T)`` before truncation; computing it in
the loop makes the alignment explicit: the log-prob recorded at step ``t`` comes from the
logits that produced token ``t`` (see ``docs/rollout.md``). Speed is secondary.

Sampling is inverse-CDF with one uniform per (row, step), all drawn up front for the call from
one stream per distinct seed (:func:`draw_noise`), so a row's randomness depends neither on how
rows are chunked into batches (``max_batch_size``) nor, when each prompt carries its own seed,
on which other prompts share the call.
Prompts of a chunk are left-padded; padded positions are masked out of attention and position
ids count real tokens only, so padding and the KV cache leave log-probs unchanged (tested
against a teacher-forced forward to 1e-5).

Run it: ``EmbeddedEngine(hf_config_dict)`` then ``update_weights(state_dict.items())`` and
``generate(prompts, n, SamplingParams(...))``; one CPU is enough for a tiny model.
"""

from __future__ import annotations

import difflib
import inspect
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch

from reco_megatron.rollout.base import RolloutEngine
from reco_megatron.rollout.embedded_config import EmbeddedEngineConfig, build_hf_model
from reco_megatron.rollout.fused_experts import fused_slot, slots_per_fused
from reco_megatron.rollout.requests import Completion, SamplingArg, SamplingParams
from reco_megatron.rollout.sampling import (
    SeededCalls,
    call_seed,
    draw_noise,
    group_by_setting,
    sample_next,
)
from reco_megatron.utils.logging import get_logger

if TYPE_CHECKING:  # transformers loads on first use
    from transformers import PretrainedConfig

logger = get_logger(__name__)


class EmbeddedEngine(SeededCalls, RolloutEngine):
    """``transformers`` generation with a KV cache and a controlled sampler RNG.

    ``hf_config`` is the policy's Hugging Face config (a dict with ``model_type`` or a
    ``PretrainedConfig``). Weights must be pushed with :meth:`update_weights` before the first
    :meth:`generate` (the random init is never sampled from).
    """

    def __init__(
        self,
        hf_config: Mapping[str, object] | PretrainedConfig,
        config: EmbeddedEngineConfig | None = None,
    ) -> None:
        self.config = config or EmbeddedEngineConfig()
        self.model = build_hf_model(hf_config, self.config)
        hf = self.model.config
        self._vocab_size = int(hf.vocab_size)
        self._max_model_len = self.config.max_model_len or int(hf.max_position_embeddings)
        eos = self.config.eos_token_ids
        if eos is None:
            raw = hf.eos_token_id
            eos = () if raw is None else tuple(raw) if isinstance(raw, list | tuple) else (raw,)
        self._eos_ids = tuple(int(t) for t in eos)
        self._pad_id = int(hf.pad_token_id) if hf.pad_token_id is not None else 0
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._has_logits_to_keep = "logits_to_keep" in params
        self._seed = self.config.seed
        self._calls = 0
        self._weights_loaded = False
        self._weights_asleep = self._kv_asleep = False
        self._closed = False

    # ----------------------------------------------------------------- properties
    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Token ids that end every response (from the HF config or the engine config)."""
        return self._eos_ids

    # ----------------------------------------------------------------- weights
    def _load_weights(self, stream: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Copy a full HF-named state dict into the model, strictly (the base class's
        :meth:`~reco_megatron.rollout.base.RolloutEngine.update_weights` calls this).

        Every parameter and persistent buffer must arrive exactly once (tied weights, e.g.
        ``lm_head.weight`` sharing ``model.embed_tokens.weight``, are satisfied by either name;
        a transformers-5 fused expert tensor by every expert's checkpoint tensor,
        :mod:`~reco_megatron.rollout.fused_experts`);
        unknown names, shape mismatches and missing names raise :class:`ValueError` listing them
        after the whole stream was read. Tensors are cast to the model's dtype and device.
        """
        self._check_open()
        targets = self.model.state_dict(keep_vars=True)
        group_of: dict[str, int] = {}
        groups: dict[int, list[str]] = {}
        for name, tensor in targets.items():
            key = tensor.untyped_storage().data_ptr() if tensor.numel() else id(tensor)
            group_of[name] = key
            groups.setdefault(key, []).append(name)
        loaded: set[int] = set()
        seen: set[str] = set()
        unknown: list[str] = []
        bad_shape: list[str] = []
        duplicate: list[str] = []
        fused_left = slots_per_fused(targets)  # transformers 5 MoE: experts in 3-D tensors
        with torch.no_grad():
            for name, tensor in stream:
                slot = fused_slot(name, targets) if name not in targets else None
                if name not in targets and slot is None:
                    unknown.append(name)
                    continue
                if name in seen:
                    duplicate.append(name)
                    continue
                seen.add(name)
                target = targets[name] if slot is None else targets[slot[0]].detach()[slot[1]]
                if tuple(tensor.shape) != tuple(target.shape):
                    bad_shape.append(
                        f"{name}: got {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                    )
                    continue
                target.detach().copy_(tensor.detach())
                if slot is not None:
                    fused_left[slot[0]] -= 1
                    if fused_left[slot[0]]:
                        continue  # the fused tensor is loaded once every expert's part is in
                loaded.add(group_of[name if slot is None else slot[0]])
        missing = [names[0] for key, names in groups.items() if key not in loaded]
        problems = []
        if unknown:
            hints = {u: difflib.get_close_matches(u, targets, n=1) for u in unknown[:5]}
            problems.append(
                f"{len(unknown)} unknown name(s) not in {type(self.model).__name__}'s state "
                f"dict: {unknown[:5]!r} (closest known: {hints!r})"
            )
        if bad_shape:
            problems.append(f"{len(bad_shape)} shape mismatch(es): {bad_shape[:5]!r}")
        if duplicate:
            problems.append(f"{len(duplicate)} name(s) sent twice: {duplicate[:5]!r}")
        if missing:
            problems.append(f"{len(missing)} missing name(s): {missing[:5]!r}")
        if problems:
            raise ValueError(
                "update_weights: the stream does not match the model: "
                + "; ".join(problems)
                + ". The engine keeps refusing generate until a complete update succeeds."
            )
        logger.debug("embedded engine: loaded %d tensors", len(seen))

    # ----------------------------------------------------------------- generation
    def generate(
        self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingArg
    ) -> list[list[Completion]]:
        """``n`` completions per prompt; ``result[i][j]`` is sample ``j`` of prompt ``i``.

        ``sampling`` may be a list with one :class:`SamplingParams` per prompt. Prompts with
        equal settings apart from the seed decode together (chunks of ``max_batch_size``
        rows); the noise comes from one stream per distinct seed, drawn in prompt order
        (:func:`draw_noise`), so a prompt sampled with its own seed gets the numbers it would
        get alone.
        """
        self._check_open()
        params = self._admit(prompt_token_ids, n, sampling)
        noise = draw_noise(params, n, call_seed(self._seed, self._calls))
        self._calls += 1
        start = time.perf_counter()
        out: list[list[Completion | None]] = [[None] * n for _ in prompt_token_ids]
        for setting, members in group_by_setting(params).items():
            stop_ids = sorted(set(self._eos_ids) | set(setting.stop_token_ids))
            rows = [(i, j) for i in members for j in range(n)]
            row_noise = torch.cat([noise[i] for i in members])
            size = self.config.max_batch_size
            for lo in range(0, len(rows), size):
                chunk = rows[lo : lo + size]
                prompts = [prompt_token_ids[i] for i, _ in chunk]
                decoded = self._generate_chunk(
                    prompts, row_noise[lo : lo + size], setting, stop_ids
                )
                for (i, j), (toks, lps, reason) in zip(chunk, decoded, strict=True):
                    out[i][j] = Completion(
                        prompt_index=i,
                        sample_index=j,
                        token_ids=toks,
                        logprobs=lps,
                        finish_reason=reason,
                    )
        n_tokens = sum(len(c.token_ids) for group in out for c in group if c is not None)
        logger.debug(
            "embedded generate: %d prompts x %d, %d tokens in %.2fs",
            len(out),
            n,
            n_tokens,
            time.perf_counter() - start,
        )
        return [[c for c in group if c is not None] for group in out]

    @torch.inference_mode()
    def _generate_chunk(
        self,
        prompts: list[list[int]],
        noise: torch.Tensor,
        sampling: SamplingParams,
        stop_ids: list[int],
    ) -> list[tuple[list[int], list[float], str]]:
        """Decode one left-padded chunk. ``noise``: ``[b, max_new_tokens]`` uniforms."""
        from transformers import DynamicCache

        device = torch.device(self.config.device)
        b, width = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((b, width), self._pad_id, dtype=torch.long)
        attn = torch.zeros(b, width, dtype=torch.long)
        for r, p in enumerate(prompts):
            input_ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attn[r, width - len(p) :] = 1
        input_ids, attn = input_ids.to(device), attn.to(device)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        try:
            cache = DynamicCache(config=self.model.config)
        except TypeError:  # older transformers: no config argument
            cache = DynamicCache()
        extra = {"logits_to_keep": 1} if self._has_logits_to_keep else {}
        stops = torch.tensor(stop_ids, dtype=torch.long, device=device)
        tokens, logps = [], []
        finished = torch.zeros(b, dtype=torch.bool, device=device)
        length = torch.full((b,), sampling.max_new_tokens, dtype=torch.long, device=device)
        step_input, step_pos = input_ids, positions
        for t in range(sampling.max_new_tokens):
            logits = (
                self.model(
                    input_ids=step_input,
                    attention_mask=attn,
                    position_ids=step_pos,
                    use_cache=True,
                    **{self._cache_kw: cache},
                    **extra,
                )
                .logits[:, -1]
                .float()
            )
            tok, logp = sample_next(logits, noise[:, t].to(device), sampling)
            tok = torch.where(finished, torch.full_like(tok, self._pad_id), tok)
            tokens.append(tok)
            logps.append(logp)
            hit = torch.isin(tok, stops) & ~finished
            length = torch.where(hit, torch.full_like(length, t + 1), length)
            finished |= hit
            if bool(finished.all()) or t + 1 == sampling.max_new_tokens:
                break
            attn = torch.cat([attn, torch.ones(b, 1, dtype=attn.dtype, device=device)], dim=1)
            step_input, step_pos = tok[:, None], attn.sum(-1, keepdim=True) - 1
        tok_mat = torch.stack(tokens, 1).cpu()
        lp_mat = torch.stack(logps, 1).cpu()
        results = []
        for r in range(b):
            keep = int(length[r])
            reason = "stop" if bool(finished[r]) else "length"
            results.append((tok_mat[r, :keep].tolist(), lp_mat[r, :keep].tolist(), reason))
        return results

    # ----------------------------------------------------------------- memory and state
    def _release_memory(self) -> None:
        """Move weights to host memory on GPU; on CPU nothing is held between calls (the KV
        cache lives only inside :meth:`generate`), so sleeping only marks the engine."""
        self._check_open()
        if torch.device(self.config.device).type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def _restore_memory(self, tag: str) -> None:
        """``"weights"``: back to the engine's device; ``"kv_cache"``: nothing to allocate (the
        cache is built per :meth:`generate` call)."""
        self._check_open()
        if tag == "weights" and torch.device(self.config.device).type == "cuda":
            self.model.to(self.config.device)

    def close(self) -> None:
        """Drop the model; the engine cannot be used afterwards."""
        if not self._closed:
            self.model = None  # type: ignore[assignment]
            self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine was closed; build a new EmbeddedEngine")
