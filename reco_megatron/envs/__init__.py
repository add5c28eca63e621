"""Multi-turn, tool-using episodes: the environment contract and the episode runner.

An environment (:class:`Env`: ``reset(row) -> prompt ids``, ``step(action_ids, finish) ->
Step``) is named in the config as ``rollout.env`` (a built-in name, ``module:Class`` or
``file.py:Class``); every episode's environment runs in an isolated worker of an
:class:`EnvPool` (time limit per call, failures counted, the episode scored 0), and
:func:`run_episodes` drives any rollout engine turn by turn, token ids in and out, returning
whole episodes with their loss masks (observations 0); an :class:`EpisodeService` holds a
process's pool and runs the groups asked of it (the colocated trainer and a separate rollout
worker alike). See ``docs/howto.md``.
"""

from reco_megatron.envs.contract import Env, Step, StepError
from reco_megatron.envs.episodes import EpisodeResult, run_episodes
from reco_megatron.envs.pool import FAILURES, EnvPool, Outcome
from reco_megatron.envs.registry import BUILTIN_ENVS, EnvSpecError, resolve_env
from reco_megatron.envs.service import EnvSettings, EpisodeService, group_records

__all__ = [
    "BUILTIN_ENVS",
    "FAILURES",
    "Env",
    "EnvPool",
    "EnvSettings",
    "EnvSpecError",
    "EpisodeResult",
    "EpisodeService",
    "Outcome",
    "Step",
    "StepError",
    "group_records",
    "resolve_env",
    "run_episodes",
]
