"""Our own check of a weight stream, independent of what the engine reports.

vLLM's ``load_weights`` returns the names of the *vLLM* parameters it touched, and it counts a
fused parameter (``qkv_proj``, ``gate_up_proj``) as loaded as soon as one of its shards
(``q_proj``, ``k_proj``, ``v_proj`` / ``gate_proj``, ``up_proj``) arrived: a stream missing
``k_proj`` passes vLLM's report and that slice keeps its dummy values. So the rollout layer
checks the stream itself, per Hugging Face tensor, against the names and shapes the trainer's
converter must emit for this model (``reco_megatron.megatron.hf.convert.hf_shapes``, computed
on the trainer side: this layer never imports megatron).

:class:`WeightStreamCheck` sits between the producer and the engine: it passes on each expected
tensor the first time it arrives with the expected shape, holds back unknown names, repeats
and wrong shapes (the engine never sees them), and reports everything at the end. The stream is
collective (TP all-gathers, PP broadcasts), so the caller drains it before raising
(:func:`drain`): a rank that stopped reading mid-stream would hang the others.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

ExpectedShapes = Mapping[str, Sequence[int]]
"""Hugging Face tensor name -> full (unsharded) shape, one entry per tensor the stream must
carry exactly once."""


class WeightStreamError(ValueError):
    """The weight stream does not carry exactly the expected tensors with their shapes."""


class WeightStreamCheck:
    """Pass-through check of one ``(hf_name, tensor)`` stream against ``expected``."""

    def __init__(self, expected: ExpectedShapes) -> None:
        if not expected:
            raise ValueError("expected weights must name at least one tensor")
        self.expected = {name: tuple(int(d) for d in shape) for name, shape in expected.items()}
        self.seen: set[str] = set()
        self.unknown: list[str] = []
        self.duplicate: list[str] = []
        self.bad_shape: list[str] = []

    def filter(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the tensors that are expected, first seen and of the right shape; record the
        rest (never raises itself, so the producer's collectives always complete)."""
        for name, tensor in named_tensors:
            shape = self.expected.get(name)
            if shape is None:
                self.unknown.append(name)
                continue
            if name in self.seen:
                self.duplicate.append(name)
                continue
            self.seen.add(name)
            if tuple(tensor.shape) != shape:
                self.bad_shape.append(f"{name}: got {list(tensor.shape)}, expected {list(shape)}")
                continue
            yield name, tensor

    @property
    def missing(self) -> list[str]:
        """Expected names that never arrived (meaningful once the stream is exhausted)."""
        return [name for name in self.expected if name not in self.seen]

    def problems(self) -> list[str]:
        """One line per kind of problem found so far (empty when the stream was exact)."""
        out = []
        if self.unknown:
            hints = {
                u: difflib.get_close_matches(u, list(self.expected), n=1) for u in self.unknown[:5]
            }
            out.append(
                f"{len(self.unknown)} tensor(s) this model does not have: {self.unknown[:5]!r} "
                f"(closest expected names: {hints!r})"
            )
        if self.bad_shape:
            out.append(f"{len(self.bad_shape)} wrong shape(s): {self.bad_shape[:5]!r}")
        if self.duplicate:
            out.append(f"{len(self.duplicate)} tensor(s) sent twice: {self.duplicate[:5]!r}")
        missing = self.missing
        if missing:
            out.append(f"{len(missing)} expected tensor(s) never arrived: {missing[:5]!r}")
        return out

    def error(self) -> WeightStreamError | None:
        """The error to raise, or None when every expected tensor arrived once, well shaped."""
        problems = self.problems()
        if not problems:
            return None
        return WeightStreamError(
            "weight stream check (ours, per Hugging Face tensor, before the engine's report): "
            + "; ".join(problems)
            + ". The converter and the rollout model disagree (see docs/weights.md); the "
            "engine refuses to generate until a complete update succeeds."
        )


def drain(stream: Iterator[object]) -> int:
    """Consume what is left of ``stream`` (a collective producer must run to its end);
    returns how many items were left."""
    left = 0
    for _ in stream:
        left += 1
    return left
