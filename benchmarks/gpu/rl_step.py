"""Benchmark: RL steps (rollout + reward + old-policy pass + update + weight sync) of a ~0.8B
model through the real trainer, with per-phase times and peak GPU memory.

The trainer is built from ``examples/tiny_cpu.yaml`` with a preset's overrides, as a user's
run would be, and its ``train_step`` is called ``--steps`` times (no checkpoint is written);
the first step is a warm-up (allocator, kernels, the rollout engine's first generation) and
the report is the last step's row of ``metrics.jsonl`` (``time_*`` columns per phase) plus
``torch.cuda.max_memory_allocated`` over the whole run (training engine and embedded rollout
engine share the GPU). Presets:

* ``1b``: 16 layers x 2048 wide, SwiGLU 5632, 16 heads (MHA), bf16 parameters (~0.8B with the
  tiny tokenizer's 128-token vocabulary), 32 prompts x G 8 responses of <= 24 tokens,
  2 mini-batches, micro-batch 8: the model the first GPU run used.
* ``tiny``: the CI's tiny model (seconds on a CPU: what ``check.sh --cpu`` runs).

``--engine megatron`` generates with the trainer's own model (``rollout.engine=megatron``)
and ``--max-new-tokens N`` sets the response budget (the device check: 256, realistic lengths
where generation dominates a step); every row also reports ``generation_share``, the rollout
phase's share of the step.

Run::

    python benchmarks/gpu/rl_step.py --preset 1b --out OUT_DIR      # OUT_DIR/rl_step.{json,md}
    python benchmarks/gpu/rl_step.py --preset 1b --engine megatron --max-new-tokens 256 \
        --out OUT_DIR                                                # the device check's run

``--checkpoint`` also saves the trainer's checkpoint after the last step (``save_s``; the
device check's CPU rehearsal does, so that a module the save path needs, psutil, cannot be
missing unnoticed). ``rl_step.json`` grows as the run goes (set-up, then one row per step,
``"complete"`` at the end); ``rl_step.md`` is written at the end.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

PRESETS = {
    "1b": [
        "model.num_layers=16",
        "model.hidden_size=2048",
        "model.ffn_hidden_size=5632",
        "model.num_attention_heads=16",
        "model.num_query_groups=16",
        "model.params_dtype=bfloat16",
        "rollout.prompts_per_step=32",
        "rollout.group_size=8",
        "parallel.micro_batch_size=8",
        "update.minibatches_per_rollout=2",
        "update.stats_implementation=auto",
    ],
    "tiny": [
        "model.num_layers=2",
        "model.hidden_size=32",
        "model.ffn_hidden_size=64",
        "model.num_attention_heads=4",
        "model.num_query_groups=2",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "rollout.max_new_tokens=8",
        "parallel.micro_batch_size=4",
    ],
}
COMMON = [
    "sft.steps=0",
    "data.countdown.n_train=64",
    "data.countdown.n_eval=8",
    "trainer.progress=false",
    "trainer.loggers=[]",
    "checkpoint.save_interval=0",
]
PHASES = ("time_rollout", "time_reward", "time_old_logprob", "time_train", "time_sync")


def run(
    preset: str, steps: int, out: Path, checkpoint: bool = False, extra: list[str] | None = None
) -> dict:
    """Build the trainer, run ``steps`` RL steps, return the report.

    ``out/rl_step.json`` is rewritten (atomically) after the set-up and after every step with
    the steps so far and ``"complete": false`` until the end, so a run stopped by a time
    limit keeps the set-up time and every finished step."""
    from reco_megatron.config import load_config
    from reco_megatron.trainer.config import TrainConfig
    from reco_megatron.trainer.loop import Trainer
    from reco_megatron.utils.jsonfile import write_json

    overrides = [*PRESETS[preset], *COMMON, *(extra or []), f"trainer.output_dir={out / 'run'}"]
    overrides.append(f"trainer.max_steps={steps}")
    cfg = load_config(TrainConfig, "examples/tiny_cpu.yaml", overrides)
    start = time.perf_counter()
    trainer = Trainer(cfg)
    device = trainer.engine.device
    cuda = device.type == "cuda"
    report = {
        "preset": preset,
        "engine": cfg.rollout.engine,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "parameters": sum(
            p.numel() for chunk in trainer.engine.unwrapped() for p in chunk.parameters()
        ),
        "params_dtype": cfg.model.params_dtype,
        "responses_per_step": cfg.rollout.prompts_per_step * cfg.rollout.group_size,
        "setup_s": time.perf_counter() - start,
        "steps": steps,
        "rows": [],
        "complete": False,
    }
    write_json(out / "rl_step.json", report)
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            row = trainer.train_step()
            if cuda:
                torch.cuda.synchronize(device)
            row["time_step"] = time.perf_counter() - t0
            kept = (*PHASES, "time_step", "response_len_mean", "logprob_mismatch", "loss")
            kept_row = {k: row[k] for k in kept}
            kept_row["generation_share"] = row["time_rollout"] / row["time_step"]
            report["rows"].append(kept_row)
            if cuda:
                report["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                report["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
            write_json(out / "rl_step.json", report)
        if checkpoint:  # megatron's distributed checkpoint of the whole state, as a run saves
            t0 = time.perf_counter()
            trainer.save()
            report["save_s"] = time.perf_counter() - t0
            write_json(out / "rl_step.json", report)
    finally:
        trainer.close()
    last = report["rows"][-1]
    report.update(
        response_len_mean=last["response_len_mean"],
        last_step={k: last[k] for k in (*PHASES, "time_step")},
        peak_allocated_gib=report.get("peak_allocated_gib"),
        peak_reserved_gib=report.get("peak_reserved_gib"),
        logprob_mismatch=last["logprob_mismatch"],
        generation_share=last["generation_share"],
        loss=last["loss"],
        complete=True,
    )
    write_json(out / "rl_step.json", report)
    return report


def markdown(r: dict) -> str:
    """One table row per phase of the last step, and the memory line."""
    lines = [
        f"RL step, preset `{r['preset']}`, rollout engine `{r['engine']}`, on {r['device']} "
        f"(torch {r['torch']}): "
        f"{r['parameters'] / 1e9:.2f}B parameters ({r['params_dtype']}), "
        f"{r['responses_per_step']} responses of {r['response_len_mean']:.1f} tokens on "
        f"average, step {r['steps']} of {r['steps']} (the first is a warm-up)",
        "",
        "| phase | seconds |",
        "|---|---|",
    ]
    lines += [f"| {k.removeprefix('time_')} | {v:.3f} |" for k, v in r["last_step"].items()]
    lines.append(f"\nGeneration: {100 * r['generation_share']:.0f} % of the step.")
    if r["peak_allocated_gib"] is not None:
        lines.append(
            f"\nPeak GPU memory: {r['peak_allocated_gib']:.1f} GiB allocated, "
            f"{r['peak_reserved_gib']:.1f} GiB reserved. logprob_mismatch "
            f"{r['logprob_mismatch']:.2e}."
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--checkpoint", action="store_true", help="save a checkpoint after the last step, timed"
    )
    parser.add_argument("--engine", choices=("embedded", "vllm", "megatron"), default=None)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    extra = [] if args.engine is None else [f"rollout.engine={args.engine}"]
    if args.max_new_tokens is not None:
        extra.append(f"rollout.max_new_tokens={args.max_new_tokens}")
    report = run(args.preset, args.steps, args.out, args.checkpoint, extra)
    (args.out / "rl_step.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
