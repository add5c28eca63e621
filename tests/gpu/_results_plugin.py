"""pytest plugin of the device check: one JSON line per test, written as each test ends.

``pytest -p tests.gpu._results_plugin --results-jsonl FILE ...`` appends to FILE (each line
flushed to disk before the next test starts, :func:`reco_megatron.utils.jsonfile.append_jsonl`):

* ``{"event": "collected", "selected": N, "nodeids": [...]}`` once collection is done (after
  ``-m`` / ``-k``);
* ``{"event": "collect_error" | "collect_skip", "nodeid", "message"}`` for a module that
  failed to import or skipped itself as a whole (``pytest.importorskip``): on the GPU image
  both mean tests that silently would not run;
* ``{"event": "test", "nodeid", "outcome", "seconds", "message"}`` per test: outcome
  ``passed`` / ``failed`` / ``skipped`` / ``error`` (setup or teardown failed), seconds of the
  call phase (setup + call + teardown for errors), message the skip reason or the failure's
  last line;
* ``{"event": "finished", "exitstatus": code}`` at the end.

A step killed by its time limit leaves every finished test's line; the JUnit XML pytest can
also write (``--junitxml``) only appears at the end.
"""

from __future__ import annotations

import time

import pytest

from reco_megatron.utils.jsonfile import append_jsonl


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--results-jsonl",
        default=None,
        metavar="FILE",
        help="append one JSON line per test to FILE as it ends (the device check's record)",
    )


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--results-jsonl")
    if path:
        config.pluginmanager.register(_Recorder(path), "reco_results_jsonl")


def _message(report) -> str:
    """The skip reason, or the failure's exception line(s), at most 500 characters."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])  # (file, line, reason)
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return " / ".join(line.strip() for line in crash.message.splitlines() if line.strip())[:500]
    text = [line for line in str(report.longrepr or "").splitlines() if line.strip()]
    return text[-1].strip()[:500] if text else ""


class _Recorder:
    def __init__(self, path: str) -> None:
        self.path = path
        self.seconds: dict[str, float] = {}
        append_jsonl(path, {"event": "started", "time": time.time()})

    def pytest_collectreport(self, report) -> None:
        if report.failed or report.skipped:
            event = "collect_error" if report.failed else "collect_skip"
            row = {"event": event, "nodeid": report.nodeid, "message": _message(report)}
            append_jsonl(self.path, row)

    def pytest_collection_finish(self, session) -> None:
        ids = [item.nodeid for item in session.items]
        append_jsonl(self.path, {"event": "collected", "selected": len(ids), "nodeids": ids})

    def pytest_runtest_logreport(self, report) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration
        row = None
        if report.when == "call":
            row = {"outcome": report.outcome, "seconds": report.duration}
        elif report.failed:  # setup or teardown
            row = {"outcome": "error", "seconds": self.seconds[report.nodeid]}
        elif report.when == "setup" and report.skipped:
            row = {"outcome": "skipped", "seconds": report.duration}
        if row is not None:
            append_jsonl(
                self.path,
                {"event": "test", "nodeid": report.nodeid, **row, "message": _message(report)},
            )

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        append_jsonl(self.path, {"event": "finished", "exitstatus": int(exitstatus)})
