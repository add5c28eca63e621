"""Sanity ranges for values where a typo destroys a run instead of failing it.

``optimizer.lr=1e9`` is a valid float and Adam takes it: the model is destroyed in one step
and the run goes on to exit 0. ``reward.num_workers=2000`` starts two thousand interpreters.
The config validation refuses values outside :data:`RANGES` (exit 2, naming the key, the
range and why); a value that is really meant is accepted when its key is listed in
``trainer.allow_out_of_range`` (e.g. ``trainer.allow_out_of_range=[optimizer.lr]``).
"""

from __future__ import annotations

__all__ = ["RANGES", "check_ranges"]

RANGES: dict[str, tuple[float, float, str]] = {
    "optimizer.lr": (
        0.0,
        1e-2,
        "Adam on a pretrained LLM uses 1e-7..1e-4; above 1e-2 the weights are destroyed within "
        "a few steps",
    ),
    "sft.lr": (0.0, 1e-2, "above 1e-2 the warm-up destroys the weights it starts from"),
    "optimizer.weight_decay": (0.0, 1.0, "decoupled weight decay above 1 zeroes the weights"),
    "reward.num_workers": (
        1,
        256,
        "each worker is an interpreter with up to reward.memory_limit_mb of address space",
    ),
    "reward.timeout_s": (0.0, 3600.0, "one item scored for over an hour stalls every step"),
    "rollout.temperature": (0.0, 5.0, "sampling above 5 is uniform noise"),
    "rollout.group_size": (2, 4096, "every response of a group is generated and trained on"),
}
"""``key: (low, high, why)``: the value must lie in ``[low, high]``."""


def _get(cfg: object, key: str) -> object:
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def check_ranges(cfg: object, allowed: list[str]) -> None:
    """Raise ``ValueError`` naming every value of :data:`RANGES` outside its range, unless
    its key is in ``allowed``; an unknown key in ``allowed`` is an error too."""
    unknown = [key for key in allowed if key not in RANGES]
    if unknown:
        raise ValueError(
            f"trainer.allow_out_of_range names {unknown}, which have no range; the checked "
            f"keys are {sorted(RANGES)}"
        )
    problems = []
    for key, (low, high, why) in RANGES.items():
        value = _get(cfg, key)
        if key in allowed or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if not low <= value <= high:
            problems.append(
                f"{key}={value!r} is outside [{low:g}, {high:g}] ({why}); if you mean it, add "
                f"it to trainer.allow_out_of_range (e.g. trainer.allow_out_of_range=[{key}])"
            )
    if problems:
        raise ValueError("; ".join(problems))
