"""The Triton kernels' machine code, compiled on the CPU as the run-time JIT would compile them.

``benchmarks/kernel_sass.py`` compiles each variant for sm_90 with Triton's bundled ptxas at
the specialisation Triton's launcher picks for ``N = 8192`` tokens and ``V = 128256`` (its
own argument binder: 16-byte aligned pointers and integers divisible by 16 are marked so, which
is what makes the loads 128-bit), and reads the SASS. These tests hold the kernels to the
targets: no spills, occupancy >= 62.5 %, at most 13 (forward) / 15 (backward) SASS
instructions per logit in the main loop and no barrier there. No GPU and no timing: registers,
spills and instruction counts are properties of the compiled code. They also catch a construct
the interpreter accepts but the compiler rejects (every variant compiles, for sm_80 too).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "triton",
    reason="Triton is not installed (torch's CPU-only wheels, as on the compat stack, do not "
    "pull it); the kernels' machine code is checked where it is (the main stack)",
)

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("kernel_sass", ROOT / "benchmarks/kernel_sass.py")
kernel_sass = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("kernel_sass", kernel_sass)  # dataclasses look their module up
_spec.loader.exec_module(kernel_sass)
TARGETS = kernel_sass.TARGETS
MAIN = ("forward-bf16-tp1", "forward-bf16-tp_gt1", "backward-bf16-logprob+entropy+sum_p2-inplace")
"""The variants the engine launches (bf16, every gradient, in place)."""


def _check(row: dict) -> None:
    assert row["spills"] == TARGETS["spills"], row
    assert row["occupancy"] >= TARGETS["occupancy"], row
    if row["kind"] in ("forward", "backward"):
        assert row["instructions_per_logit"] <= TARGETS[f"{row['kind']}_instructions_per_logit"]
        assert row["barriers_per_tile"] == 0, row  # the main loop's reductions are in-thread
        assert row["vector_loads"], row  # 128-bit (16-byte) loads: the divisibility took


@pytest.fixture(scope="module")
def main_rows() -> dict[str, dict]:
    variants = [v for v in kernel_sass.variants(quick=True) if v.name in MAIN]
    return {v.name: kernel_sass.analyse(v, kernel_sass.compile_variant(v)) for v in variants}


def test_compiled_at_the_run_time_specialisation(main_rows) -> None:
    # Without the divisibility attributes the compiler cannot prove 16-byte alignment and
    # emits scalar 16-bit loads with 57-64 registers: what a compile test used to check.
    assert set(main_rows) == set(MAIN)
    for row in main_rows.values():
        assert {"logits_ptr", "row_stride", "n_valid"} <= set(row["specialised_args"]), row


@pytest.mark.parametrize("name", MAIN)
def test_main_kernels_meet_the_targets(main_rows, name) -> None:
    _check(main_rows[name])


@pytest.mark.slow
def test_every_variant_compiles_and_meets_the_targets() -> None:
    for variant in kernel_sass.variants():
        if variant.name not in MAIN:
            _check(kernel_sass.analyse(variant, kernel_sass.compile_variant(variant)))
    for variant in kernel_sass.variants(quick=True):  # Ampere (A100): compiles
        if variant.name in MAIN:
            assert kernel_sass.compile_variant(variant, arch=80)["cubin"]
