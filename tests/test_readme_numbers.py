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
from pathlib import Path

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


def test_render_words_follow_the_numbers() -> None:
    script = _script()
    stored = json.loads(script.SUMMARY.read_text())
    flat = {**stored, "reward_last": stored["reward_first"], "distinct_last": 1.0}
    text = script.render(flat)
    assert "does not rise" in text and "does not fall" in text and "sharpens" not in text
    assert script.compare(stored, stored) == []
    assert script.compare(stored, {**stored, "reward_last": stored["reward_last"] + 0.01})
