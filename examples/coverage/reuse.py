"""Reuse the evaluations of an earlier run of the coverage experiment, with proof.

An evaluation costs minutes of CPU per checkpoint. When the code path of a method has not
changed since an earlier run (same base, same task, same protocol), its runs would reproduce
that run bit for bit, and so would their evaluations. ``--reuse FILE`` takes that run's raw
JSON (``docs/results/coverage_passk.json`` or ``<out>/eval/passk.json``), and for the methods
of ``--reuse-methods`` (``OLD=NEW`` renames a method, e.g. ``reco=reco_plain``) on the seeds of
``--reuse-seeds``: writes their evaluation parts into ``<out>`` (so they are not evaluated
again) and skips their RL runs (no checkpoint is needed). Every *other* seed of a reused
method that the earlier run also has is trained and evaluated afresh, and must equal the
earlier evaluation exactly (every per-problem count); otherwise the report is not written
(:func:`check_reproduced`). ``<out>/eval/reused.json`` records what was reused and the proof.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from reco_megatron.eval import report

# protocol fields that must agree (the data path and the checkpoint path may differ)
SAME_PROTOCOL = ("n", "kmax", "temperature", "top_p", "max_new_tokens", "seed", "reward")


def parse_methods(items: Sequence[str], methods: Iterable[str]) -> dict[str, str]:
    """``["grpo", "reco=reco_plain"]`` -> ``{"grpo": "grpo", "reco": "reco_plain"}`` (earlier
    label -> method of this run); every new name must be one of ``methods``."""
    mapping: dict[str, str] = {}
    known = set(methods)
    for item in items:
        old, _, new = item.partition("=")
        new = new or old
        if not old or new not in known:
            raise SystemExit(
                f"--reuse-methods {item!r}: give METHOD or OLD=METHOD with METHOD one of "
                f"{sorted(known)}"
            )
        mapping[old] = new
    return mapping


def _protocol(entry: Mapping[str, Any]) -> dict[str, Any]:
    value = entry["protocol"]
    return ast.literal_eval(value) if isinstance(value, str) else dict(value)


def _index(src: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """The earlier run's entries by ``(label, rl_step)``."""
    entries = report.read_json(src)
    return {(e["label"], int(e["rl_step"])): e for e in entries}


def seed_parts(
    src: Path,
    mapping: Mapping[str, str],
    seeds: Sequence[int],
    budgets: Sequence[int],
    parts: Path,
    protocol: Mapping[str, Any],
) -> set[tuple[str, int]]:
    """Write the earlier evaluations of ``mapping`` x ``seeds`` x ``budgets`` as evaluation
    parts under ``parts`` (``<label>-step_<budget>/passk.json``, the layout of ``run.py``);
    returns the ``(method, seed)`` pairs whose RL runs are therefore not needed. Every
    requested entry must exist and have the same protocol, else ``SystemExit``."""
    index = _index(src)
    reused: set[tuple[str, int]] = set()
    for old, new in mapping.items():
        for seed in seeds:
            for budget in budgets:
                entry = index.get((f"{old}/s{seed}", budget))
                if entry is None:
                    raise SystemExit(
                        f"--reuse {src} has no evaluation of {old}/s{seed} at step {budget}: "
                        "reuse only seeds and budgets the earlier run evaluated"
                    )
                got = {k: _protocol(entry).get(k) for k in SAME_PROTOCOL}
                want = {k: protocol.get(k) for k in SAME_PROTOCOL}
                if got != want:
                    raise SystemExit(
                        f"--reuse {src}: {old}/s{seed} was evaluated with {got}, this run "
                        f"evaluates with {want}: the evaluations are not comparable"
                    )
                part = parts / f"{new}-s{seed}-step_{budget:08d}"
                if not (part / "passk.json").exists():
                    copy = {**entry, "label": f"{new}/s{seed}", "reused_from": str(src)}
                    copy.pop("rl_step", None)
                    report.write_json(part / "passk.json", [copy])
            reused.add((new, seed))
    return reused


def check_reproduced(
    src: Path,
    mapping: Mapping[str, str],
    fresh: Iterable[Mapping[str, Any]],
    reused: set[tuple[str, int]],
    record: Path,
) -> str:
    """Compare every fresh evaluation of a reused method (a seed that was trained here) with
    the earlier run's: the per-problem counts must be identical. Writes ``record`` (the
    reused pairs and the comparisons) and returns one sentence for the report; raises
    ``SystemExit`` on a mismatch or when nothing could be compared (no proof)."""
    index = _index(src)
    back = {new: old for old, new in mapping.items()}
    compared, mismatched = [], []
    for entry in fresh:
        method, _, seed = entry["label"].rpartition("/s")
        if method not in back or (method, int(seed)) in reused:
            continue
        old = index.get((f"{back[method]}/s{seed}", int(entry["rl_step"])))
        if old is None:
            continue
        name = f"{entry['label']}@{entry['rl_step']}"
        (compared if old["problems"] == entry["problems"] else mismatched).append(name)
    record.write_text(
        json.dumps(
            {
                "source": str(src),
                "methods": dict(mapping),
                "reused": sorted(f"{m}/s{s}" for m, s in reused),
                "reproduced_exactly": compared,
                "mismatched": mismatched,
            },
            indent=1,
        )
        + "\n"
    )
    if mismatched:
        raise SystemExit(
            f"--reuse {src}: the fresh evaluations {mismatched} differ from the earlier run's, "
            f"so its other evaluations cannot stand in for this code; delete the reused parts "
            f"(listed in {record}) and rerun without --reuse"
        )
    if not compared:
        raise SystemExit(
            f"--reuse {src}: no seed of {sorted(mapping.values())} was both trained here and "
            "evaluated there, so nothing proves the reuse: train one such seed here"
        )
    return (
        f"{len(reused)} runs ({', '.join(sorted(f'{m}/s{s}' for m, s in reused))}) were not "
        f"retrained: their evaluations come from `{src.name}` (an earlier run of the same "
        f"protocol), after {', '.join(compared)} reproduced that run's per-problem counts "
        "exactly."
    )
