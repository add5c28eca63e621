"""Render the device check's ``summary.md`` from what its steps wrote into OUT_DIR.

``check.sh`` runs this after every step, so ``summary.md`` is current even when the whole
command is stopped. Each step's section is rendered from its result file, complete or partial
(a step stopped by its limit leaves the rows it finished; the section says so). Exit status 1
when a section could not be rendered, or when a step that ended ``ok`` left no result file:
the summary must never hide a result behind a traceback.

    python benchmarks/gpu/summary.py OUT_DIR        # writes OUT_DIR/summary.md

Reads only JSON (no torch import): ``check.json`` and ``steps.jsonl`` (check.sh),
``environment.json``, ``stats_op.json``, ``kernel_tests.jsonl``, ``trainer_tests.jsonl``,
``rl_step/rl_step.json``, ``train_throughput.json``, ``rollout_engines.json``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from reco_megatron.utils.jsonfile import read_jsonl


def _load(path: Path):
    if path.suffix == ".jsonl":
        rows, torn = read_jsonl(path)
        return {"rows": rows, "torn": torn}
    return json.loads(path.read_text())


def _f(x, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _partial(data: dict, what: str) -> list[str]:
    if data.get("complete", True):
        return []
    return [f"**Partial**: the step stopped before the end; {what} below are what it finished.", ""]


# ---------------------------------------------------------------- sections
def environment(env: dict) -> list[str]:
    lines = _partial(env, "the entries")
    gpu = env.get("gpu")
    lines.append(
        f"Python {env.get('python')} ({env.get('executable')}), torch {env.get('torch', '?')} "
        f"(CUDA {env.get('torch_cuda')}), "
        + (
            f"**{gpu}**, {env.get('gpu_memory_gib')} GiB, capability {env.get('capability')}, "
            f"{env.get('multiprocessors')} SMs"
            if gpu
            else f"no GPU visible (cuda_available={env.get('cuda_available')})"
        )
        + f"; {env.get('cpus')} CPUs, {env.get('mem_total_gib', '?')} GiB memory."
    )
    if env.get("nvidia_smi"):
        lines += ["", "```", env["nvidia_smi"], "```"]
    modules = env.get("modules", {})
    if modules:
        lines += ["", "| module | version | from | import s |", "|---|---|---|---|"]
        for name, m in modules.items():
            if m["ok"]:
                lines.append(f"| {name} | {m['version']} | {m['from']} | {m['import_s']} |")
            else:
                lines.append(f"| {name} | **not importable**: {m['error']} | | |")
    return lines


def stats_op(report: dict) -> list[str]:
    rows = report["rows"]
    lines = _partial(report, f"the {len(rows)} rows")
    lines.append(
        f"{report['device']}, torch {report.get('torch', '?')}, copy bandwidth "
        f"{report['copy_bandwidth_Bps'] / 1e12:.3f} TB/s (read + write), bf16, median of "
        f"{report.get('reps', '?')} after a warm-up; forward + backward. Left out: "
        f"{', '.join(report.get('skipped', [])) or 'none'}. Op rows: time over the 6-bytes-"
        "per-logit bound; layer rows: time over the three matmuls alone."
    )
    for shape in dict.fromkeys(r["shape"] for r in rows):
        here = [r for r in rows if r["shape"] == shape]
        matmuls = next((r["seconds"] for r in here if r["method"] == "matmuls"), None)
        lines += [
            "",
            f"| {shape} | method | ms | x bound / x matmuls | peak x logits | peak GiB |",
            "|---|---|---|---|---|---|",
        ]
        for r in here:
            base = r.get("bound_s") if r["kind"] == "op" else matmuls
            ratio = r["seconds"] / base if base else None
            gib = r["peak_bytes"] / 2**30  # NaN on the CPU: no allocator statistics
            lines.append(
                f"| {r['kind']} | {r['method']} | {r['seconds'] * 1e3:.2f} | {_f(ratio, '.2f')} "
                f"| {_f(r['peak_x_logits'], '.2f')} | {_f(gib, '.2f')} |"
            )
    missing = [s for s in report.get("shapes", []) if s not in {r["shape"] for r in rows}]
    if missing:
        lines += ["", f"Not measured: {', '.join(missing)}."]
    return lines


def tests(log: dict) -> list[str]:
    events = log["rows"]
    collected = next((e for e in events if e["event"] == "collected"), None)
    done = {e["nodeid"]: e for e in events if e["event"] == "test"}  # the last report wins
    finished = next((e for e in events if e["event"] == "finished"), None)
    counts = Counter(e["outcome"] for e in done.values())
    lines = []
    if collected is None:
        lines.append("**Collection did not finish** (see the log).")
    else:
        lines.append(
            f"{collected['selected']} collected, "
            + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
            + (f"; pytest exit status {finished['exitstatus']}" if finished else "")
            + "."
        )
        not_run = [n for n in collected.get("nodeids", []) if n not in done]
        if not_run and not finished:
            lines += ["", f"**Stopped before these {len(not_run)} ran**: " + ", ".join(not_run)]
    for e in events:
        if e["event"] in ("collect_error", "collect_skip"):
            lines.append(f"\n**{e['event']}** `{e['nodeid']}`: {e['message']}")
    bad = [e for e in done.values() if e["outcome"] in ("failed", "error")]
    if bad:
        lines += ["", "| failed test | seconds | message |", "|---|---|---|"]
        lines += [f"| `{e['nodeid']}` | {e['seconds']:.1f} | {_cell(e['message'])} |" for e in bad]
    ran = [e for e in done.values() if e["outcome"] != "skipped"]
    ran.sort(key=lambda e: -e["seconds"])
    if ran:
        lines += ["", "| test | outcome | seconds |", "|---|---|---|"]
        lines += [f"| `{e['nodeid']}` | {e['outcome']} | {e['seconds']:.1f} |" for e in ran]
    reasons = Counter(e["message"] for e in done.values() if e["outcome"] == "skipped")
    for reason, n in reasons.items():
        lines.append(f"\nSkipped ({n}): {reason}")
    if log["torn"]:
        lines.append("\n(The last line was cut by the kill and is left out.)")
    return lines


def rl_step(report: dict) -> list[str]:
    rows = report["rows"]
    lines = _partial(report, f"the {len(rows)} of {report['steps']} steps")
    lines.append(
        f"Preset `{report['preset']}` on {report['device']} (torch {report['torch']}): "
        f"{report['parameters'] / 1e9:.2f}B parameters ({report['params_dtype']}), "
        f"{report['responses_per_step']} responses per step; set-up {report['setup_s']:.1f} s. "
        "Step 1 is the warm-up."
    )
    if rows:
        phases = [k for k in rows[0] if k.startswith("time_")]
        lines += [
            "",
            "| phase | " + " | ".join(f"step {i + 1} s" for i in range(len(rows))) + " |",
            "|---|" + "---|" * len(rows),
        ]
        for k in phases:
            lines.append(
                f"| {k.removeprefix('time_')} | " + " | ".join(f"{r[k]:.3f}" for r in rows) + " |"
            )
        last = rows[-1]
        lines.append(
            f"\nResponses {last['response_len_mean']:.1f} tokens on average, logprob_mismatch "
            f"{last['logprob_mismatch']:.4f}."
        )
    if report.get("save_s") is not None:
        lines.append(f"Checkpoint saved after the last step in {report['save_s']:.1f} s.")
    if report.get("peak_allocated_gib") is not None:
        lines.append(
            f"Peak GPU memory {report['peak_allocated_gib']:.1f} GiB allocated, "
            f"{report['peak_reserved_gib']:.1f} GiB reserved."
        )
    return lines


def train_throughput(report: dict) -> list[str]:
    lines = _partial(report, "the cases")
    arch = report["arch"]
    lines.append(
        f"{report['device']} (torch {report['torch']}): {arch['num_layers']} layers of hidden "
        f"{arch['hidden_size']}, {arch['num_attention_heads']} heads / "
        f"{arch['num_query_groups']} KV groups, FFN {arch['ffn_hidden_size']}, vocabulary "
        f"{arch['vocab_size']} ({report['parameters'] / 1e6:.1f}M parameters, "
        f"{arch['params_dtype']}); {report['tokens_per_step']} tokens per optimizer step, median "
        f"of {report['steps']} after a warm-up; matmul rate measured here "
        f"{report['matmul_tflops']:.3g} TFLOP/s."
    )
    if report["cases"]:
        lines += [
            "",
            "| case | attention | status | tokens/s | model TFLOP/s | MFU | peak GiB |",
            "|---|---|---|---|---|---|---|",
        ]
        for c in report["cases"]:
            ok = c["status"] == "ok"
            cells = (
                (f"{c['tokens_per_s']:.0f}", f"{c['model_tflops']:.3g}", f"{c['mfu']:.1%}")
                if ok
                else ("", "", "")
            )
            peak = _f(c.get("peak_allocated_gib"), ".1f") if "peak_allocated_gib" in c else ""
            lines.append(
                f"| {c['case']} | {c['attention']} | {c['status']} | "
                + " | ".join(cells)
                + f" | {peak} |"
            )
    return lines


def rollout_engines(report: dict) -> list[str]:
    lines = _partial(report, "the arms")
    lines.append(
        f"{report['device']}, {report['params_b']:.2f}B parameters ({report['dtype']}), "
        f"{report['prompts']} prompts x G {report['group']} x {report['new_tokens']} new tokens, "
        f"chunks of {report['max_batch_size']} rows, median of {report['reps']}."
    )
    arms = [a for a in ("megatron", "embedded") if a in report]
    if arms:
        lines += ["", "| engine | tokens | wall s | tokens/s | peak GiB |", "|---|---|---|---|---|"]
        for a in arms:
            r = report[a]
            lines.append(
                f"| {a} | {r['tokens']} | {r['wall_s']:.2f} | {r['tokens_per_s']:.0f} | "
                f"{r['peak_gib']:.2f} |"
            )
    if "speedup_megatron_over_embedded" in report:
        lines.append(
            f"\nmegatron / embedded tokens/s: {report['speedup_megatron_over_embedded']:.2f}; "
            f"identical responses {report['same_responses_frac']:.3f}, largest log-prob gap on "
            f"the common prefix {report['max_logprob_gap_common_prefix']:.2e}."
        )
    return lines


SECTIONS: list[tuple[str, str, str, Callable[[dict], list[str]]]] = [
    ("environment", "Environment", "environment.json", environment),
    ("stats_op", "Statistics op and output layer", "stats_op.json", stats_op),
    ("kernel_tests", "GPU tests: kernels and engines", "kernel_tests.jsonl", tests),
    ("trainer_tests", "GPU tests: trainer", "trainer_tests.jsonl", tests),
    ("rl_step", "RL step", "rl_step/rl_step.json", rl_step),
    ("train_throughput", "Training throughput", "train_throughput.json", train_throughput),
    ("rollout_engines", "Rollout engines", "rollout_engines.json", rollout_engines),
]


def render(out: Path) -> tuple[str, list[str]]:
    """The markdown, and the problems (sections that did not render)."""
    check = json.loads((out / "check.json").read_text())
    steps = {r["step"]: r for r in read_jsonl(out / "steps.jsonl")[0]}
    lines = [
        f"# reco-megatron device check ({check['mode']} mode)",
        "",
        f"Started {check['started']}, commit {check['commit']}, host {check['host']}, "
        f"CUDA_VISIBLE_DEVICES='{check['cuda_visible_devices']}'; step limits sum to "
        f"{check['limit_total']} s.",
        "",
        "| step | status | exit | seconds | limit | log |",
        "|---|---|---|---|---|---|",
    ]
    for name, limit in check["limits"].items():
        r = steps.get(name)
        if r:
            lines.append(
                f"| {name} | {r['status']} | {r['exit']} | {r['seconds']} | {limit} | {name}.log |"
            )
        else:
            lines.append(f"| {name} | not run yet | | | {limit} | |")
    problems = []
    for name, title, file, fn in SECTIONS:
        if name not in check["limits"] or name not in steps:
            continue
        status = steps[name]["status"]
        lines += ["", f"## {title} ({name}: {status})", ""]
        path = out / file
        if not path.exists():
            lines.append(f"No result file ({file}): see {name}.log.")
            if status == "ok":
                problems.append(f"{name}: ended ok but wrote no {file}")
            continue
        try:
            lines += fn(_load(path))
        except Exception:
            problems.append(f"{name}: {file} did not render:\n{traceback.format_exc()}")
            lines.append(f"**Not rendered** ({file}): see summary.log.")
    return "\n".join(lines) + "\n", problems


def main(out: Path) -> int:
    text, problems = render(out)
    tmp = out / ".summary.md.tmp"
    tmp.write_text(text)
    os.replace(tmp, out / "summary.md")
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
