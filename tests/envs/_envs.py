"""Environments for the tests (imported by spec in the isolated workers)."""

from __future__ import annotations

import os
import time

from reco_megatron.envs import Env, Step

OBS = [7, 8, 9]


class Echo(Env):
    """Three turns: the observation is ``OBS`` then turn-numbered; reward 1 per turn."""

    stop_ids = (5,)

    def reset(self, row):
        self.turn = 0
        return list(row["prompt_ids"])

    def step(self, action_ids, finish):
        self.turn += 1
        return Step([*OBS, 10 + self.turn], done=self.turn >= 3, reward=1.0, stop_ids=(6,))


class Endless(Env):
    """Never done: the runner's max_turns and token budget end the episodes."""

    def step(self, action_ids, finish):
        return Step(OBS, done=False)


class OneTurn(Env):
    """Done after the first action: a single-turn episode."""

    def step(self, action_ids, finish):
        return Step((), done=True)


class Faulty(Env):
    """By prompt: ``[1, ...]`` raises, ``[2, ...]`` hangs, ``[3, ...]`` returns garbage,
    ``[4, ...]`` kills its worker; others behave like :class:`Echo`."""

    def reset(self, row):
        self.kind = row["prompt_ids"][0]
        self.turn = 0
        return list(row["prompt_ids"])

    def step(self, action_ids, finish):
        self.turn += 1
        if self.kind == 1 and self.turn == 2:
            raise RuntimeError("the tool broke")
        if self.kind == 2:
            time.sleep(3600)
        if self.kind == 3:
            return Step(["not", "ids"], done=False)
        if self.kind == 4:
            os._exit(9)
        return Step(OBS, done=self.turn >= 3, reward=1.0)


class Sleepy(Env):
    """Each step sleeps ``row["answer"]`` seconds (for the overlap test)."""

    def reset(self, row):
        self.delay = float(row["answer"])
        return list(row["prompt_ids"])

    def step(self, action_ids, finish):
        time.sleep(self.delay)
        return Step(OBS, done=False)


class Recorder(Env):
    """Short actions (a quarter of the tiny vocabulary ends one), three turns with per-turn
    rewards; every call appended as a JSON line to ``$RECO_TEST_EPISODE_LOG`` (when set), so
    two runs can be compared action for action."""

    stop_ids = tuple(range(3, 128, 4))

    def reset(self, row):
        self.prompt = list(row["prompt_ids"])
        self.turn = 0
        self._log({"reset": self.prompt, "answer": row["answer"]})
        return self.prompt

    def step(self, action_ids, finish):
        self.turn += 1
        self._log({"prompt": self.prompt, "turn": self.turn, "action": list(action_ids),
                   "finish": finish})  # fmt: skip
        return Step([*OBS, 10 + self.turn], done=self.turn >= 3, reward=0.25 * self.turn)

    @staticmethod
    def _log(record: dict) -> None:
        path = os.environ.get("RECO_TEST_EPISODE_LOG")
        if path:
            import json

            with open(path, "a") as f:  # one short line per write: appends do not interleave
                f.write(json.dumps(record) + "\n")
