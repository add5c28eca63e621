"""A reward with signal for an untrained model: the share of digits in the response.

The tiny countdown model earns no countdown reward before its SFT warm-up, so every group's
advantages are 0 and an RL step changes nothing; the layout rehearsals
(``test_example_layouts.py``) skip the warm-up and score with this instead, so their steps
move the weights."""

from __future__ import annotations


def digit_share(response: str, gold: str) -> float:
    """Share of the response's characters that are digits (0 for an empty response)."""
    return sum(c.isdigit() for c in response) / len(response) if response else 0.0
