"""``reco-eval``: pass@k (k = 1, 2, 4, ... kmax) and diversity of one or several checkpoints.

CPU, a run directory of ``reco-train`` (embedded engine; the Megatron checkpoint is exported
in-process). The tokenizer, reward, held-out data, prompt template and response length come
from the run's ``config.yaml``; the results go to ``RUN_DIR/reco-eval``::

    reco-eval runs/tiny_cpu
    reco-eval runs/tiny_cpu --n 32 --kmax 32 --out /tmp/tiny-eval     # flags override the run

Any checkpoint (a ``step_*`` directory, a checkpoints root or an HF directory) with explicit
inputs::

    reco-eval runs/tiny_cpu/checkpoints --data runs/tiny_cpu/data/eval.jsonl \\
        --tokenizer examples/tiny/countdown_sp.model --reward countdown --out runs/tiny_cpu/eval

Several checkpoints on one plot, with labels: ``base=runs/a/checkpoints reco=runs/b/checkpoints``.

1 GPU, the paper protocol (vLLM; T = 0.6, top-p 0.95, n = 256)::

    reco-eval reco=hf/qwen-math-1.5b-reco --data data/math500.jsonl --answer-field answer \\
        --reward math --engine vllm --n 256 --kmax 256 --max-new-tokens 3072 --out eval/math500

N GPUs: run one ``reco-eval`` per GPU and benchmark (``CUDA_VISIBLE_DEVICES=i``), or give vLLM
tensor parallelism with ``--tp``. Writes ``passk.json`` (per-problem counts, per-k averages,
per checkpoint), ``passk.md`` and ``passk.png`` (checkpoints with identical curves, e.g. a
checkpoint and its own HF export, are drawn with distinct markers and noted in the legend);
the markdown table also goes to stdout. Without ``--max-new-tokens`` (and no run config) the
response length is the longest that fits the model's context next to the longest prompt,
at most 64 (embedded) or 3072 (vLLM).
Exit status 2 on a bad input (missing checkpoint, empty dataset, kmax > n), with the reason.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path
from typing import Any

import yaml

from reco_megatron.utils.logging import get_logger
from reco_megatron.utils.noise import quiet_known_warnings

logger = get_logger("reco_megatron.evaluate")


def parse_checkpoint(spec: str) -> tuple[str, str]:
    """``"label=path"`` -> ``(label, path)``; a bare path is labelled by its last parts."""
    if "=" in spec:
        label, path = spec.split("=", 1)
        if label and path:
            return label, path
    parts = [p for p in spec.rstrip("/").split("/") if p]
    return "/".join(parts[-2:]) or spec, spec


def run_dir_of(path: str) -> Path | None:
    """``path`` when it is a ``reco-train`` output directory (``config.yaml`` and
    ``checkpoints/``), else None."""
    p = Path(path)
    return p if (p / "config.yaml").is_file() and (p / "checkpoints").is_dir() else None


def run_defaults(run_dir: Path) -> dict[str, Any]:
    """The evaluation inputs a run's ``config.yaml`` gives (flags override them)."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")) or {}
    data, rollout = cfg.get("data") or {}, cfg.get("rollout") or {}
    fields = data.get("dataset") or {}
    return {
        "data": data.get("eval_path") or str(run_dir / "data" / "eval.jsonl"),
        "tokenizer": data.get("tokenizer"),
        "template": data.get("template"),
        "reward": (cfg.get("reward") or {}).get("reward"),
        "max_new_tokens": rollout.get("max_new_tokens"),
        "prompt_field": fields.get("prompt_field"),
        "answer_field": fields.get("answer_field"),
        "id_field": fields.get("id_field"),
        "out": str(run_dir / "reco-eval"),
    }


FALLBACKS: dict[str, Any] = {
    "tokenizer": "",
    "template": "{prompt}\n",
    "reward": "math",
    "prompt_field": "prompt",
    "answer_field": "answer",
    "id_field": "id",
}
"""Values used when neither a flag nor a run's config gives one."""


def build_parser() -> argparse.ArgumentParser:
    """The ``reco-eval`` argument parser (None: from the run's config, else a fallback)."""
    p = argparse.ArgumentParser(prog="reco-eval", description=__doc__.split("\n")[0])
    p.add_argument(
        "checkpoints", nargs="+", help="[label=]path: run dir, reco checkpoint or HF dir"
    )
    p.add_argument("--data", default=None, help=".jsonl/.parquet problems (default: run's)")
    p.add_argument("--prompt-field", default=None)
    p.add_argument("--answer-field", default=None)
    p.add_argument("--id-field", default=None)
    p.add_argument("--tokenizer", default=None, help=".model file or HF dir (default: run's)")
    p.add_argument("--template", default=None, help="used without a chat template")
    p.add_argument("--reward", default=None, help="math | countdown | module:function")
    p.add_argument("--reward-workers", type=int, default=2)
    p.add_argument(
        "--answer-key",
        default="",
        help="module:function naming a response's solution (distinct correct solutions per "
        "problem); default: the reward's built-in (countdown); none: off",
    )
    p.add_argument("--n", type=int, default=None, help="samples/problem (vllm 256, else 16)")
    p.add_argument("--kmax", type=int, default=None, help="largest k (default: n)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: fits the context")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=0, help="first N problems only (0: all)")
    p.add_argument("--engine", choices=("embedded", "vllm"), default="embedded")
    p.add_argument("--device", default="cpu", help="embedded engine device")
    p.add_argument("--tp", type=int, default=1, help="vLLM tensor parallel size")
    p.add_argument("--out", default=None, help="output directory (default: RUN_DIR/reco-eval)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the passk.* an earlier evaluation left in --out (else: refused)",
    )
    p.add_argument("--no-progress", action="store_true")
    return p


def missing_path_problem(path: str) -> str | None:
    """Why ``path`` (a positional checkpoint argument) cannot be one, before anything else is
    asked for: it does not exist (with the closest existing sibling, for a typo) or is a file.
    None when it is a directory (what kind of checkpoint it is, is checked later)."""
    p = Path(path)
    if p.is_dir():
        return None
    if p.exists():
        return f"checkpoint {path!r} is a file; pass a run directory or a checkpoint directory"
    parent = p.parent if str(p.parent) else Path(".")
    hint = ""
    if parent.is_dir():
        siblings = [c.name for c in parent.iterdir() if c.is_dir()]
        close = difflib.get_close_matches(p.name, siblings, n=1, cutoff=0.6)
        if close:
            hint = f"; did you mean {str(parent / close[0])!r}?"
    else:
        hint = f" (nor does {str(parent)!r})"
    return f"checkpoint {path!r} does not exist{hint}"


def resolve_inputs(args: argparse.Namespace) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """``(label, checkpoint path)`` pairs and the inputs: flags, else the first run
    directory's config, else :data:`FALLBACKS`. A run directory stands for its checkpoints."""
    checkpoints, run = [], None
    problems = [
        p for spec in args.checkpoints if (p := missing_path_problem(parse_checkpoint(spec)[1]))
    ]
    if problems:  # the positional paths first: a typo is reported before any flag is asked for
        raise ValueError("; ".join(problems))
    for spec in args.checkpoints:
        label, path = parse_checkpoint(spec)
        run_dir = run_dir_of(path)
        if run_dir is not None:
            run = run or run_defaults(run_dir)
            path = str(run_dir / "checkpoints")
        checkpoints.append((label, path))
    inputs = {}
    for key in ("data", "out", "max_new_tokens", *FALLBACKS):
        value = getattr(args, key)
        if value is None and run is not None:
            value = run.get(key)
        inputs[key] = FALLBACKS.get(key) if value is None else value
    for key in ("data", "out"):
        if not inputs[key]:
            raise ValueError(f"--{key} is required unless a checkpoint is a reco-train run dir")
    earlier = sorted(p.name for p in Path(inputs["out"]).glob("passk.*"))
    if earlier and not getattr(args, "overwrite", False):
        raise ValueError(
            f"--out {str(inputs['out'])!r} already holds an earlier evaluation "
            f"({', '.join(earlier)}): pass another --out DIR, or --overwrite to replace it"
        )
    if not Path(inputs["data"]).is_file():
        given = "--data" if args.data is not None else "the run's held-out set"
        raise ValueError(f"{given} {inputs['data']!r} is not a file: pass --data PROBLEMS.jsonl")
    return checkpoints, inputs


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit status (2 on a bad input)."""
    args = build_parser().parse_args(argv)
    try:  # before any import of torch or megatron-core: a typo is one line, at once
        resolve_inputs(args)
    except ValueError as exc:
        logger.error("reco-eval: %s", exc)
        return 2
    quiet_known_warnings()
    from reco_megatron.data.dataset import DatasetConfig, DatasetError
    from reco_megatron.eval.pipeline import EvalSettings, run_evaluation
    from reco_megatron.megatron import CheckpointError

    gpu = args.engine == "vllm"
    n = args.n if args.n is not None else (256 if gpu else 16)
    try:
        checkpoints, inputs = resolve_inputs(args)
        settings = EvalSettings(
            checkpoints=checkpoints,
            data=inputs["data"],
            out_dir=inputs["out"],
            tokenizer=inputs["tokenizer"],
            dataset=DatasetConfig(
                prompt_field=inputs["prompt_field"],
                answer_field=inputs["answer_field"],
                id_field=inputs["id_field"] or None,
            ),
            template=inputs["template"],
            reward=inputs["reward"],
            reward_workers=args.reward_workers,
            answer_key=args.answer_key,
            n=n,
            kmax=args.kmax if args.kmax is not None else n,
            temperature=args.temperature,
            top_p=args.top_p,
            max_new_tokens=inputs["max_new_tokens"],
            default_max_new_tokens=3072 if gpu else 64,
            seed=args.seed,
            limit=args.limit,
            engine=args.engine,
            device=args.device,
            tensor_parallel_size=args.tp,
            progress=not args.no_progress,
        )
        result = run_evaluation(settings)
    except (ValueError, FileNotFoundError, DatasetError, CheckpointError) as exc:
        logger.error("reco-eval: %s", exc)
        return 2
    from reco_megatron.eval.report import markdown_table

    rows = [(e["label"], e["summary"]) for e in result["entries"]]
    sys.stdout.write(markdown_table(rows))
    for kind, path in result["paths"].items():
        logger.info("wrote %s: %s", kind, path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
