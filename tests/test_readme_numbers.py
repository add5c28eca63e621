"""The README's numbers for the default run cannot drift from the run they came from.

``benchmarks/readme_numbers.py`` runs the default and stores the run's summary, per-step
series and resolved configuration in ``docs/results/readme_run.json``; these checks are the
cheap half (the full rerun, ``--check``, is a CI step): the README block is exactly the
rendering of the stored run, the summary is computed from its series, and the stored
configuration and tokenizer are still what ``examples/tiny_cpu.yaml`` resolves to, so changing
a default or the example makes this test fail until the script is run again.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reco_megatron.trainer.reporting import is_wall_clock

ROOT = Path(__file__).resolve().parents[1]
RERUN = "stale: run `python benchmarks/readme_numbers.py` and commit README.md + the JSON"


def _script():
    spec = importlib.util.spec_from_file_location(
        "readme_numbers", ROOT / "benchmarks/readme_numbers.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_block_is_the_stored_run() -> None:
    script = _script()
    stored = json.loads(script.SUMMARY.read_text())
    block = script.readme_block(script.README.read_text(encoding="utf-8"))
    assert block == script.render(stored), RERUN
    for key, value in script.aggregate(stored["series"]).items():
        assert stored[key] == value, f"{key}: {RERUN}"
    assert len(stored["series"]["reward_mean"]) == stored["rl_steps"]


def test_stored_run_used_the_current_default() -> None:
    script = _script()
    stored = json.loads(script.SUMMARY.read_text())
    assert stored["config"] == script.resolved_config(), RERUN
    assert stored["tokenizer_sha256"] == script.tokenizer_sha256(), RERUN


def test_other_vendors_runs_are_of_the_current_default() -> None:
    """Each stored run of another CPU vendor (what ``--check`` compares a machine of that
    vendor with) is of the same configuration, tokenizer and stack as the README's run, and of
    another vendor than it."""
    script = _script()
    stored = json.loads(script.SUMMARY.read_text())
    assert stored["cpu"]["vendor"] in ("GenuineIntel", "AuthenticAMD")
    for other in script.vendor_runs():
        name = f"readme_run_{other['cpu']['vendor']}.json"
        assert other["cpu"]["vendor"] != stored["cpu"]["vendor"], name
        assert (script.SUMMARY.parent / name).exists(), name
        assert other["config"] == stored["config"], f"{name} is stale: rerun --vendor"
        assert other["tokenizer_sha256"] == stored["tokenizer_sha256"], name
        assert other["stack"] == stored["stack"], name
        for key, value in script.aggregate(other["series"]).items():
            assert other[key] == value, name


def test_check_picks_the_run_of_the_machines_vendor(tmp_path: Path, monkeypatch) -> None:
    script = _script()
    readme_run = json.loads(script.SUMMARY.read_text())
    readme_run["cpu"]["vendor"] = "GenuineIntel"
    monkeypatch.setattr(script, "SUMMARY", tmp_path / "readme_run.json")
    script.SUMMARY.write_text(json.dumps(readme_run))
    path, run = script.reference_for("GenuineIntel")
    assert path == script.SUMMARY and run == readme_run
    with pytest.raises(SystemExit, match=r"no stored README run for this CPU vendor \(Authentic"):
        script.reference_for("AuthenticAMD")
    amd = {**readme_run, "cpu": {**readme_run["cpu"], "vendor": "AuthenticAMD"}}
    (tmp_path / "readme_run_AuthenticAMD.json").write_text(json.dumps(amd))
    path, run = script.reference_for("AuthenticAMD")
    assert path.name == "readme_run_AuthenticAMD.json" and run == amd
    with pytest.raises(SystemExit, match="not a plain name"):
        script.vendor_run_path("../x")


def test_render_words_follow_the_numbers() -> None:
    script = _script()
    stored = json.loads(script.SUMMARY.read_text())
    flat = {**stored, "reward_last": stored["reward_first"], "distinct_last": 1.0}
    text = script.render(flat)
    assert "does not rise" in text and "does not fall" in text and "sharpens" not in text
    assert script.compare(stored, stored) == []
    assert script.compare(stored, {**stored, "reward_last": stored["reward_last"] + 0.01})
    # A newer package with the same numbers is named, not a failure.
    newer = {**stored, "stack": {**stored["stack"], "transformers": "99.0.0"}}
    assert script.compare(stored, newer) == []
    assert script.stack_changes(stored, newer) == [
        f"stack: stored transformers {stored['stack']['transformers']}, this run 99.0.0"
    ]


def _short_run(tmp_path: Path, name: str, env: dict[str, str]) -> list[dict]:
    """The default's first steps (10 SFT, 2 RL steps) under ``env``; its metric rows, timings
    left out (they are the only values allowed to differ)."""
    out = tmp_path / name
    cmd = [
        sys.executable,
        "-m",
        "reco_megatron.train",
        "examples/tiny_cpu.yaml",
        "sft.steps=10",
        "trainer.max_steps=2",
        "checkpoint.save_interval=100",
        f"trainer.output_dir={out}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not is_wall_clock(k)} for row in rows]


@pytest.mark.slow
def test_cpu_pins_make_the_run_independent_of_the_cpu_capability(tmp_path: Path) -> None:
    """Two machines, one with AVX-512 and one without, are played by forcing torch's CPU
    capability (any x86-64 machine can force a lower one). Unpinned, the capability changes
    the numbers (the check is sensitive: AVX2 and scalar kernels round differently); under
    the README run's pins the capability the environment asks for no longer matters: the run
    pinned on this machine equals the run pinned on an emulated AVX2-only one, and a pinned
    run asked for the scalar kernels too (the pins override what the environment asks)."""
    script = _script()
    if not {"avx2", "fma"} <= script.cpu_flags():
        pytest.skip("the pinned kernels need an x86-64 CPU with AVX2 and FMA")
    stored = json.loads(script.SUMMARY.read_text())["stack"]
    if script.stack()["torch"] != stored["torch"]:
        pytest.skip(f"the README numbers are the torch {stored['torch']} stack's (CI checks them)")
    base = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    base = {k: v for k, v in base.items() if k not in script.PORTABLE_CPU_ENV}
    avx2 = _short_run(tmp_path, "avx2", {**base, "ATEN_CPU_CAPABILITY": "avx2"})
    scalar = _short_run(tmp_path, "scalar", {**base, "ATEN_CPU_CAPABILITY": "default"})
    assert avx2 != scalar, "forcing the CPU capability did not change the run: test is blind"
    # An AVX2-only machine: ATen, MKL and oneDNN all limited to AVX2 by the environment.
    avx2_machine = {
        **base,
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    }
    pinned_here = _short_run(tmp_path, "pinned_here", script.portable_env(base))
    pinned_avx2 = _short_run(tmp_path, "pinned_avx2", script.portable_env(avx2_machine))
    asked_scalar = {**base, "ATEN_CPU_CAPABILITY": "default"}
    pinned_scalar = _short_run(tmp_path, "pinned_scalar", script.portable_env(asked_scalar))
    assert pinned_here == pinned_avx2 == pinned_scalar
