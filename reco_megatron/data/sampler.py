"""Deterministic, resumable prompt sampling: shuffled epochs, B prompts per step.

Epoch ``e`` visits the dataset in the order ``numpy.random.default_rng([seed, e])
.permutation(n)``. Batches run across epoch boundaries (the last batch of an epoch is
completed from the next one), so every step has exactly ``batch_size`` prompts. The state
``{"seed", "epoch", "position", "num_items"}`` is all there is: restoring it with
:meth:`PromptSampler.load_state_dict` continues with exactly the batches the original
would have produced.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np


class PromptSampler:
    """Iterator of index batches ``list[int]`` (length ``batch_size``) over ``num_items``."""

    def __init__(self, num_items: int, batch_size: int, *, seed: int = 0) -> None:
        if num_items < 1 or batch_size < 1:
            raise ValueError(
                f"PromptSampler needs num_items >= 1 and batch_size >= 1, got "
                f"num_items={num_items}, batch_size={batch_size}"
            )
        self.num_items = int(num_items)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0
        self._order: np.ndarray | None = None

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            rng = np.random.default_rng([self.seed, self.epoch])
            self._order = rng.permutation(self.num_items)
        return self._order

    def next_batch(self) -> list[int]:
        """The next ``batch_size`` dataset indices."""
        batch: list[int] = []
        while len(batch) < self.batch_size:
            order = self._epoch_order()
            take = min(self.batch_size - len(batch), self.num_items - self.position)
            batch.extend(int(i) for i in order[self.position : self.position + take])
            self.position += take
            if self.position == self.num_items:
                self.epoch, self.position, self._order = self.epoch + 1, 0, None
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        return self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """``{"seed", "epoch", "position", "num_items"}``: plain ints, JSON-friendly."""
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "num_items": self.num_items,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; refuses a state from a dataset of another size."""
        missing = {"seed", "epoch", "position", "num_items"} - set(state)
        if missing:
            raise ValueError(f"sampler state {state!r} lacks {sorted(missing)}")
        if int(state["num_items"]) != self.num_items:
            raise ValueError(
                f"sampler state was saved for {state['num_items']} prompts but the dataset has "
                f"{self.num_items}: resume with the same dataset (and the same on_bad_row)"
            )
        position = int(state["position"])
        if not 0 <= position < self.num_items or int(state["epoch"]) < 0:
            raise ValueError(
                f"sampler state {state!r} has epoch/position out of range for "
                f"{self.num_items} prompts"
            )
        self.seed, self.epoch, self.position = int(state["seed"]), int(state["epoch"]), position
        self._order = None
