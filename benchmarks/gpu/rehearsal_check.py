"""The verdict of ``benchmarks/gpu/rehearse.sh``: did the device check pass on the image's
Python, collect every GPU test, render every summary section, and keep a killed step's
partial results? Prints each check and the step durations; exit status 1 on any problem.

    python benchmarks/gpu/rehearsal_check.py REHEARSAL_DIR --check-exit CODE

REHEARSAL_DIR holds ``expected_gpu_tests.txt`` (the full environment's ``--collect-only``),
``check/`` (the full ``check.sh --cpu`` run), ``export/`` (its ``--export`` folder) and
``killed/`` (the run whose stats_op step was killed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
from pathlib import Path

from reco_megatron.utils.jsonfile import read_jsonl

HERE = Path(__file__).resolve().parent
SECTIONS = (
    "environment",
    "stats_op",
    "kernel_tests",
    "trainer_tests",
    "rl_step",
    "train_throughput",
    "rollout_engines",
)
ABSENT = ("hypothesis", "pyarrow")  # what the image stand-in must lack, carried or not
# must come from the wheels
CARRIED = ("megatron.core", "psutil", "sentencepiece", "pytest", "zmq", "msgpack")


class Verdict:
    def __init__(self) -> None:
        self.problems: list[str] = []

    def check(self, ok: bool, what: str) -> None:
        print(f"  [{'ok' if ok else 'FAIL'}] {what}")
        if not ok:
            self.problems.append(what)


def _steps(run: Path) -> dict[str, dict]:
    return {r["step"]: r for r in read_jsonl(run / "steps.jsonl")[0]}


def _result(path: Path, v: Verdict, what: str) -> dict | None:
    """A step's result file, or ``None`` after a failed check saying why it could not be read."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        v.check(False, f"{what} ({exc})")
        return None


def _summary(run: Path) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, str(HERE / "summary.py"), str(run)], capture_output=True, text=True
    )
    return proc.returncode, (run / "summary.md").read_text()


def full_run(run: Path, expected: list[str], check_exit: int, v: Verdict) -> None:
    print(f"full run ({run}):")
    steps = _steps(run)
    limits = json.loads((run / "check.json").read_text())["limits"]
    for name in limits:
        r = steps.get(name, {"status": "missing", "seconds": 0, "limit": limits[name]})
        v.check(
            r["status"] == "ok", f"{name}: {r['status']} in {r['seconds']} s (limit {r['limit']} s)"
        )
    v.check(check_exit == 0, f"check.sh exit status {check_exit}")
    rc, md = _summary(run)
    v.check(rc == 0, "summary.py renders every section (exit 0)")
    v.check("**Not rendered**" not in md, "summary.md has no unrendered section")
    for name in SECTIONS:
        v.check(f"({name}: ok)" in md, f"summary.md has the {name} section")
    env = json.loads((run / "environment.json").read_text())
    modules = env.get("modules", {})
    for m in ABSENT:
        v.check(not modules.get(m, {}).get("ok", True), f"the image stand-in lacks {m}")
    for m in CARRIED:
        got = modules.get(m, {})
        v.check(got.get("from") == "carried", f"{m} comes from the carried wheels: {got}")
    collected, reported, bad = [], set(), []
    for name in ("kernel_tests", "trainer_tests"):
        events = read_jsonl(run / f"{name}.jsonl")[0]
        for e in events:
            if e["event"] == "collected":
                collected += e["nodeids"]
            elif e["event"] == "test":
                reported.add(e["nodeid"])
            elif e["event"].startswith("collect_"):
                bad.append(f"{e['event']} {e['nodeid']}: {e['message']}")
    v.check(not bad, f"no module failed to collect or skipped itself: {bad}")
    v.check(
        sorted(collected) == sorted(expected),
        f"{len(collected)} GPU tests collected on the image's Python, "
        f"{len(expected)} in the full environment"
        + ("" if sorted(collected) == sorted(expected) else f": {set(collected) ^ set(expected)}"),
    )
    v.check(reported == set(collected), "one result line per collected test")
    stats = json.loads((run / "stats_op.json").read_text())
    shapes = {r["shape"] for r in stats["rows"]}
    v.check(
        stats["complete"] and shapes == set(stats["shapes"]),
        f"stats_op.json complete with rows for {sorted(shapes)}",
    )
    v.check(
        not {r["method"] for r in stats["rows"]} & set(stats["skipped"]),
        f"the skipped methods {stats['skipped']} did not run",
    )
    rl = _result(
        run / "rl_step" / "rl_step.json", v, f"rl_step.json parses (see {run}/rl_step.log)"
    )
    if rl is not None:
        v.check(
            rl["complete"] and len(rl["rows"]) == rl["steps"] and rl.get("save_s") is not None,
            f"rl_step: {len(rl['rows'])} steps and a checkpoint saved (the path that needs psutil)",
        )
    export = run.parent / "export"
    with tarfile.open(export / "check.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    v.check(
        (export / "summary.md").read_text() == md and {"steps.jsonl", "stats_op.json"} <= names,
        "--export holds summary.md and check.tar.gz of every result (2 files to bring back)",
    )


def killed_run(run: Path, full: Path, v: Verdict) -> None:
    print(f"killed run ({run}):")
    step = _steps(run).get("stats_op", {})
    v.check(
        step.get("status") == "killed",
        f"stats_op recorded as killed: {step.get('status')} (exit {step.get('exit')})",
    )
    report = _result(run / "stats_op.json", v, "the killed step's stats_op.json parses")
    if report is None:
        return
    n_full = len(json.loads((full / "stats_op.json").read_text())["rows"])
    n = len(report["rows"])
    v.check(not report["complete"], "its stats_op.json says it is partial")
    v.check(0 < n < n_full, f"it keeps the {n} rows finished before the kill ({n_full} in full)")
    rc, md = _summary(run)
    v.check(rc == 0 and "**Partial**" in md, "summary.md renders the partial table")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--check-exit", type=int, required=True)
    args = parser.parse_args()
    expected = (args.dir / "expected_gpu_tests.txt").read_text().split()
    v = Verdict()
    full_run(args.dir / "check", expected, args.check_exit, v)
    killed_run(args.dir / "killed", args.dir / "check", v)
    if v.problems:
        print(f"\nrehearsal FAILED ({len(v.problems)} problems): see {args.dir}", file=sys.stderr)
        sys.exit(1)
    print("\nrehearsal passed")


if __name__ == "__main__":
    main()
