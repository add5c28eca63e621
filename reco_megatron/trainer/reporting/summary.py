"""The end-of-run summary: what changed, where the time went, where the outputs are, what to
run next. Rank 0 writes it to the log when a run ends normally; :func:`summary_lines` is the
text, from the run directory and the phase times of this process."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from reco_megatron.trainer.reporting.progress import format_seconds

WINDOW = 10
"""Steps averaged at each end of the run ("first 10 vs last 10")."""

HEADLINE: tuple[tuple[str, str], ...] = (
    ("reward_mean", "mean reward of the training groups"),
    ("unique_frac", "share of distinct responses per group"),
)
"""The metrics compared between the first and the last steps, with what they mean."""

RL_PARTS: tuple[tuple[str, str], ...] = (
    ("time_rollout", "rollout"),
    ("time_reward", "reward"),
    ("time_old_logprob", "old log-probs"),
    ("time_train", "updates"),
    ("time_sync", "weight sync"),
)


def process_seconds() -> float | None:
    """Wall seconds since this process started (None where psutil cannot tell)."""
    try:
        import time

        import psutil

        return time.time() - psutil.Process().create_time()
    except Exception:  # psutil missing or no process table: the summary leaves it out
        return None


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _mean(rows: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), int | float)]
    return sum(values) / len(values) if values else None


def _span(rows: Sequence[Mapping[str, Any]]) -> str:
    return f"steps {rows[0]['step']}-{rows[-1]['step']}" if rows else ""


def summary_lines(
    out: Path, phases: Mapping[str, float], *, first_step: int = 0, total_s: float | None = None
) -> list[str]:
    """The summary of the run in ``out``.

    ``phases``: seconds of this process per phase (``startup``, ``sft``, ``rl``);
    ``first_step``: the step this process started from (a resumed run's time covers only the
    steps after it); ``total_s``: the process's wall time.
    """
    rows = _rows(out / "metrics.jsonl")
    lines = [f"run summary ({out}):"]
    if rows:
        n = min(WINDOW, max(1, len(rows) // 2))
        first, last = rows[:n], rows[-n:]
        for key, meaning in HEADLINE:
            a, b = _mean(first, key), _mean(last, key)
            if a is None or b is None:
                continue
            lines.append(
                f"  {key:<12} {a:.3f} ({_span(first)}) -> {b:.3f} ({_span(last)}): {meaning}"
            )
    times = []
    for name, label in (("startup", "start-up"), ("sft", "SFT warm-up"), ("rl", "RL")):
        if phases.get(name):
            times.append(f"{label} {format_seconds(phases[name])}")
    mine = [r for r in rows if isinstance(r.get("step"), int) and r["step"] > first_step]
    sums = {label: sum(r.get(key) or 0.0 for r in mine) for key, label in RL_PARTS}
    parts = [f"{label} {format_seconds(sec)}" for label, sec in sums.items() if sec > 0]
    if times:
        rl = f" ({len(mine)} steps: {', '.join(parts)})" if parts and phases.get("rl") else ""
        whole = f"; {format_seconds(total_s)} in all" if total_s else ""
        lines.append(f"  time         {', '.join(times)}{rl}{whole}")
    outputs = [
        name
        for name in ("metrics.jsonl", "eval.jsonl", "training_curves.png", "config.yaml")
        if (out / name).exists()
    ]
    ckpts = sorted((out / "checkpoints").glob("step_*"))
    if ckpts:
        outputs.append(f"checkpoints/{ckpts[-1].name} (latest)")
    lines.append(f"  outputs      {out}/: {', '.join(outputs)}")
    evaluate, export = command("reco-eval"), command("reco-export")
    lines.append(f"  next         {evaluate} {out}                  # pass@k on the held-out set")
    lines.append(f"               {export} {out}/checkpoints hf/{out.name}   # Hugging Face")
    base = out / "checkpoints" / "step_00000000"
    if base.is_dir():
        lines.append(
            f"               {evaluate} base={base} trained={out} --out {out}/reco-eval-vs-base"
            "   # start vs trained, one plot"
        )
    return lines


def command(script: str) -> str:
    """How to call the console ``script`` with this run's environment: the script beside the
    interpreter that runs now (``.venv/bin/reco-eval``, relative to the working directory when
    under it), or the bare name when that interpreter has none (a plain PATH install)."""
    path = Path(sys.executable).parent / script
    if not path.is_file():
        return script
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
