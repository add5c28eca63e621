"""A reward's trial before a run: importable, callable as ``fn(response, gold)``, and a number
on a real example, said in one line.

The pre-flight of the trainer (and of ``launch_check``) calls :func:`reward_problem` with the
first prompt of the run's data, before the run directory exists, so a misspelt function or one
that returns a string stops the run at once::

    problem = reward_problem(cfg.reward, response=gold, gold=gold)   # None: usable

The call runs in one isolated worker (:class:`~reco_megatron.rewards.pool.RewardPool`, with the
run's time and memory limits), never in the caller. Built-in rewards are known to pass and are
only resolved.
"""

from __future__ import annotations

from dataclasses import replace

from reco_megatron.rewards import types as st
from reco_megatron.rewards.pool import RewardPool
from reco_megatron.rewards.pool_config import RewardPoolConfig
from reco_megatron.rewards.registry import BUILTIN_REWARDS, RewardSpecError, resolve_reward

_REFUSED = {
    st.INVALID: "a value that is not a number",
    st.NAN: "NaN or an infinity",
    st.NONE: "None (a missing return?)",
    st.OUT_OF_RANGE: "a number beyond reward.max_abs_score",
    st.ERROR: "an exception",
    st.CRASH: "a crash of its worker",
    st.MEMORY: "a MemoryError under reward.memory_limit_mb",
}


def reward_problem(config: RewardPoolConfig, *, response: str, gold: str) -> str | None:
    """One line naming ``reward.reward`` and the fix when the reward cannot be used, else None.

    Args:
        config: the run's ``reward`` section (its limits apply to the trial call).
        response: a response to score (the pre-flight passes the example's own gold answer).
        gold: the reference answer of a real prompt of the run.
    """
    spec = config.reward
    try:
        resolve_reward(spec)  # import, attribute, two positional parameters
    except RewardSpecError as exc:
        return f"reward.reward: {exc}"
    if spec in BUILTIN_REWARDS:
        return None
    try:
        with RewardPool(replace(config, num_workers=1, self_check=False)) as pool:
            status, detail = pool.trial(response, gold)
    except (RewardSpecError, RuntimeError) as exc:  # the worker could not import or start it
        return f"reward.reward={spec!r}: {' '.join(str(exc).split())}"
    if status not in _REFUSED:
        return None
    why = f": {' '.join(detail.split())[:300]}" if detail else ""
    return (
        f"reward.reward={spec!r} gave {_REFUSED[status]} on a real prompt (response "
        f"{response[:60]!r}, gold {gold[:60]!r}){why}; it must return a finite float for any "
        "(response, gold) strings"
    )
