"""The ``calculator`` environment: countdown with a calculator tool call.

The policy writes ``<expression=`` anywhere in its response; the action ends on the ``=``
token (the environment's stop id), and the environment returns the expression's value and a
closing bracket as tokens (``12>``), appended after the action. An action that does not end
in a call (the answer, an end-of-sequence token, the budget) ends the episode; the reward
function (``reward.reward=countdown``) scores the whole episode's text. A call the
calculator cannot read returns ``error>`` (a tool error the policy sees, not a failure of the
environment). Expressions are parsed by the safe parser of :mod:`reco_megatron.data.arith`
(``+ - *`` and parentheses, never ``eval``). Pair it with ``data.countdown.style:
calculator``, whose warm-up teaches the calls: ``examples/calculator_cpu.yaml``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from reco_megatron.data.arith import ArithmeticParseError, parse_arithmetic
from reco_megatron.envs.contract import Env, Step

MAX_EXPRESSION_CHARS = 64
"""Longer calls are answered ``error>`` (values stay small; no work grows with the input)."""


class CalculatorEnv(Env):
    """Evaluate ``<expression=`` calls (see the module doc)."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        if tokenizer is None:
            raise ValueError("the calculator environment needs the run's tokenizer")
        equals = tokenizer.encode("=")
        if len(equals) != 1:
            raise ValueError(f"the tokenizer writes '=' as {equals}, not one token")
        self.stop_ids = (equals[0],)

    def step(self, action_ids: Sequence[int], finish: str) -> Step:
        text = self.tokenizer.decode(list(action_ids))
        if finish != "stop" or not text.endswith("=") or "<" not in text:
            return Step((), done=True)
        expression = text[text.rindex("<") + 1 : -1]
        value = "error"
        if len(expression) <= MAX_EXPRESSION_CHARS:
            with contextlib.suppress(ArithmeticParseError):
                value = str(parse_arithmetic(expression).value)
        return Step(self.tokenizer.encode(f"{value}>"), done=False)
