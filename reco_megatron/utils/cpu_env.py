"""The environment that makes CPU runs give the same bits on any x86-64 machine with AVX2.

torch picks its CPU kernels by the CPU's vector extensions (AVX-512, AVX2, none), and so do
MKL (torch's BLAS) and oneDNN; the kernels round differently, and a few hundred training
steps amplify that into other samples and rewards. Measured on the tiny default (the first RL
step's loss after 60 SFT steps): AVX-512 -0.01335904, AVX2 -0.01336349, none -0.01333455.
MKL also takes other paths on Intel and AMD processors: with ``MKL_CBWR=AVX2`` an Intel Xeon
and an AMD EPYC gave the README run different first-step rewards (0.141 and 0.156), so MKL is
pinned to ``COMPATIBLE``, its conditional-numerical-reproducibility mode for "Intel and
Intel-compatible" processors alike (SSE2 kernels, slower). That is not enough: under these
pins an AMD EPYC still gives other bits than an Intel Xeon (first RL step of the README run:
reward 0.156 against 0.141, loss -0.0411 against -0.0512; the same with oneDNN switched off,
and with ``COMPATIBLE,STRICT``; measured 2026-12-02), so the bits are the same per CPU vendor,
not across vendors, and ``benchmarks/readme_numbers.py`` stores one run per vendor.
:data:`PORTABLE_CPU_KERNELS` pins ATen and oneDNN to AVX2, which every x86-64 CPU of the last
decade has, and MKL to that mode; ``benchmarks/readme_numbers.py`` and the coverage
experiments run under it, so a run started on one machine continues on another of its vendor.
"""

from __future__ import annotations

from pathlib import Path

PORTABLE_CPU_KERNELS: dict[str, str] = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
"""Variables to set in a process's environment before torch starts (they override any
value the environment had)."""


def cpuinfo(field: str) -> str | None:
    """The first ``field`` line's value in ``/proc/cpuinfo``; None where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.partition(":")[0].strip() == field:
            return line.partition(":")[2].strip()
    return None


def cpu_vendor() -> str:
    """``/proc/cpuinfo``'s ``vendor_id`` (``GenuineIntel``, ``AuthenticAMD``); ``unknown``
    where that file does not say. Runs under :data:`PORTABLE_CPU_KERNELS` give the same bits
    per vendor, so results that must match across sessions record it."""
    return cpuinfo("vendor_id") or "unknown"
