"""The episode contract: what an environment is, token in and token out.

One environment object serves one episode, that is one (prompt, sample) pair::

    env = MyEnv(tokenizer)                 # the run's tokenizer (None when the run has none)
    prompt_ids = env.reset(row)            # the row: {"prompt", "answer", "prompt_ids"}
    step = env.step(action_ids, finish)    # what the policy sampled this turn
    step.observation_ids                   # appended verbatim after the action
    step.done, step.reward, step.stop_ids

Token ids travel both ways and are never decoded and encoded again by the trainer: the ids the
sampler drew and the ids the environment returned are the ids the trainer trains on (only the
environment itself may decode an action to read it). The episode runner
(:mod:`reco_megatron.envs.episodes`) ends an episode when a step says ``done``, after
``rollout.max_turns`` actions, or when the episode's tokens (actions and observations) reach
``rollout.max_new_tokens``. An action that ended on an end-of-sequence token is handed to
``step`` like any other (the environment decides whether the episode goes on).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_MESSAGE_BYTES = 1 << 24
"""Largest message between the trainer and an environment worker (16 MiB of JSON)."""


@dataclass(frozen=True)
class Step:
    """What an environment returns for one action."""

    observation_ids: Sequence[int]
    """Token ids appended after the action (the tool's output, already tokenised); they are
    model input but never trained on (loss mask 0). Ignored when ``done``."""
    done: bool
    """True ends the episode after this action (no observation is appended)."""
    reward: float | None = None
    """An optional reward for this turn; the episode's per-turn rewards are summed with the
    discount ``rollout.turn_discount`` (turn k counts ``turn_discount**k``) and added to the
    reward function's score of the whole episode (the terminal reward)."""
    stop_ids: Sequence[int] = ()
    """Token ids that end the *next* action (besides end-of-sequence), e.g. the token that
    closes a tool call; empty: the environment's :attr:`Env.stop_ids`."""


class Env:
    """Base class of an environment (subclassing it is optional: any class with these
    methods works). The trainer builds one per episode in an isolated worker process, calls
    :meth:`reset` once, then :meth:`step` after every action until the episode ends; every
    call runs under ``rollout.env_step_timeout_s``."""

    stop_ids: Sequence[int] = ()
    """Token ids that end an action (besides end-of-sequence) unless a step names others:
    read after :meth:`reset`, used for the first action."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def reset(self, row: Mapping[str, Any]) -> Sequence[int]:
        """The prompt's token ids for this episode. ``row``: the dataset record,
        ``{"prompt": str, "answer": str, "prompt_ids": list[int]}`` with ``prompt_ids`` the
        trainer's formatted prompt (return it unless the environment writes its own)."""
        return list(row["prompt_ids"])

    def step(self, action_ids: Sequence[int], finish: str) -> Step:
        """React to the policy's action: ``action_ids`` the tokens it sampled this turn,
        ``finish`` ``"stop"`` (it ended on a stop or end-of-sequence token) or ``"length"``
        (the episode's token budget ran out)."""
        raise NotImplementedError


class StepError(ValueError):
    """An environment returned something that is not a valid :class:`Step`."""


def check_ids(value: object, what: str, vocab_size: int | None, limit: int) -> list[int]:
    """``value`` as a list of token ids in ``[0, vocab_size)``, at most ``limit`` of them."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise StepError(f"{what} must be a list of token ids, got {type(value).__name__}")
    if len(value) > limit:
        raise StepError(f"{what} has {len(value)} token ids, more than the limit {limit}")
    ids = []
    for tok in value:
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise StepError(f"{what} holds {tok!r}, not an int token id")
        if tok < 0 or (vocab_size is not None and tok >= vocab_size):
            raise StepError(f"{what} holds token id {tok}, outside [0, {vocab_size})")
        ids.append(int(tok))
    return ids


def check_prompt(value: object, vocab_size: int | None, limit: int) -> list[int]:
    """The token ids :meth:`Env.reset` returned, validated (non-empty, in the vocabulary)."""
    ids = check_ids(value, "reset() result", vocab_size, limit)
    if not ids:
        raise StepError("reset() returned no prompt tokens")
    return ids


def check_step(value: object, vocab_size: int | None, limit: int) -> Step:
    """:meth:`Env.step`'s return value as a plain :class:`Step`, validated: token ids in the
    vocabulary, ``done`` a bool, ``reward`` None or a finite number; raises :class:`StepError`."""
    if not isinstance(value, Step):
        raise StepError(f"step() must return a Step, got {type(value).__name__}")
    if not isinstance(value.done, bool):
        raise StepError(f"Step.done must be a bool, got {value.done!r}")
    reward = value.reward
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            raise StepError(f"Step.reward must be a number or None, got {reward!r}")
        if not math.isfinite(reward):
            raise StepError(f"Step.reward must be finite, got {reward!r}")
        reward = float(reward)
    obs = (
        []
        if value.done
        else check_ids(value.observation_ids, "Step.observation_ids", vocab_size, limit)
    )
    stops = check_ids(value.stop_ids, "Step.stop_ids", vocab_size, limit)
    return Step(observation_ids=obs, done=value.done, reward=reward, stop_ids=tuple(stops))
