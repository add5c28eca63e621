"""The long-response coverage experiment (``run.py --style worked``): countdown in the
``worked`` style, each (method, seed) a unit whose result is a small JSON committed under
``docs/results/coverage_long/``, so the experiment continues across sessions.

A unit is one RL run from the base plus the evaluation of its last step: the per-problem
counts of ``reco-eval`` (what :mod:`analysis` computes every statistic from) and a summary of
the run's ``weight_active`` (share of responses with w < 1) and ``weight_active_tokens``
(share of response tokens with w < 1). No checkpoint is kept in the repository: a new session
rebuilds the base by the same seeded SFT (its weights' digest is in every unit, so units of
two different bases would show up in the report) and trains only the units not yet there.
Units are taken seed by seed (every method of seed 1, then of seed 2, ...), so whatever
exists is a paired comparison. The report is rendered from the units present after each one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from reco_megatron.utils.cpu_env import PORTABLE_CPU_KERNELS

METHODS_LONG: dict[str, list[str]] = {
    "grpo": ["loss.objective=ppo_clip", "loss.response_weight=none", "loss.token_ratio=importance"],
    "reco": [
        "loss.objective=reco",
        "loss.response_weight=sequence",
        "loss.token_ratio=bernoulli",
        "loss.c_trust=true",
    ],
    "reco_prefix": [
        "loss.objective=reco",
        "loss.response_weight=prefix",
        "loss.token_ratio=bernoulli",
        "loss.c_trust=true",
    ],
}
"""The methods of the long experiment: GRPO, ReCo as shipped (``sequence`` response weight),
ReCo with the per-token ``prefix`` weight; the same trust region on c for both ReCo forms."""

NOTES = {
    "grpo": "GRPO (PPO clip on r)",
    "reco": "ReCo as shipped: the `sequence` response weight 1/max(1, G pi_old(o_i|q)), "
    "Bernoulli ratio c with the trust region on c",
    "reco_prefix": "ReCo with the per-token `prefix` weight 1/max(1, G pi_old(o_{i,<=t}|q)), "
    "the same c and trust region",
}

TASK_OVERRIDES = [
    "data.countdown.style=worked",
    "reward.reward=countdown_worked",
    "rollout.max_new_tokens=96",
    "rollout.max_prompt_len=112",
    "model.max_position_embeddings=256",
]
"""What the worked style needs besides the task (docs/data-and-rewards.md): its reward, room
for its responses (at most 81 tokens with EOS) and prompts (at most 105)."""
CPU_KERNELS = {**PORTABLE_CPU_KERNELS, "MKL_CBWR": "AVX2"}
"""This experiment's CPU pins: ATen and oneDNN on AVX2 as everywhere, MKL in its AVX2
reproducibility mode instead of COMPATIBLE. COMPATIBLE was picked for the README run in the
hope that Intel and AMD then agree, which they do not (``reco_megatron/utils/cpu_env.py``), and
it makes this experiment's SFT 1.65x as slow (2.56-2.62 against 1.49-1.68 s/step, 40 steps of
the worked-style base side by side, AMD EPYC, 2026-12-02; the AVX2 mode ran as fast as no pins
at all). Either mode gives the same bits run after run on one machine; the units share a
stored base (:mod:`base_store`), so nothing here needs bits that agree across machines."""
CPU_NAME = "avx2-pinned, MKL_CBWR=AVX2"
"""The units' ``settings["cpu"]`` under :data:`CPU_KERNELS`."""
REWARD = "countdown_worked"
MAX_NEW_TOKENS = 96
WEIGHT_KEYS = ("weight_active", "weight_active_tokens", "reward_mean", "response_len_mean")
"""Training columns summarised per unit (first and last 20 steps, and all steps)."""


def digest(directory: Path) -> str:
    """sha256 (16 hex digits) of a checkpoint step's tensor files (``dist/*.distcp``: the
    weights and optimizer state; the metadata holds a run id and differs between two runs of
    the same seeded SFT, the tensors do not), or of every file when there are none."""
    files = sorted(directory.glob("dist/*.distcp")) or sorted(
        p for p in directory.rglob("*") if p.is_file()
    )
    h = hashlib.sha256()
    for path in files:
        h.update(path.relative_to(directory).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def summarise(
    rows: Sequence[dict[str, Any]], window: int = 20, keys: Sequence[str] = WEIGHT_KEYS
) -> dict[str, dict[str, float]]:
    """Per key of ``keys`` (default :data:`WEIGHT_KEYS`): the mean over the first and last
    ``window`` steps and over all steps (NaN / missing values left out; a key never logged
    is absent)."""
    out: dict[str, dict[str, float]] = {}
    for key in keys:
        logged = [float(r[key]) for r in rows if r.get(key) is not None]
        logged = [v for v in logged if np.isfinite(v)]
        if logged:
            out[key] = {
                "first": float(np.mean(logged[:window])),
                "last": float(np.mean(logged[-window:])),
                "all": float(np.mean(logged)),
            }
    return out


def unit_name(method: str, seed: int) -> str:
    return f"{method}-s{seed}.json"


def read_units(directory: Path, settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The units under ``directory`` by file name; a unit made with other settings is refused
    (mixing two protocols in one table would be wrong)."""
    units: dict[str, dict[str, Any]] = {}
    for path in sorted(directory.glob("*.json")):
        unit = json.loads(path.read_text(encoding="utf-8"))
        if unit.get("settings") != settings:
            raise SystemExit(
                f"{path} was made with settings {unit.get('settings')}, this call has "
                f"{settings}: use the same arguments, or another --units directory"
            )
        units[path.name] = unit
    return units


def base_note(units: dict[str, dict[str, Any]]) -> str:
    """A warning when the units trained from more than one SFT base (``base``: the digest of
    its tensors), empty otherwise. Each session rebuilds the base, and CPUs of two vendors give
    it other bits even under the pinned kernels, so units of different sessions can start from
    different (equally trained) bases: a paired difference is then exact only within a seed
    whose units share one."""
    by_base: dict[str, list[str]] = {}
    for name, unit in sorted(units.items()):
        by_base.setdefault(unit["base"], []).append(name.removesuffix(".json"))
    if len(by_base) < 2:
        return ""
    parts = "; ".join(f"`{digest}`: {', '.join(names)}" for digest, names in by_base.items())
    return (
        f"**Warning: the units come from {len(by_base)} different SFT bases** (the warm-up "
        "did not reproduce bit for bit in a later session, e.g. on another CPU): "
        f"{parts}. The comparison is then within seeds trained from different starting weights."
    )


def write_unit(path: Path, unit: dict[str, Any]) -> None:
    """One unit, written whole (to a temporary name first: an interrupted write is no unit)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(unit, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)


def run_units(
    *,
    units_dir: Path,
    settings: dict[str, Any],
    methods: Sequence[str],
    seeds: Sequence[int],
    base_step: Path,
    train: Callable[[tuple[str, int]], float],
    evaluate: Callable[[str, Path], list[dict]],
    run_dir: Callable[[str, int], Path],
    rl_steps: int,
    render: Callable[[dict[str, dict[str, Any]]], None],
    deadline: float | None = None,
    keys: Sequence[str] = WEIGHT_KEYS,
) -> dict[str, dict[str, Any]]:
    """Evaluate the base once and every missing (method, seed) unit, seed by seed, one at a
    time; after each unit re-render the report. ``deadline`` (``time.time()``): start no new
    unit after it. Returns every unit present."""
    base_digest = digest(base_step)
    units = read_units(units_dir, settings)
    if "base.json" not in units:
        began = time.time()
        entry = {**evaluate("base", base_step)[0], "rl_step": 0}
        units["base.json"] = {"settings": settings, "base": base_digest, "entry": entry,
                              "seconds": {"eval": time.time() - began}}  # fmt: skip
        write_unit(units_dir / "base.json", units["base.json"])
        render(units)
    for seed in seeds:
        for method in methods:
            name = unit_name(method, seed)
            if name in units:
                continue
            if deadline is not None and time.time() > deadline:
                return units
            began = time.time()
            train((method, seed))
            trained = time.time()
            step_dir = run_dir(method, seed) / "checkpoints" / f"step_{rl_steps:08d}"
            entry = {**evaluate(f"{method}/s{seed}", step_dir)[0], "rl_step": rl_steps}
            rows = _metrics(run_dir(method, seed) / "metrics.jsonl", rl_steps)
            units[name] = {
                "settings": settings,
                "base": base_digest,
                "entry": entry,
                "training": summarise(rows, keys=keys),
                "seconds": {"rl": trained - began, "eval": time.time() - trained},
            }
            write_unit(units_dir / name, units[name])
            render(units)
    return units


def _metrics(path: Path, last_step: int) -> list[dict[str, Any]]:
    import analysis

    return analysis.read_metrics(path, last_step)


def entries(units: dict[str, dict[str, Any]], methods: Sequence[str]) -> list[dict]:
    """The evaluation entries of the base and of the seeds that every method has finished
    (complete seeds only, so the comparison stays paired), in a fixed order."""
    by_seed: dict[int, dict[str, dict]] = {}
    for name, unit in units.items():
        if name != "base.json":
            method, seed = name[: -len(".json")].rsplit("-s", 1)
            by_seed.setdefault(int(seed), {})[method] = unit["entry"]
    out = [units["base.json"]["entry"]]
    for seed in sorted(by_seed):
        if all(m in by_seed[seed] for m in methods):
            out += [by_seed[seed][m] for m in methods]
    return out


RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def units_dir_of(args: argparse.Namespace, out: Path, name: str) -> Path:
    """Where the units of experiment ``name`` live: ``--units``, else ``docs/results/<name>``
    (``<out>/<name>`` with ``--smoke``)."""
    return (args.units or (out if args.smoke else RESULTS) / name).resolve()


def main(
    args: argparse.Namespace,
    protocol: str,
    base_step: Path,
    train: Callable[[tuple[str, int]], float],
    evaluate: Callable[[str, Path], list[dict]],
    out: Path,
    command: str,
    name: str = "coverage_long",
    report: Callable[..., None] | None = None,
    keys: Sequence[str] = WEIGHT_KEYS,
    cpu: str = "avx2-pinned",
) -> int:
    """``run.py --style worked`` after the base: the units one at a time
    (:func:`run_units`), the report re-rendered after each. With ``--smoke`` the units and the
    report default to ``--out`` instead of ``docs/results/``."""
    import long_report

    write_report = report or long_report.write
    if args.stop_after:  # the report shows the command that continues the experiment
        command = command.replace(f"--stop-after {args.stop_after}", "").replace("  ", " ").strip()
    units_dir = units_dir_of(args, out, name)
    results = args.results or (out if args.smoke else RESULTS) / f"{name}.md"
    shared = ("sft_steps", "rl_steps", "prompts_per_step", "lr", "n", "kmax", "eval_prompts")
    # "cpu": the kernels are pinned (reco_megatron/utils/cpu_env.py); units of other pins
    # are not comparable (other bits from the same base)
    settings = {"protocol": protocol, "task": sorted(args.task), "cpu": cpu}
    settings |= {k: vars(args)[k] for k in shared}
    deadline = None
    if args.stop_after:
        hour, minute = (int(x) for x in args.stop_after.split(":"))
        now = time.gmtime()
        deadline = time.time() + ((hour - now.tm_hour) * 60 + minute - now.tm_min) * 60
    units = run_units(
        units_dir=units_dir, settings=settings, methods=args.methods, seeds=args.seeds,
        base_step=base_step, train=train, evaluate=evaluate,
        run_dir=lambda m, s: out / "runs" / f"{m}-s{s}", rl_steps=args.rl_steps,
        render=lambda u: write_report(results, args, u, command), deadline=deadline,
        keys=keys,
    )  # fmt: skip
    write_report(results, args, units, command)
    sys.stdout.write(f"wrote {results} ({len(units)} units in {units_dir})\n")
    return 0
