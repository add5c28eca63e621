"""Benchmark without a GPU: the statistics kernels' sm_90 machine code, and launches per step.

Every Triton kernel variant of ``reco_megatron/parallel/vocab_stats_triton.py`` is compiled for
sm_90 (H100/H200) on the CPU with Triton's bundled ptxas, at the specialisation the run-time
JIT would pick for ``N = 8192`` tokens and ``V = 128256`` (16-byte aligned pointers, integer
arguments divisible by 16, as Triton's own launcher decides them), and its SASS is read:

* ``registers`` and ``spills`` (local-memory spill stores and loads in the SASS, and the
  stack/local bytes of the resource usage);
* ``occupancy``: resident warps per SM over the 64 of sm_90, from registers, shared memory
  and warps per program (65536 registers per SM allocated per warp in units of 256; 228 KiB
  of shared memory, 1 KiB reserved per program; at most 32 programs);
* the main loop (the first loop of the kernel: the unmasked tiles): its SASS instructions
  per logit (per thread: instructions of one iteration over the logits a thread handles in
  it), ``MUFU`` (special-function unit: the exponentials) per logit, ``BAR.SYNC`` per tile and
  whether its loads are 128-bit;
* an issue-time model: at one warp instruction per cycle per scheduler (132 SMs x 4 x
  1.98 GHz on an H100 SXM; the H200 has the same SMs), the milliseconds the main loops of
  forward + backward need at 8192 x 128256 (ignoring latency: a lower bound, to compare with
  the memory bound of 6 bytes per bf16 logit, 1.49 ms at ~4.2 TB/s).

Then, in a child process with ``TRITON_INTERPRET=1`` (Triton's interpreter: the CPU runs the
kernels), torch launches per forward + backward of ``vocab_parallel_stats`` are counted with
a dispatch mode (:class:`reco_megatron.testing.launches.LaunchCounter`: aten operators that
launch a kernel, Triton launches, collectives and host synchronisations) at TP 1 and TP 2,
Triton and eager.

Run (CPU, ~2 minutes; Triton and torch's CUDA wheel, which brings ptxas, needed)::

    python benchmarks/kernel_sass.py                      # markdown table
    python benchmarks/kernel_sass.py --json sass.json     # also the rows as JSON
    python benchmarks/kernel_sass.py --quick              # bf16 only, no launch count

``--json FILE`` writes ``{"kernels": [one object per kernel variant: name, kind (forward /
backward / combine / finish), dtype, registers, spills, occupancy, instructions_per_logit,
...], "launches": [...], "targets": {...}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
N_TOKENS, VOCAB = 8192, 128256
TARGETS = {
    "forward_instructions_per_logit": 13.0,
    "backward_instructions_per_logit": 15.0,
    "spills": 0,
    "occupancy": 0.625,
    "launches_tp1": 12,
}
"""What the kernels must reach (checked by ``tests/parallel/test_kernel_sass.py``)."""
SM90 = {"sms": 132, "schedulers": 4, "clock_ghz": 1.98, "regs": 65536, "warps": 64}
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
FLAG_NAMES = ("HAS_LOGPROB", "HAS_ENTROPY", "HAS_SUM_P2")


@dataclass
class Variant:
    """One kernel compilation: which kernel, dtype and compile-time flags."""

    name: str
    kind: str
    dtype: str
    flags: dict[str, Any] = field(default_factory=dict)


def variants(quick: bool = False) -> list[Variant]:
    """Every kernel variant the op can launch (``quick``: the bf16 ones the engine uses)."""
    out = []
    for dt in ("bf16",) if quick else ("bf16", "fp16", "fp32"):
        for finish in (True, False):
            tp = "tp1" if finish else "tp_gt1"
            out.append(Variant(f"forward-{dt}-{tp}", "forward", dt, {"FINISH": finish}))
    combos = [(True, True, True), (True, False, False)]
    if not quick:
        combos += [(a, b, c) for a in (0, 1) for b in (0, 1) for c in (0, 1) if a or b or c]
        combos = list(dict.fromkeys(tuple(map(bool, c)) for c in combos))
    for dt in ("bf16",) if quick else ("bf16", "fp16", "fp32"):
        for combo in combos if dt == "bf16" else combos[:1]:
            for inplace in (True, False) if combo == (True, True, True) else (True,):
                used = "+".join(
                    n[4:].lower() for n, on in zip(FLAG_NAMES, combo, strict=True) if on
                )
                name = f"backward-{dt}-{used}-{'inplace' if inplace else 'copy'}"
                flags = dict(zip(FLAG_NAMES, combo, strict=True), INPLACE=inplace)
                out.append(Variant(name, "backward", dt, flags))
    if not quick:
        out += [Variant("combine", "combine", "fp32"), Variant("finish", "finish", "fp32")]
    return out


def _runtime_args(variant: Variant, tk) -> tuple[tuple, dict]:
    """The launch arguments of the run-time call at N x V (meta tensors: no memory)."""
    import torch

    dtype = getattr(torch, DTYPES[variant.dtype])
    n, v = N_TOKENS, VOCAB
    logits = torch.empty(n, v, dtype=dtype, device="meta")
    target = torch.empty(n, dtype=torch.int64, device="meta")
    rows = [torch.empty(n, device="meta") for _ in range(7)]
    part = torch.empty(4, n, device="meta")
    warps = {"num_warps": tk.NUM_WARPS}
    if variant.kind == "forward":
        sub = tk.forward_sub_row(dtype)
        args = (logits, v, target, 0, v, v, *rows[:4], part, n)
        return args, {"ROWS": tk.FORWARD_ROWS, "SUB": sub, **variant.flags, **warps}
    if variant.kind == "backward":
        args = (logits, v, logits, v, target, *rows[:6], 0, v, v)
        return args, {"BLOCK": tk.BACKWARD_BLOCK, **variant.flags, **warps}
    if variant.kind == "combine":
        args = (rows[0], rows[1], part, target, 0, v, n)
        return args, {"BLOCK": tk.COMBINE_BLOCK, **warps}
    return (part, rows[0], target, *rows[1:5], n), {"BLOCK": tk.COMBINE_BLOCK, **warps}


def compile_variant(variant: Variant, arch: int = 90) -> dict[str, Any]:
    """Compile ``variant`` for ``sm_<arch>`` as Triton's launcher would specialise it.

    Returns ``{"sass", "cubin", "shared", "num_warps", "attrs"}``.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource
    from triton.runtime.jit import create_function_from_signature
    from triton.tools.disasm import get_sass

    from reco_megatron.parallel import vocab_stats_triton as tk

    target = GPUTarget("cuda", arch, 32)
    backend = CUDABackend(target)
    kernel = tk.jit_all()[variant.kind]
    args, kwargs = _runtime_args(variant, tk)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound, specialization, options
    )
    src = ASTSource(kernel, signature, constexprs, attrs)
    compiled = triton.compile(src, target=target, options=options.__dict__)
    cubin = compiled.asm["cubin"]
    return {
        "cubin": cubin,
        "sass": _quietly(get_sass, cubin),
        "shared": compiled.metadata.shared,
        "num_warps": compiled.metadata.num_warps,
        "attrs": {name: attrs.get((i,), []) for i, name in enumerate(signature)},
    }


def _quietly(fn, *args):
    """``fn(*args)`` with file descriptor 2 silenced (nvdisasm warns about its ELF format)."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            return fn(*args)
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def resource_usage(cubin: bytes) -> dict[str, int]:
    """``REG``, ``STACK``, ``SHARED``, ``LOCAL`` of the cubin (``cuobjdump -res-usage``)."""
    import tempfile

    from triton.tools.disasm import path_to_cuobjdump

    cuobjdump = path_to_cuobjdump()
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def _instructions(sass: str) -> list[str]:
    """SASS lines as ``"LABEL:"`` or the instruction text (control codes stripped)."""
    out = []
    for line in sass.splitlines():
        line = line.strip()
        if re.fullmatch(r"[.\w]+:", line):
            out.append(line)
        elif "\t" in line:
            out.append(line.split("\t", 1)[1].strip())
    return out


def main_loop(sass: str) -> list[str] | None:
    """Instructions of the first loop (a label some later branch jumps back to), or None."""
    lines = _instructions(sass)
    for i, line in enumerate(lines):
        if not line.endswith(":"):
            continue
        label = line[:-1]
        for j in range(i + 1, len(lines)):
            if re.search(rf"\bBRA\s+{re.escape(label)}\s*;", lines[j]):
                return [x for x in lines[i + 1 : j + 1] if not x.endswith(":")]
    return None


def occupancy(registers: int, shared: int, warps: int) -> float:
    """Resident warps / 64 on sm_90 for programs of ``warps`` warps."""
    regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = (SM90["regs"] // regs_per_warp) // warps
    by_smem = (228 * 1024) // (shared + 1024)
    programs = min(32, SM90["warps"] // warps, by_regs, by_smem)
    return programs * warps / SM90["warps"]


def analyse(variant: Variant, compiled: dict[str, Any]) -> dict[str, Any]:
    """The row of ``variant``: registers, spills, occupancy and the main loop's counts."""
    from reco_megatron.parallel import vocab_stats_triton as tk

    usage = resource_usage(compiled["cubin"])
    sass = compiled["sass"]
    spill_ops = len(re.findall(r"\b(?:STL|LDL)\b", sass))
    warps = compiled["num_warps"]
    shared = max(compiled["shared"], usage.get("SHARED", 0))
    row: dict[str, Any] = {
        "name": variant.name,
        "kind": variant.kind,
        "dtype": variant.dtype,
        "flags": variant.flags,
        "registers": usage.get("REG", 0),
        "spills": spill_ops + usage.get("STACK", 0) + usage.get("LOCAL", 0),
        "shared_bytes": shared,
        "num_warps": warps,
        "occupancy": occupancy(usage.get("REG", 0), shared, warps),
        "specialised_args": sorted(n for n, a in compiled["attrs"].items() if a),
        "instructions_per_logit": None,
    }
    loop = main_loop(sass)
    if loop is None or variant.kind not in ("forward", "backward"):
        return row
    import torch

    element = torch.empty((), dtype=getattr(torch, DTYPES[variant.dtype])).element_size()
    if variant.kind == "forward":
        tile = tk.FORWARD_ROWS * tk.forward_sub_row(getattr(torch, DTYPES[variant.dtype]))
        per_iteration = 2 * tile  # two tiles per iteration
    else:
        tile = per_iteration = tk.BACKWARD_BLOCK
    per_thread = per_iteration / (32 * warps)
    mufu = sum(1 for x in loop if x.split()[0].lstrip("@!P0123456789 ").startswith("MUFU"))
    row.update(
        main_loop_instructions=len(loop),
        logits_per_thread_per_iteration=per_thread,
        instructions_per_logit=round(len(loop) / per_thread, 3),
        mufu_per_logit=round(mufu / per_thread, 3),
        barriers_per_tile=sum("BAR.SYNC" in x for x in loop) * tile / per_iteration,
        vector_loads=any(re.search(r"\bLDG\.E\.(?:128|64)\b", x) for x in loop),
        bytes_per_logit_loaded=element,
    )
    return row


def issue_model_ms(rows: list[dict[str, Any]], dtype: str = "bf16") -> float | None:
    """Issue-bound time (ms) of forward (TP 1) + backward (all three) main loops at N x V."""
    want = {f"forward-{dtype}-tp1", f"backward-{dtype}-logprob+entropy+sum_p2-inplace"}
    per_logit = [r["instructions_per_logit"] for r in rows if r["name"] in want]
    if len(per_logit) != 2 or None in per_logit:
        return None
    warp_instructions = sum(per_logit) * N_TOKENS * VOCAB / 32
    rate = SM90["sms"] * SM90["schedulers"] * SM90["clock_ghz"] * 1e9
    return warp_instructions / rate * 1e3


def count_launches_child() -> list[dict[str, Any]]:
    """Launches per forward + backward (run under ``TRITON_INTERPRET=1``)."""
    from reco_megatron.testing import run_distributed
    from reco_megatron.testing.launches import count_stats_op

    rows = []
    for impl in ("triton", "eager"):
        for tp in (1, 2):
            counts = run_distributed(count_stats_op, tp, args=(impl,), timeout=300)[0]
            rows.append({"implementation": impl, "tp": tp, **counts})
    return rows


def count_launches() -> list[dict[str, Any]]:
    """:func:`count_launches_child` in a fresh process with Triton's interpreter on."""
    code = (
        "import json, sys; from benchmarks.kernel_sass import count_launches_child; "
        "json.dump(count_launches_child(), sys.stdout)"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    if proc.returncode != 0:
        raise RuntimeError(f"launch count failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return "-" if value is None else str(value)


def table(rows: list[dict[str, Any]]) -> str:
    head = "| variant | regs | spills | occupancy | instr./logit | MUFU/logit | BAR/tile |"
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells = [r["registers"], r["spills"], f"{r['occupancy']:.1%}", r["instructions_per_logit"]]
        cells += [r.get("mufu_per_logit"), r.get("barriers_per_tile")]
        lines.append(f"| {r['name']} | " + " | ".join(_fmt(c) for c in cells) + " |")
    return "\n".join(lines)


def launch_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| implementation | TP | launches fwd + bwd | Triton kernels | collectives | host syncs |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        launches = f"{r['forward_launches']} + {r['backward_launches']} = {r['launches']}"
        lines.append(
            f"| {r['implementation']} | {r['tp']} | {launches} | {r['triton_kernels']} | "
            f"{r['collectives']} | {r['host_syncs']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the rows as JSON to this file")
    parser.add_argument("--quick", action="store_true", help="bf16 only, no launch count")
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET (this compiles; it starts the interpreter)")
    import triton

    rows = [analyse(v, compile_variant(v, args.arch)) for v in variants(args.quick)]
    print(f"sm_{args.arch}, Triton {triton.__version__}, N x V = {N_TOKENS} x {VOCAB}\n")
    print(table(rows))
    model = issue_model_ms(rows)
    if model is not None:
        print(f"\nissue-bound model, forward + backward main loops, bf16: {model:.2f} ms")
    launches = [] if args.quick else count_launches()
    if launches:
        print("\n" + launch_table(launches))
    if args.json:
        out = {
            "arch": f"sm_{args.arch}",
            "triton": triton.__version__,
            "shape": [N_TOKENS, VOCAB],
            "kernels": rows,
            "issue_model_ms": model,
            "launches": launches,
            "targets": TARGETS,
        }
        args.json.write_text(json.dumps(out, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
