"""A CPU version of megatron's model-parallel RNG states tracker.

Megatron draws dropout inside tensor-parallel regions under ``get_cuda_rng_tracker().fork()``
(a named generator state that differs across TP ranks) and outside them from the default
generator (the same across TP ranks). Its ``CudaRNGStatesTracker`` stores CUDA generator
states, so it cannot exist without CUDA. :class:`CpuRNGStatesTracker` keeps the same named
states as snapshots of torch's *CPU* default generator and swaps them in and out on ``fork``,
so dropout > 0 works on CPU and is reproducible for a fixed seed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from megatron.core.tensor_parallel import random as mrandom

_DEFAULT = "default-rng"


class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
    """Named RNG states on torch's CPU generator, with megatron's tracker interface.

    Subclasses ``CudaRNGStatesTracker`` so megatron's ``isinstance`` checks (e.g.
    ``get_all_rng_states`` for checkpointing) treat it as the ordinary tracker; ``add`` and
    ``fork`` are reimplemented on ``torch.get_rng_state`` / ``torch.set_rng_state``.
    """

    def __init__(self) -> None:
        super().__init__(use_cudagraphable_rng=False)

    def add(self, name: str, seed: int) -> None:
        """Create the state ``name`` seeded with ``seed`` without disturbing the current one."""
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} already used by another tracked state")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists")
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Draw from state ``name`` inside the block, then restore the state used before."""
        if name not in self.states_:
            raise KeyError(
                f"RNG state {name!r} was never added; call "
                "reco_megatron.megatron.compat.cpu_backend.model_parallel_seed(seed) after "
                "initialize_model_parallel"
            )
        outer_name = self._current_state_name
        outer_state = torch.get_rng_state()
        if outer_name != _DEFAULT:
            self.states_[outer_name] = outer_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if outer_name != _DEFAULT:
                outer_state = self.states_[outer_name]
            torch.set_rng_state(outer_state)
            self._current_state_name = outer_name


def install_cpu_rng_tracker() -> CpuRNGStatesTracker:
    """Make a :class:`CpuRNGStatesTracker` megatron's global tracker (kept if already there).

    It is marked initialised, so ``get_cuda_rng_tracker()`` returns it instead of building a
    CUDA tracker, and (0.19) ``tracker.is_initialized()`` answers once seeds are added.
    """
    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    if not isinstance(tracker, CpuRNGStatesTracker):
        tracker = CpuRNGStatesTracker()
        mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    return tracker
