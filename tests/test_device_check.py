"""The device check's machinery on CPU: result files that survive a kill at any moment, the
per-test result lines, the discovery of GPU test modules, and ``summary.md`` rendering (every
section from the files the steps write, partial ones included; a section that cannot render
fails the check instead of hiding behind a traceback).

The whole check runs in CI as ``benchmarks/gpu/rehearse.sh`` (a venv with only what the GPU
image has); these tests pin the pieces with small inputs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reco_megatron.utils.jsonfile import append_jsonl, read_jsonl, write_json

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    """A module of benchmarks/gpu/ (scripts, not a package), loaded from its file."""
    spec = importlib.util.spec_from_file_location(
        f"_check_{name}", ROOT / f"benchmarks/gpu/{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_tests = _script("gpu_tests")
summary = _script("summary")

WRITER = """
import sys
from reco_megatron.utils.jsonfile import append_jsonl, write_json
path, rows = sys.argv[1], []
print("ready", flush=True)
while True:
    rows.append({"i": len(rows), "pad": "x" * 5000})
    write_json(path + ".json", {"rows": rows, "complete": False})
    append_jsonl(path + ".jsonl", rows[-1])
"""


def test_a_kill_at_any_moment_leaves_readable_results(tmp_path: Path) -> None:
    # SIGKILL a process that rewrites a growing JSON document and appends JSON lines as fast
    # as it can, at several moments: every time, both files parse and hold a prefix of rows.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k, delay in enumerate((0.05, 0.13, 0.31)):
        path = tmp_path / f"r{k}"
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path)], env=env, stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        doc = json.loads(path.with_suffix(".json").read_text())
        lines, torn = read_jsonl(path.with_suffix(".jsonl"))
        assert doc["rows"] and [r["i"] for r in doc["rows"]] == list(range(len(doc["rows"])))
        assert [r["i"] for r in lines] == list(range(len(lines))) and torn <= 1
        assert len(list(tmp_path.glob(f".r{k}.json.*.tmp"))) <= 1  # the write in flight


def test_read_jsonl_drops_a_torn_last_line_only(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    append_jsonl(path, {"a": 1})
    with path.open("a") as f:
        f.write('{"a": 2, "b"')  # a kill in the middle of a write
    assert read_jsonl(path) == ([{"a": 1}], 1)
    path.write_text('{"a": 1}\n{"a": \n{"a": 3}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_jsonl(path)


def test_results_plugin_writes_a_line_per_test(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "@pytest.mark.parametrize('x', [1, 2])\n"
        "def test_ok(x): assert x\n"
        "def test_bad(): assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='no GPU here')\n"
        "def test_skip(): pass\n"
        "@pytest.fixture\n"
        "def broken(): raise RuntimeError('setup broke')\n"
        "def test_error(broken): pass\n"
    )
    (tmp_path / "test_missing.py").write_text("import not_a_module_anywhere\n")
    out = tmp_path / "r.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.gpu._results_plugin",
            "-p",
            "no:cacheprovider",
            "--results-jsonl",
            str(out),
            str(tmp_path),
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout[-2000:]  # the collection error
    rows, torn = read_jsonl(out)
    assert (
        torn == 0
        and rows[0]["event"] == "started"
        and rows[-1]
        == {
            "event": "finished",
            "exitstatus": 2,
        }
    )
    (error,) = [r for r in rows if r["event"] == "collect_error"]
    assert error["nodeid"].endswith("test_missing.py") and "not_a_module" in error["message"]
    # pytest stops after a collection error unless asked to go on: rerun with that flag
    out.unlink()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.gpu._results_plugin",
            "-p",
            "no:cacheprovider",
            "--continue-on-collection-errors",
            "--results-jsonl",
            str(out),
            str(tmp_path),
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        capture_output=True,
        timeout=120,
    )
    rows = read_jsonl(out)[0]
    (collected,) = [r for r in rows if r["event"] == "collected"]
    tests = {r["nodeid"].split("::")[1]: r for r in rows if r["event"] == "test"}
    assert collected["selected"] == 5 == len(tests)
    assert {k: r["outcome"] for k, r in tests.items()} == {
        "test_ok[1]": "passed",
        "test_ok[2]": "passed",
        "test_bad": "failed",
        "test_skip": "skipped",
        "test_error": "error",
    }
    assert "one is not two" in tests["test_bad"]["message"]
    assert tests["test_skip"]["message"] == "Skipped: no GPU here"
    assert "setup broke" in tests["test_error"]["message"]


def test_gpu_test_modules_are_found_by_their_marker(tmp_path: Path) -> None:
    found = gpu_tests.uses_gpu_marker
    assert found("import pytest\n@pytest.mark.gpu\ndef test_x(): pass\n")
    assert found("import pytest\npytestmark = [pytest.mark.slow, pytest.mark.gpu]\n")
    assert found("import pytest\nP = pytest.param(1, marks=pytest.mark.gpu)\n")
    assert found("from tests.gpu._cuda import GPU\npytestmark = GPU\n")
    assert not found('"""Run with pytest.mark.gpu or -m gpu."""\nimport pytest\n')
    parts = gpu_tests.split()
    assert "tests/parallel/test_vocab_stats_triton.py" in parts["kernel"]
    assert "tests/gpu/test_stats_op_cuda.py" in parts["kernel"]
    assert parts["trainer"] == list(gpu_tests.TRAINER)
    assert not set(parts["kernel"]) & set(parts["trainer"])
    assert "tests/test_device_check.py" not in parts["kernel"]


# ---------------------------------------------------------------- summary.md
def _check_dir(tmp_path: Path, steps: dict[str, str]) -> Path:
    out = tmp_path / "check"
    out.mkdir()
    write_json(
        out / "check.json",
        {
            "mode": "gpu",
            "started": "2026-12-01T00:00:00Z",
            "commit": "abc",
            "host": "h",
            "cuda_visible_devices": "0",
            "limits": {name: 60 for name in steps},
            "limit_total": 60 * len(steps),
        },
    )
    for name, status in steps.items():
        row = {"step": name, "status": status, "exit": 0 if status == "ok" else 137}
        append_jsonl(out / "steps.jsonl", {**row, "seconds": 5, "limit": 60})
    return out


def _stats_op(complete: bool, shapes: list[str]) -> dict:
    rows = []
    for shape in shapes:
        rows += [
            {
                "kind": "op",
                "shape": shape,
                "method": "ours_triton",
                "seconds": 0.002,
                "bound_s": 0.0015,
                "peak_bytes": 2**30,
                "peak_x_logits": 0.5,
            },
            {
                "kind": "layer H=4096",
                "shape": shape,
                "method": "matmuls",
                "seconds": 0.033,
                "peak_bytes": 2**31,
                "peak_x_logits": 1.0,
            },
            {
                "kind": "layer H=4096",
                "shape": shape,
                "method": "fused_ours",
                "seconds": 0.05,
                "peak_bytes": float("nan"),
                "peak_x_logits": float("nan"),
            },
        ]
    return {
        "device": "NVIDIA H200",
        "torch": "2.11.0",
        "copy_bandwidth_Bps": 4.3e12,
        "shapes": ["8192x128256", "32768x128256"],
        "reps": 5,
        "skipped": ["ours_eager"],
        "complete": complete,
        "rows": rows,
    }


def test_summary_renders_the_statistics_table_from_rows(tmp_path: Path) -> None:
    # the benchmark writes "rows" (a "table" key was read before, and the summary showed a
    # KeyError traceback while the check said ok)
    out = _check_dir(tmp_path, {"stats_op": "ok"})
    write_json(out / "stats_op.json", _stats_op(True, ["8192x128256", "32768x128256"]))
    assert summary.main(out) == 0
    md = (out / "summary.md").read_text()
    assert "| 8192x128256 | method | ms |" in md and "| 32768x128256 | method |" in md
    assert "| op | ours_triton | 2.00 | 1.33 | 0.50 | 1.00 |" in md
    assert "| layer H=4096 | fused_ours | 50.00 | 1.52 | - | - |" in md
    assert "Partial" not in md and "Not measured" not in md


def test_summary_shows_a_killed_step_as_partial(tmp_path: Path) -> None:
    out = _check_dir(tmp_path, {"stats_op": "killed", "kernel_tests": "killed"})
    write_json(out / "stats_op.json", _stats_op(False, ["8192x128256"]))
    log = out / "kernel_tests.jsonl"
    append_jsonl(log, {"event": "started", "time": 0})
    append_jsonl(log, {"event": "collected", "selected": 3, "nodeids": ["t::a", "t::b", "t::c"]})
    append_jsonl(
        log, {"event": "test", "nodeid": "t::a", "outcome": "passed", "seconds": 1.5, "message": ""}
    )
    with log.open("a") as f:
        f.write('{"event": "test", "nodeid": "t::b", "outc')  # cut by the kill
    assert summary.main(out) == 0
    md = (out / "summary.md").read_text()
    assert "**Partial**: the step stopped before the end; the 3 rows" in md
    assert "Not measured: 32768x128256." in md
    assert "3 collected, 1 passed." in md
    assert "**Stopped before these 2 ran**: t::b, t::c" in md
    assert "The last line was cut by the kill" in md


def test_summary_fails_when_a_section_cannot_render(tmp_path: Path) -> None:
    out = _check_dir(tmp_path, {"environment": "ok", "stats_op": "ok", "rl_step": "failed"})
    write_json(out / "stats_op.json", {"table": "| old format |"})  # what the old code read
    assert summary.main(out) == 1
    md = (out / "summary.md").read_text()
    assert "**Not rendered** (stats_op.json)" in md
    assert "No result file (environment.json)" in md  # an ok step without its file: a problem
    assert "No result file (rl_step/rl_step.json): see rl_step.log." in md
    _, problems = summary.render(out)
    assert [p.split(":")[0] for p in problems] == ["environment", "stats_op"]


def test_check_sh_refuses_bad_options(tmp_path: Path) -> None:
    check = ROOT / "benchmarks" / "gpu" / "check.sh"
    for args, message in (
        (["--only", "nosuch", str(tmp_path)], "no step 'nosuch'"),
        (["--limit", "stats_op=soon", str(tmp_path)], "want NAME=SECONDS"),
        (["--limit", "nosuch=5", str(tmp_path)], "want NAME=SECONDS"),
    ):
        proc = subprocess.run(["bash", str(check), *args], capture_output=True, text=True)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)


def test_summary_renders_training_throughput_with_an_out_of_memory_case(tmp_path: Path) -> None:
    out = _check_dir(tmp_path, {"train_throughput": "killed"})
    arch = {
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_query_groups": 8,
        "ffn_hidden_size": 14336,
        "vocab_size": 128256,
        "params_dtype": "bfloat16",
        "num_layers": 2,
    }
    ok = {"case": "4096", "attention": "torch", "status": "ok", "tokens_per_s": 50000.0}
    ok.update(model_tflops=330.0, mfu=0.42, peak_allocated_gib=40.0)
    oom = {"case": "16384", "attention": "local", "status": "out of memory"}
    report = {
        "device": "H200",
        "torch": "2.11",
        "arch": arch,
        "parameters": 1.5e9,
        "setup_s": 9.0,
        "steps": 2,
        "tokens_per_step": 32768,
        "matmul_tflops": 790.0,
        "cases": [ok, {**oom, "peak_allocated_gib": 139.0}],
        "complete": False,
    }
    write_json(out / "train_throughput.json", report)
    assert summary.main(out) == 0
    md = (out / "summary.md").read_text()
    assert "| 4096 | torch | ok | 50000 | 330 | 42.0% | 40.0 |" in md
    assert "| 16384 | local | out of memory |  |  |  | 139.0 |" in md
    assert "**Partial**" in md


def test_megatron_flops_count_of_the_8b_slice() -> None:
    # Megatron-LM's count by hand for one 4096-token sequence through one Llama-3.1-8B layer
    # plus the output layer: 24 h^2 s (QKV + output projection with 8/32 KV heads: 2 h^2 (1 +
    # 1/4) x 3 passes x 2 FLOPs) + attention 12 h s^2 + SwiGLU 18 h F s + logits 6 h V s.
    throughput = _script("train_throughput")
    h, s, f, v = 4096, 4096, 14336, 128256
    want = 12 * h * h * s * 1.25 + 12 * h * s * s + 18 * h * f * s + 6 * h * v * s
    got = throughput.megatron_flops([s], 1, throughput.SLICE, v)
    assert got == pytest.approx(want, rel=1e-12)
    # packed documents count attention over their own lengths: less than one long sequence
    assert throughput.megatron_flops([s // 2] * 2, 1, throughput.SLICE, v) < got
