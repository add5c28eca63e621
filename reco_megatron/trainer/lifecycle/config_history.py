"""What a resume changes: the new resolved config against the one that trained the checkpoint.

Every checkpoint carries the resolved config of the run segment that wrote it and the content
hashes of its inputs (``trainer_state["config"]`` / ``["inputs"]`` in ``meta.json``, plain
JSON). A resume diffs the new config against it, key by key:

* keys in :data:`SAFE_ON_RESUME` (learning rate and schedule, ``max_steps``, intervals,
  guards, logging, evaluation, workers, parallel layout, ...) are applied, one line each;
* every other key changes what is being trained (model, tokenizer, data files *by content*,
  seed, group size, objective, reward, ...): the start is refused (exit 2) listing them,
  unless ``trainer.allow_config_change=true`` (then each is logged as accepted).

Each start appends one record to ``<output_dir>/config_history.jsonl``: the step it starts
from, the checkpoint, host and Slurm job, the changes and the full config, so every step
range is described by the config that trained it (``config.yaml`` is the newest one).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reco_megatron.config import ConfigError
from reco_megatron.config.dump import config_to_dict
from reco_megatron.trainer.config import TrainConfig
from reco_megatron.utils.logging import get_logger

__all__ = [
    "CONFIG_HEADER",
    "HISTORY",
    "SAFE_ON_RESUME",
    "ConfigDiff",
    "ResumeCheck",
    "diff_configs",
    "input_hashes",
    "is_safe",
    "record_start",
]

logger = get_logger(__name__)

HISTORY = "config_history.jsonl"
SAFE_ON_RESUME: tuple[str, ...] = (
    "optimizer.lr",
    "optimizer.min_lr",
    "optimizer.lr_warmup_steps",
    "optimizer.lr_decay_style",
    "optimizer.lr_decay_steps",
    "optimizer.weight_decay",
    "optimizer.clip_grad",
    "trainer.max_steps",
    "trainer.output_dir",
    "trainer.log_interval",
    "trainer.tensorboard",  # a key of older configs (trainer.loggers replaced it)
    "data.dataset.max_prompt_len",  # of older configs: rollout.max_prompt_len, diffed, sets it
    "trainer.progress",
    "trainer.loggers",
    "trainer.project",
    "trainer.allow_config_change",
    "trainer.allow_out_of_range",
    "checkpoint.",
    "stability.",
    "eval.",
    "parallel.",
    "data.eval_path",
    "reward.num_workers",
    "reward.timeout_s",
    "reward.grader_timeout_s",
    "reward.memory_limit_mb",
    "reward.start_timeout_s",
    "reward.self_check",
    "reward.max_failed_frac",
    "rollout.engine",
    "rollout.placement",
    "rollout.max_staleness",
    "rollout.num_workers",
    "rollout.worker_launch",
    "rollout.worker_gpus",
    "rollout.worker_timeout_s",
    "rollout.generate_timeout_s",
    "rollout.worker_failure",
    "rollout.weight_bucket_mb",
    "rollout.gpu_memory_utilization",
    "rollout.max_batch_size",
    "update.stats_implementation",
    "update.fused_output_layer",
    "update.max_tokens_per_microbatch",
    "update.microbatch_length_multiple",
    "update.balance_data_parallel",
    "update.sequence_packing",
    "model.attention_backend",
)
"""Dotted keys (or prefixes ending in ``.``) that may change on resume: how the run is
scheduled, watched, logged, parallelised and scored for failures, not what it trains on or
towards. ``parallel.*`` layouts that cannot load the checkpoint are refused by the loader."""

ADDED_KEYS: dict[str, Any] = {
    "rollout.placement": "colocated",
    "rollout.num_workers": 1,
    "rollout.worker_launch": "spawn",
    "rollout.worker_timeout_s": 300.0,
    "rollout.worker_failure": "stop",
    "rollout.weight_bucket_mb": 256,
    "loss.response_weight_policy": "auto",
    "model.attention_backend": "auto",
}
"""Keys later versions added, each with the value that does what versions before it did: a
checkpoint's config without the key is no change at that value (neutral values -- None,
empty, False -- need no entry)."""

_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


def is_safe(key: str) -> bool:
    """Whether ``key`` (dotted) may change on resume."""
    return any(key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE_ON_RESUME)


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


@dataclass
class ConfigDiff:
    """Changes from the checkpoint's config to this run's, each ``(key, old, new)``."""

    safe: list[tuple[str, Any, Any]] = field(default_factory=list)
    trained: list[tuple[str, Any, Any]] = field(default_factory=list)

    def changes(self) -> dict[str, list[Any]]:
        return {k: [old, new] for k, old, new in (*self.safe, *self.trained)}


def diff_configs(
    saved: dict[str, Any], current: dict[str, Any], saved_inputs: dict, inputs: dict
) -> ConfigDiff:
    """Key-by-key diff of two plain configs plus their input hashes (``inputs.<key>``).
    A key present on one side only (a version added or removed it) counts only when its
    value differs from nothing, i.e. it is reported as ``None -> value``."""
    old, new = _flatten(saved), _flatten(current)
    diff = ConfigDiff()
    for key in sorted(set(old) | set(new)):
        if key in old and key in new and old[key] == new[key]:
            continue
        if key not in old and key in new and new[key] in (None, "", [], False):
            continue  # a key this version added, at a neutral value
        if key not in old and key in ADDED_KEYS and new[key] == ADDED_KEYS[key]:
            continue  # a key this version added, at the value older versions behaved as
        if key in old and key not in new and old[key] in (None, "", [], False):
            continue  # a key this version removed, which was at a neutral value
        entry = (key, old.get(key), new.get(key))
        (diff.safe if is_safe(key) else diff.trained).append(entry)
    for key in sorted(set(saved_inputs) & set(inputs)):
        if saved_inputs[key] != inputs[key]:
            diff.trained.append((f"{key} (content)", saved_inputs[key], inputs[key]))
    return diff


def check_resume(
    cfg: TrainConfig,
    saved_state: dict[str, Any],
    inputs: dict[str, str],
    checkpoint: str,
    current: dict[str, Any] | None = None,
) -> ConfigDiff:
    """Diff ``cfg`` (or its plain form ``current``, taken before the trainer adjusted
    anything) against the config saved in a checkpoint's trainer state; log the safe
    changes (one line each); raise :class:`ConfigError` listing the changes of what is
    trained, unless ``cfg.trainer.allow_config_change``. A checkpoint without a saved config
    (written before this check existed) is diffed against nothing: one line says so."""
    saved = saved_state.get("config")
    if not isinstance(saved, dict):
        logger.warning(
            "%s holds no config (written by an older version): resuming without checking what "
            "changed",
            checkpoint,
        )
        return ConfigDiff()
    current = current if current is not None else config_to_dict(cfg)
    diff = diff_configs(saved, current, saved_state.get("inputs") or {}, inputs)
    for key, old, new in diff.safe:
        logger.info("resume: %s %s -> %s (applied from here on)", key, _show(old), _show(new))
    if diff.trained and not cfg.trainer.allow_config_change:
        lines = "\n".join(f"    {k}: {_show(o)} -> {_show(n)}" for k, o, n in diff.trained)
        raise ConfigError(
            [
                f"resuming from {checkpoint} with a config that changes what is being trained "
                f"(the checkpoint's value -> this run's):\n{lines}\n  Undo these changes, start "
                "a new run with another trainer.output_dir, or set "
                "trainer.allow_config_change=true to continue this run with them (recorded in "
                f"{HISTORY})"
            ]
        )
    for key, old, new in diff.trained:
        logger.warning(
            "resume: %s %s -> %s changes what is trained (accepted: "
            "trainer.allow_config_change=true)",
            key,
            _show(old),
            _show(new),
        )
    return diff


def _show(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def file_digest(path: Path) -> str:
    """``sha256:<hex>`` of a file, or of a directory's files (names and contents, weight
    files excluded: a Hugging Face tokenizer may live beside the model)."""
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for p in files:
        if path.is_dir():
            if p.suffix in _WEIGHT_FILES:
                continue
            h.update(p.relative_to(path).as_posix().encode() + b"\0")
        with open(p, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return f"sha256:{h.hexdigest()}"


def input_hashes(cfg: TrainConfig, out: Path) -> dict[str, str]:
    """Content hashes of what the run trains on: the prompt file (``data.train_path``, or
    the countdown file generated under ``<output_dir>/data``) and the tokenizer."""
    hashes: dict[str, str] = {}
    train = Path(cfg.data.train_path) if cfg.data.train_path else out / "data" / "train.jsonl"
    if train.exists():
        hashes["data.train_path"] = file_digest(train)
    tokenizer = Path(cfg.data.tokenizer)
    if tokenizer.exists():
        hashes["data.tokenizer"] = file_digest(tokenizer)
    return hashes


def record_start(
    out: Path,
    plain: dict[str, Any],
    *,
    step: int,
    checkpoint: str | None,
    inputs: dict[str, str],
    diff: ConfigDiff | None,
) -> None:
    """Append this start to ``<out>/config_history.jsonl`` (rank 0)."""
    record = {
        "from_step": step,
        "checkpoint": checkpoint,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": socket.gethostname(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID", ""),
        "changes": diff.changes() if diff is not None else {},
        "inputs": inputs,
        "config": plain,
    }
    with open(out / HISTORY, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


CONFIG_HEADER = (
    "The resolved config of the newest start of this run; config_history.jsonl has the config "
    "of every start (each step range is described by the config that trained it)."
)


class ResumeCheck:
    """The config check of one start (collective: rank 0 reads and hashes, every rank gets
    the verdict): before anything is built, against the checkpoint ``latest`` names; again
    after the load when a fallback loaded another one; then :meth:`record` (rank 0)."""

    def __init__(self, cfg: TrainConfig, plain: dict[str, Any], out: Path, rank: int) -> None:
        self.cfg, self.plain, self.out, self.rank = cfg, plain, out, rank
        self.inputs: dict[str, str] = input_hashes(cfg, out) if rank == 0 else {}
        self.checked: str | None = None
        self.diff: ConfigDiff | None = None
        if cfg.checkpoint.resume:
            self._check(*self._latest_state())

    def _latest_state(self) -> tuple[str | None, dict[str, Any] | None]:
        """Name and trainer state of the checkpoint ``latest`` names (rank 0; plain JSON),
        or ``(None, None)`` when there is none or it cannot be read (the resume says why)."""
        from reco_megatron.trainer.lifecycle.run_dir import latest_trainer_state

        if self.rank != 0:
            return None, None
        return latest_trainer_state(self.out / "checkpoints")

    def _check(self, name: str | None, state: dict[str, Any] | None) -> None:
        from reco_megatron.parallel.collectives import from_rank0

        verdict: tuple[str, Any] | None = None
        if self.rank == 0 and name is not None and state is not None:
            try:
                verdict = ("ok", check_resume(self.cfg, state, self.inputs, name, self.plain))
            except ConfigError as exc:
                verdict = ("refused", exc.problems)
        verdict = from_rank0(verdict)
        self.checked = from_rank0(name)
        if verdict is None:
            return
        if verdict[0] == "refused":
            raise ConfigError(verdict[1])
        self.diff = verdict[1]

    def check_loaded(self, name: str, state: dict[str, Any]) -> None:
        """After the load: diff again when it was not the checkpoint checked before."""
        if name != self.checked:
            self._check(name, state if self.rank == 0 else None)

    def record(self, step: int, checkpoint: str | None) -> None:
        """Append this start to the history (rank 0; the inputs are hashed again now that a
        generated prompt file exists)."""
        if "data.train_path" not in self.inputs:
            self.inputs = input_hashes(self.cfg, self.out)
        record_start(
            self.out,
            self.plain,
            step=step,
            checkpoint=checkpoint,
            inputs=self.inputs,
            diff=self.diff,
        )
