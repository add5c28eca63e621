"""Run multi-turn episodes on any rollout engine, token ids in and out.

:func:`run_episodes` takes the place of one ``engine.generate(prompts, n, sampling)`` call and
returns the same ``[prompts][n]`` completions, each the whole episode: the actions the policy
sampled (loss mask 1, their log-probs) and the observations the environment appended (loss
mask 0, log-prob 0), in order. The environments' steps run in the
:class:`~reco_megatron.envs.pool.EnvPool` workers, several at once; with ``overlap`` (the
default for a pool of its own) an episode acts again as soon as its own step is back, in one
batched ``generate`` call with whatever else is ready, while the other environments still
run, so one slow tool call holds up only its own episode. Without it (a pool shared by a
model-parallel group) episodes go turn by turn.

The first turn is exactly the single-turn call (the same prompts, ``n`` and per-prompt seeds),
so an environment that ends every episode after one action reproduces single-turn sampling.
Later turns decode each episode as its own prompt, ``prompt + tokens so far``, with the seed
``hash((prompt seed, sample, turn))``. Each turn's prompt is the whole context: vLLM's prefix
cache and the megatron engine's (``rollout.prefix_cache_gib``, on with an environment) reuse
the keys and values of the earlier turns and prefill only the new tokens (the last action token
and the observation); the embedded engine prefills the whole context again.

An episode ends when its environment says ``done`` (an action that ended on an
end-of-sequence token is still handed to ``step``: in a chat the assistant ends every turn so,
and the environment decides), after ``max_turns`` actions, or when its tokens reach
``sampling.max_new_tokens`` (the budget of the whole episode; an observation that would leave
no room for an action ends the episode unappended). A failed environment call
(:data:`~reco_megatron.envs.pool.FAILURES`) ends its episode, which is then scored 0
(``EpisodeResult.failed``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from reco_megatron.envs.pool import FAILURES, EnvPool, Outcome
from reco_megatron.rollout.requests import Completion, SamplingParams

Generate = Callable[[list[list[int]], int, list[SamplingParams]], list[list[Completion]]]
"""``engine.generate`` with one :class:`SamplingParams` per prompt."""


@dataclass
class _Episode:
    group: int
    sample: int
    prompt: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    stop_ids: tuple[int, ...] = ()
    turns: int = 0
    tool_calls: int = 0
    rewards: list[float | None] = field(default_factory=list)
    finish: str = "stop"
    failed: str = ""
    """The failure that ended it (a :data:`FAILURES` kind), or ``""``."""
    ended: str = ""
    """Why it ended: ``done``, ``max_turns``, ``budget`` or a failure."""
    routed: Any = None


@dataclass
class EpisodeResult:
    """What :func:`run_episodes` returns (``[groups][n]`` lists, group-major)."""

    prompts: list[list[int]]
    """``[groups]`` the prompt of each group (what the environment's ``reset`` returned)."""
    completions: list[list[Completion]]
    """``[groups][n]`` whole episodes with their loss masks."""
    turn_rewards: list[list[float]]
    """``[groups][n]`` the per-turn rewards, discounted and summed (0 when none)."""
    failed: list[list[bool]]
    """``[groups][n]`` True where an environment call failed: the episode scores 0."""
    metrics: dict[str, float]
    """``env_*`` columns: sums and counts (summed over ranks, then divided by the caller)."""
    group_metrics: list[dict[str, float]] = field(default_factory=list)
    """``[groups]`` the same counters per group (they add up to :attr:`metrics`): what a
    separate rollout worker sends, so each trainer rank sums those of its own groups."""


def run_episodes(
    generate: Generate,
    pool: EnvPool,
    rows: Sequence[Mapping[str, Any]],
    n: int,
    sampling: Sequence[SamplingParams],
    *,
    max_turns: int,
    turn_discount: float = 1.0,
    first_id: int = 0,
    overlap: bool | None = None,
) -> EpisodeResult:
    """``n`` episodes per row (see the module doc). ``rows[i]``: the dataset record
    ``{"prompt", "answer", "prompt_ids"}``; ``sampling[i]``: its :class:`SamplingParams`
    (seed, budget ``max_new_tokens``, the end-of-sequence stop ids); ``first_id``: the pool's
    id of the first episode (ids must not repeat while the pool lives). ``overlap``: episodes
    act as soon as their own step is back, while other environments still run (None: when
    the pool can, i.e. has ``submit``/``collect``; a pool shared by a model-parallel group
    goes turn by turn so that every rank makes the same engine calls). Both give the same
    episodes: an action's seed is ``(prompt seed, sample, turn)``, never the batch."""
    episodes = [_Episode(g, j) for g in range(len(rows)) for j in range(n)]
    ids = {first_id + k: ep for k, ep in enumerate(episodes)}
    resets = pool.reset({eid: dict(rows[ep.group]) for eid, ep in ids.items()})
    prompts = _prompts(ids, resets, rows, n)
    try:
        if overlap is None:
            overlap = hasattr(pool, "submit") and hasattr(pool, "collect")
        run = _overlapped if overlap else _turns
        run(generate, pool, ids, prompts, sampling, n, max_turns)
    finally:
        pool.release(list(ids))
    return _result(episodes, prompts, n, turn_discount)


def _prompts(ids: dict[int, _Episode], resets: dict[int, Outcome], rows, n: int) -> list[list[int]]:
    """Each group's prompt: its first sample's reset (others that differ fail)."""
    prompts: list[list[int]] = [list(row["prompt_ids"]) for row in rows]
    chosen: dict[int, list[int]] = {}
    for eid, ep in ids.items():
        out = resets[eid]
        if not out.ok:
            ep.failed = ep.ended = out.status
            continue
        prompt = list(out.values["prompt"])
        if chosen.setdefault(ep.group, prompt) != prompt:
            ep.failed = ep.ended = "invalid"  # one batch row per group: one prompt per group
            continue
        ep.stop_ids = tuple(out.values["stop_ids"])
    for group, prompt in chosen.items():
        prompts[group] = prompt
    for ep in ids.values():
        ep.prompt = prompts[ep.group]
    return prompts


def _act(generate, ids, prompts, sampling, n, eids: list[int]) -> dict[int, Completion]:
    """One action for each of ``eids``, appended to its episode. Episodes with no action yet
    take the single-turn call (every group's prompt, ``n`` samples); the others go alone,
    their context so far and one sample each, in one batched call."""
    actions: dict[int, Completion] = {}
    fresh = [e for e in eids if ids[e].turns == 0]
    if fresh:
        first: dict[int, _Episode] = {}
        for eid in fresh:
            first.setdefault(ids[eid].group, ids[eid])
        groups = sorted(first)
        params = [_params(sampling[g], first[g], 0) for g in groups]
        out = generate([prompts[g] for g in groups], n, params)
        where = {g: k for k, g in enumerate(groups)}
        actions.update({e: out[where[ids[e].group]][ids[e].sample] for e in fresh})
    going = [e for e in eids if ids[e].turns > 0]
    if going:
        params = [_params(sampling[ids[e].group], ids[e], ids[e].turns) for e in going]
        out = generate([ids[e].prompt + ids[e].tokens for e in going], 1, params)
        actions.update({eid: out[k][0] for k, eid in enumerate(going)})
    for eid, c in actions.items():
        ep = ids[eid]
        ep.tokens += c.token_ids
        ep.logprobs += c.logprobs
        ep.mask += [1] * len(c.token_ids)
        ep.turns += 1
        ep.finish = c.finish_reason
        ep.routed = c.routed_experts
    return actions


def _steps(actions: dict[int, Completion]) -> dict[int, tuple[list[int], str]]:
    return {eid: (c.token_ids, c.finish_reason) for eid, c in actions.items()}


def _turns(generate, pool, ids, prompts, sampling, n, max_turns) -> None:
    """Turn by turn: every running episode acts, then every environment steps."""
    live = [eid for eid, ep in ids.items() if not ep.ended]
    while live:
        actions = _act(generate, ids, prompts, sampling, n, live)
        results = pool.step(_steps(actions))
        budget = {e: sampling[ids[e].group].max_new_tokens for e in live}
        live = [e for e in live if _apply(ids[e], results[e], budget[e], max_turns)]


def _overlapped(generate, pool, ids, prompts, sampling, n, max_turns) -> None:
    """Episodes act as soon as their own step is back: the engine decodes the ready ones
    while the other environments still run (one batched call for all that are ready)."""
    live = [eid for eid, ep in ids.items() if not ep.ended]
    if not live:
        return
    actions = _act(generate, ids, prompts, sampling, n, live)
    pool.submit(_steps(actions))
    pending = set(actions)
    while pending:
        done = pool.collect(block=True)
        done.update(pool.collect(block=False))
        if not done:
            raise RuntimeError(f"environment pool: {len(pending)} steps pending, none running")
        ready = []
        for eid, out in done.items():
            pending.discard(eid)
            budget = sampling[ids[eid].group].max_new_tokens
            if _apply(ids[eid], out, budget, max_turns):
                ready.append(eid)
        if ready:
            actions = _act(generate, ids, prompts, sampling, n, sorted(ready))
            pool.submit(_steps(actions))
            pending.update(actions)


def _params(base: SamplingParams, ep: _Episode, turn: int) -> SamplingParams:
    """Turn ``turn``'s sampling for ``ep``: the budget left, its stop ids, the turn's seed."""
    stops = tuple(dict.fromkeys((*base.stop_token_ids, *ep.stop_ids)))
    seed = base.seed
    if turn and seed is not None:
        seed = hash((seed, ep.sample, turn)) % (2**31)
    left = base.max_new_tokens - len(ep.tokens)
    return replace(base, max_new_tokens=left, stop_token_ids=stops, seed=seed)


def _apply(ep: _Episode, out: Outcome, budget: int, max_turns: int) -> bool:
    """Take the step's result into the episode; True while it goes on."""
    if not out.ok:
        ep.failed = ep.ended = out.status
        return False
    ep.rewards.append(out.values["reward"])
    left = budget - len(ep.tokens)
    obs = list(out.values["obs"])
    if out.values["done"]:
        ep.ended = "done"
    elif left <= 0 or ep.finish == "length":
        ep.ended, ep.finish = "budget", "length"
    elif ep.turns >= max_turns:
        ep.ended = "max_turns"
    elif len(obs) + 1 > left:  # no room for an action after it
        ep.ended, ep.finish = "budget", "length"
    else:
        ep.tool_calls += 1 if obs else 0
        ep.tokens += obs
        ep.logprobs += [0.0] * len(obs)
        ep.mask += [0] * len(obs)
        ep.stop_ids = tuple(out.values["stop_ids"]) or ep.stop_ids
        return True
    return False


def _result(episodes: list[_Episode], prompts, n: int, discount: float) -> EpisodeResult:
    completions: list[list[Completion]] = [[] for _ in prompts]
    turn_rewards: list[list[float]] = [[] for _ in prompts]
    failed: list[list[bool]] = [[] for _ in prompts]
    n_groups = len(prompts)
    for ep in episodes:
        completions[ep.group].append(
            Completion(
                prompt_index=ep.group,
                sample_index=ep.sample,
                token_ids=ep.tokens,
                logprobs=ep.logprobs,
                finish_reason="length" if ep.finish == "length" else "stop",
                routed_experts=ep.routed if ep.turns and not ep.failed else None,
                loss_mask=ep.mask,
            )
        )
        ret = sum(discount**k * r for k, r in enumerate(ep.rewards) if r is not None)
        turn_rewards[ep.group].append(0.0 if ep.failed else float(ret))
        failed[ep.group].append(bool(ep.failed))
    per_group = [episode_metrics([ep for ep in episodes if ep.group == g]) for g in range(n_groups)]
    return EpisodeResult(
        prompts, completions, turn_rewards, failed, episode_metrics(episodes), per_group
    )


def episode_metrics(episodes: Sequence[_Episode]) -> dict[str, float]:
    """Sums over this rank's episodes (``env_*_sum``) and the episode count."""
    tokens = sum(len(ep.tokens) for ep in episodes)
    observed = sum(len(ep.mask) - sum(ep.mask) for ep in episodes)
    out = {
        "env_episodes": float(len(episodes)),
        "env_turns_sum": float(sum(ep.turns for ep in episodes)),
        "env_tool_calls_sum": float(sum(ep.tool_calls for ep in episodes)),
        "env_episode_len_sum": float(tokens),
        "env_observation_tokens_sum": float(observed),
        "env_failed_sum": float(sum(bool(ep.failed) for ep in episodes)),
        "env_max_turns_sum": float(sum(ep.ended == "max_turns" for ep in episodes)),
        "env_budget_sum": float(sum(ep.ended == "budget" for ep in episodes)),
    }
    for kind in FAILURES:
        out[f"env_{kind}_sum"] = float(sum(ep.failed == kind for ep in episodes))
    return out
