"""The controlled coverage experiment: SFT base -> {GRPO, ReCo, ReCo response-only, ReCo
token-only} x seeds on the synthetic countdown task -> pass@k (k = 1..64) on held-out prompts.

One command on CPU (the full protocol; budget <= 60 min on 2 free cores)::

    python examples/coverage/run.py --out runs/coverage

The reduced version CI runs (1 seed, 2 RL steps, n = 4; checks the pipeline, not the outcome)::

    python examples/coverage/run.py --smoke --out /tmp/coverage-smoke

Steps (each a subprocess of the shipped entry points, so this is also an end-to-end test):
1. ``reco_megatron.train examples/tiny_cpu.yaml`` with ``trainer.max_steps=0``: SFT warm-up
   only, once; it writes the countdown splits and the base checkpoint.
2. One RL run per (method, seed), all from the base weights (``checkpoint.init_megatron=``),
   on the same training prompts, with the same compute budget (steps x prompts x group size);
   the methods differ only by the loss overrides in :data:`METHODS`.
3. ``reco-eval`` on the base and every final checkpoint: the same held-out prompts and the same
   per-problem sampling seeds for everyone.
4. ``docs/results/coverage.md`` (``--results``): the table (mean +- std over seeds), the plot
   (mean, min-max band) and the raw numbers in ``<out>/eval/passk.json``.

Resumable at every stage: run the same command again after an interruption. The SFT base is
skipped once its checkpoint exists; an RL run saves every ``--save-every`` steps and the
trainer resumes from its latest checkpoint (it is skipped once its final step is saved); each
checkpoint is evaluated on its own (``<out>/eval/parts/<protocol>/<label>-<step>/passk.json``) and
skipped when that file exists for the same protocol and checkpoint step;
``<out>/eval/passk.json`` is merged from the parts. A larger ``--rl-steps`` on an existing
``--out`` continues every RL run from its last checkpoint and evaluates the new ones.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from reco_megatron.eval import report  # noqa: E402

# The same clip (DAPO's clip-higher, as in examples/tiny_cpu.yaml) and no KL for every method:
# the only differences are the response weight and the token ratio.
METHODS: dict[str, list[str]] = {
    "grpo": ["loss.objective=ppo_clip", "loss.response_weight=none", "loss.token_ratio=importance"],
    "reco": ["loss.objective=reco", "loss.response_weight=sequence", "loss.token_ratio=bernoulli"],
    "reco_response_only": [
        "loss.objective=reco",
        "loss.response_weight=sequence",
        "loss.token_ratio=importance",
    ],
    "reco_token_only": [
        "loss.objective=reco",
        "loss.response_weight=none",
        "loss.token_ratio=bernoulli",
    ],
}
COMMON = ["loss.kl_coef=0.0", "loss.eps_low=0.2", "loss.eps_high=0.28"]
CONFIG = ROOT / "examples" / "tiny_cpu.yaml"


def _run(cmd: list[str], log: Path, threads: int) -> float:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads))
    env["MKL_NUM_THREADS"] = str(threads)
    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if proc.returncode != 0:
        tail = log.read_text().splitlines()[-25:]
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n" + "\n".join(tail))
    return time.perf_counter() - start


def _train_cmd(out: Path, overrides: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "reco_megatron.train",
        str(CONFIG),
        f"trainer.output_dir={out}",
        "trainer.progress=false",
        "trainer.tensorboard=false",
        *overrides,
    ]


def aggregate(entries: list[dict], methods: list[str]) -> tuple[list, dict, dict]:
    """Mean curves, std spreads and (min, max) bands per method over its seeds."""
    by_label = {e["label"]: e["summary"] for e in entries}
    rows = [("base (SFT)", by_label["base"])]
    spread: dict[str, dict[str, float]] = {}
    bands: dict[str, tuple[dict, dict]] = {}
    for method in methods:
        runs = [s for label, s in by_label.items() if label.startswith(f"{method}/")]
        keys = [k for k in runs[0] if isinstance(runs[0][k], int | float)]
        values = {k: np.array([r[k] for r in runs], dtype=float) for k in keys}
        rows.append((method, {k: float(v.mean()) for k, v in values.items()}))
        spread[method] = (
            {k: float(v.std(ddof=1)) for k, v in values.items()} if len(runs) > 1 else {}
        )
        bands[method] = (
            {k: float(v.min()) for k, v in values.items()},
            {k: float(v.max()) for k, v in values.items()},
        )
    return rows, spread, bands


def _shown(arg: object) -> str:
    """A path argument relative to the repository when it lies inside it."""
    text = str(arg)
    try:
        return str(Path(text).resolve().relative_to(ROOT)) if "/" in text else text
    except ValueError:
        return text


def write_results(path: Path, args: argparse.Namespace, rows, spread, timings) -> None:
    """The markdown report: protocol, table, plot. The discussion is written by hand: any text
    from a ``## Discussion`` heading on in an existing report is kept."""
    png = path.with_suffix(".png")
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    discussion = old[old.index("## Discussion") :] if "## Discussion" in old else ""
    shown_out = _shown(args.out)
    command = " ".join(_shown(a) for a in sys.argv[1:])
    seeds = ", ".join(str(s) for s in args.seeds)
    lines = [
        "# Coverage experiment: GRPO vs ReCo on the synthetic countdown task",
        "",
        f"Generated by `python examples/coverage/run.py {command}` on {time.strftime('%Y-%m-%d')}.",
        "",
        "## Protocol",
        f"- Base: `examples/tiny_cpu.yaml` (4-layer 128-wide Llama, vocab 128), SFT "
        f"{args.sft_steps} steps on 3 solutions per training problem.",
        f"- RL: {args.rl_steps} steps x {args.prompts_per_step} prompts x G = 8 from the base, "
        f"2 mini-batch updates per rollout batch, lr {args.lr}, no KL, clip 0.2/0.28, "
        f"seeds {seeds}.",
        f"- Evaluation: {args.eval_prompts} held-out problems, n = {args.n} samples each, "
        f"T = {args.temperature}, top-p = {args.top_p}, pass@k by the unbiased estimator; the "
        "same per-problem sampling seeds for every checkpoint.",
        "- Wall time: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in timings.items()) + ".",
        "",
        "## Results (percent; mean ± sample std over seeds)",
        "",
        report.markdown_table(rows, spread),
        f"![pass@k]({png.name})",
        "",
        "Columns after pass@k: `unique_frac` (distinct responses / n), `distinct_2` (distinct",
        "bigrams / bigrams), `rare_correct_frac` (problems solved by exactly one of n samples),",
        "`solved_frac` (problems solved at least once = pass@n). Raw per-problem counts:",
        f"`{shown_out}/eval/passk.json` (a copy: `{path.stem}_passk.json`).",
        "",
    ]
    if discussion:
        lines.append(discussion.rstrip() + "\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines), encoding="utf-8")


def _step_of(name: str) -> int:
    """``"step_00000120"`` -> 120."""
    return int(name.rsplit("_", 1)[-1])


def _task_overrides(task: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``["n_eval=128"]`` -> ``["data.countdown.n_eval=128"]``; a malformed item is a usage
    error (the trainer's config validation checks the names and values)."""
    bad = [t for t in task if "=" not in t or t.startswith("=") or t.startswith("data.")]
    if bad:
        parser.error(f"--task {bad}: give countdown settings as KEY=VALUE, e.g. n_eval=128")
    return [f"data.countdown.{t}" for t in task]


def _check_same_task(path: Path, task: list[str], sft_steps: int) -> None:
    """An existing ``--out`` keeps its base: refuse other task or SFT settings instead of
    mixing results of two bases."""
    settings = {"task": sorted(task), "sft_steps": sft_steps}
    if path.exists():
        old = json.loads(path.read_text())
        if old != settings:
            raise SystemExit(
                f"{path.parent} was made with {old}, this call asks for {settings}: use the "
                "same --task / --sft-steps, or a new --out"
            )
    else:
        path.write_text(json.dumps(settings))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/coverage"))
    p.add_argument("--results", type=Path, default=None, help="default: docs/results/coverage.md")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--sft-steps", type=int, default=300)
    p.add_argument("--rl-steps", type=int, default=20)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--kmax", type=int, default=64)
    p.add_argument("--eval-prompts", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--eval-interval", type=int, default=0, help="coverage eval during RL")
    p.add_argument("--save-every", type=int, default=10, help="RL checkpoint interval (resume)")
    p.add_argument("--jobs", type=int, default=1, help="RL runs in parallel")
    p.add_argument(
        "--task",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="countdown task settings for the base (data.countdown.KEY), e.g. n_eval=128",
    )
    p.add_argument(
        "--curve",
        nargs="+",
        default=[],
        metavar="METHOD/sSEED",
        help="runs whose every saved checkpoint is evaluated (the budget search), e.g. grpo/s1",
    )
    p.add_argument("--smoke", action="store_true", help="1 seed, tiny budget (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        args.seeds, args.sft_steps, args.rl_steps = args.seeds[:1], 8, 2
        args.n = args.kmax = 4
        args.eval_prompts, args.prompts_per_step, args.eval_interval = 3, 4, 1
    curve = set(args.curve)
    unknown = sorted(curve - {f"{m}/s{s}" for m in args.methods for s in args.seeds})
    if unknown:
        p.error(f"--curve {unknown}: not among the runs (METHOD/sSEED of --methods, --seeds)")
    task = _task_overrides(args.task, p)
    out = args.out.resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    _check_same_task(out / "task.json", task, args.sft_steps)
    timings_file = out / "timings.json"
    timings: dict[str, float] = (
        json.loads(timings_file.read_text()) if timings_file.exists() else {}
    )
    threads = max(1, (os.cpu_count() or 1) // args.jobs)

    base = out / "base"
    if not (base / "checkpoints" / "latest").exists():
        cmd = _train_cmd(base, ["trainer.max_steps=0", f"sft.steps={args.sft_steps}", *task])
        timings["SFT"] = _run(cmd, out / "logs" / "base.log", threads * args.jobs)
    data = base / "data"
    held_out = sum(1 for line in (data / "eval.jsonl").open() if line.strip())
    if held_out < args.eval_prompts:
        raise SystemExit(
            f"--eval-prompts {args.eval_prompts} but the base's held-out split has {held_out} "
            f"problems: lower --eval-prompts or start a new --out with --task n_eval="
            f"{args.eval_prompts}"
        )

    def rl(job: tuple[str, int]) -> float:
        method, seed = job
        run_dir = out / "runs" / f"{method}-s{seed}"
        if (run_dir / "checkpoints" / f"step_{args.rl_steps:08d}").exists():
            return 0.0  # finished; a partial run resumes from its latest checkpoint instead
        latest = run_dir / "checkpoints" / "latest"
        if latest.exists() and _step_of(latest.read_text().strip()) > args.rl_steps:
            raise SystemExit(
                f"{run_dir} is past step {args.rl_steps} and its step_{args.rl_steps:08d} was "
                f"not kept: evaluate a kept step, or list the run in --curve (keeps every "
                "checkpoint) in a new --out"
            )
        overrides = [
            f"checkpoint.init_megatron={base / 'checkpoints'}",
            "sft.steps=0",
            f"data.train_path={data / 'train.jsonl'}",
            f"data.eval_path={data / 'eval.jsonl'}",
            f"trainer.seed={seed}",
            f"trainer.max_steps={args.rl_steps}",
            f"rollout.prompts_per_step={args.prompts_per_step}",
            f"optimizer.lr={args.lr}",
            f"checkpoint.save_interval={args.save_every}",
            f"eval.interval={args.eval_interval}",
            f"eval.n={min(args.n, 8)}",
            f"eval.num_prompts={min(args.eval_prompts, 8)}",
            *(["checkpoint.keep_last=0"] if f"{method}/s{seed}" in curve else []),
            *COMMON,
            *METHODS[method],
        ]
        return _run(_train_cmd(run_dir, overrides), out / "logs" / f"{method}-s{seed}.log", threads)

    jobs = [(m, s) for s in args.seeds for m in args.methods]
    start = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        ran = list(pool.map(rl, jobs))
    if any(t > 0 for t in ran):
        timings["RL"] = timings.get("RL", 0.0) + time.perf_counter() - start
        timings_file.write_text(json.dumps(timings))

    protocol = f"n{args.n}-k{args.kmax}-p{args.eval_prompts}-t{args.temperature}-tp{args.top_p}"

    def evaluate(label: str, step_dir: Path) -> list[dict]:
        """``reco-eval`` of one checkpoint step, cached under the protocol and step."""
        part = out / "eval" / "parts" / protocol / f"{label.replace('/', '-')}-{step_dir.name}"
        if not (part / "passk.json").exists():
            eval_cmd = [
                sys.executable, "-m", "reco_megatron.evaluate", f"{label}={step_dir}",
                "--data", str(data / "eval.jsonl"),
                "--tokenizer", "examples/tiny/countdown_sp.model",
                "--reward", "countdown", "--reward-workers", "1", "--n", str(args.n),
                "--kmax", str(args.kmax), "--limit", str(args.eval_prompts),
                "--temperature", str(args.temperature), "--top-p", str(args.top_p),
                "--max-new-tokens", "24", "--out", str(part), "--no-progress",
            ]  # fmt: skip
            log = out / "logs" / f"eval-{label.replace('/', '-')}-{step_dir.name}.log"
            took = _run(eval_cmd, log, threads * args.jobs)
            timings["evaluation"] = timings.get("evaluation", 0.0) + took
            timings_file.write_text(json.dumps(timings))
        return report.read_json(part / "passk.json")

    base_step = base / "checkpoints" / (base / "checkpoints" / "latest").read_text().strip()
    entries = evaluate("base", base_step)
    for m, s in jobs:
        step_dir = out / "runs" / f"{m}-s{s}" / "checkpoints" / f"step_{args.rl_steps:08d}"
        entries += evaluate(f"{m}/s{s}", step_dir)
    curves: dict[str, list[tuple[int, dict]]] = {}
    for label in sorted(curve):
        method, seed = label.split("/s")
        ckpts = out / "runs" / f"{method}-s{seed}" / "checkpoints"
        steps = sorted(ckpts.glob("step_*"))  # the whole search, also past --rl-steps
        curves[label] = [(0, entries[0]["summary"])] + [
            (_step_of(d.name), evaluate(label, d)[0]["summary"]) for d in steps
        ]
    report.write_json(out / "eval" / "passk.json", entries)

    timings_file.write_text(json.dumps(timings))
    rows, spread, bands = aggregate(entries, args.methods)
    default = out / "coverage.md" if args.smoke else ROOT / "docs" / "results" / "coverage.md"
    results = args.results or default
    report.plot_passk(results.with_suffix(".png"), rows, bands, title="countdown, held-out: pass@k")
    write_results(results, args, rows, spread, timings)
    shutil.copyfile(out / "eval" / "passk.json", results.with_name(f"{results.stem}_passk.json"))
    sys.stdout.write(report.markdown_table(rows, spread))
    sys.stdout.write(f"wrote {results}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
