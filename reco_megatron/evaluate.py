"""``reco-eval``: pass@k (k = 1, 2, 4, ... kmax) and diversity of one or several checkpoints.

CPU (embedded engine, the tiny countdown model; a Megatron checkpoint is exported in-process)::

    reco-eval runs/tiny_cpu/checkpoints --data runs/tiny_cpu/data/eval.jsonl \\
        --tokenizer examples/tiny/countdown_sp.model --reward countdown --n 16 --kmax 16 \\
        --out runs/tiny_cpu/eval

Several checkpoints on one plot, with labels: ``base=runs/a/checkpoints reco=runs/b/checkpoints``.

1 GPU, the paper protocol (vLLM; T = 0.6, top-p 0.95, n = 256)::

    reco-eval reco=hf/qwen-math-1.5b-reco --data data/math500.jsonl --answer-field answer \\
        --reward math --engine vllm --n 256 --kmax 256 --max-new-tokens 3072 --out eval/math500

N GPUs: run one ``reco-eval`` per GPU and benchmark (``CUDA_VISIBLE_DEVICES=i``), or give vLLM
tensor parallelism with ``--tp``. Writes ``passk.json`` (per-problem counts, per-k averages,
per checkpoint), ``passk.md`` and ``passk.png``; the markdown table also goes to stdout.
Exit status 2 on a bad input (missing checkpoint, empty dataset, kmax > n), with the reason.
"""

from __future__ import annotations

import argparse
import sys

from reco_megatron.utils.logging import get_logger

logger = get_logger("reco_megatron.evaluate")


def parse_checkpoint(spec: str) -> tuple[str, str]:
    """``"label=path"`` -> ``(label, path)``; a bare path is labelled by its last parts."""
    if "=" in spec:
        label, path = spec.split("=", 1)
        if label and path:
            return label, path
    parts = [p for p in spec.rstrip("/").split("/") if p]
    return "/".join(parts[-2:]) or spec, spec


def build_parser() -> argparse.ArgumentParser:
    """The ``reco-eval`` argument parser."""
    p = argparse.ArgumentParser(prog="reco-eval", description=__doc__.split("\n")[0])
    p.add_argument("checkpoints", nargs="+", help="[label=]path: HF dir or reco checkpoint")
    p.add_argument("--data", required=True, help="local .jsonl or .parquet problems file")
    p.add_argument("--prompt-field", default="prompt")
    p.add_argument("--answer-field", default="answer")
    p.add_argument("--id-field", default="id")
    p.add_argument("--tokenizer", default="", help=".model file or HF dir (default: checkpoint)")
    p.add_argument("--template", default="{prompt}\n", help="used without a chat template")
    p.add_argument("--reward", default="math", help="math | countdown | module:function")
    p.add_argument("--reward-workers", type=int, default=2)
    p.add_argument("--n", type=int, default=None, help="samples/problem (vllm 256, else 16)")
    p.add_argument("--kmax", type=int, default=None, help="largest k (default: n)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-new-tokens", type=int, default=None, help="vllm 3072, else 64")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=0, help="first N problems only (0: all)")
    p.add_argument("--engine", choices=("embedded", "vllm"), default="embedded")
    p.add_argument("--device", default="cpu", help="embedded engine device")
    p.add_argument("--tp", type=int, default=1, help="vLLM tensor parallel size")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit status (2 on a bad input)."""
    args = build_parser().parse_args(argv)
    from reco_megatron.data.dataset import DatasetConfig, DatasetError
    from reco_megatron.eval.pipeline import EvalSettings, run_evaluation
    from reco_megatron.megatron.checkpoint import CheckpointError

    gpu = args.engine == "vllm"
    n = args.n if args.n is not None else (256 if gpu else 16)
    try:
        settings = EvalSettings(
            checkpoints=[parse_checkpoint(c) for c in args.checkpoints],
            data=args.data,
            out_dir=args.out,
            tokenizer=args.tokenizer,
            dataset=DatasetConfig(
                prompt_field=args.prompt_field,
                answer_field=args.answer_field,
                id_field=args.id_field or None,
            ),
            template=args.template,
            reward=args.reward,
            reward_workers=args.reward_workers,
            n=n,
            kmax=args.kmax if args.kmax is not None else n,
            temperature=args.temperature,
            top_p=args.top_p,
            max_new_tokens=args.max_new_tokens or (3072 if gpu else 64),
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
