"""The docs agree with the code, where that is cheap to check: the examples the commands
name exist, every config key the docs mention exists, the README's overrides load, and the
docs speak to users (no internal issue numbers)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from reco_megatron.config import load_config
from reco_megatron.config.schema import init_fields, preset_key, section_type, type_hints
from reco_megatron.trainer.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
USER_FACING = [*DOCS, *sorted((ROOT / "benchmarks").rglob("*.py")), *sorted(
    (ROOT / "benchmarks").rglob("*.sh")
)]  # fmt: skip
SECTIONS = [f.name for f in init_fields(TrainConfig)]
_KEY = re.compile(rf"(?<![\w./-])((?:{'|'.join(SECTIONS)})(?:\.[a-z_][a-z0-9_]*)+)(?![\w/-]|\.\w)")
_FILE_SUFFIX = re.compile(r"\.(py|md|yaml|yml|json|sh|png|jsonl)$")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


INTENTIONALLY_BAD = {"loss.eps_hgh", "rollout.max_new_tokens.x", "loss..x"}
"""Keys the docs misspell on purpose, to show an error message."""


def doc_keys(line: str) -> list[str]:
    """The config keys a line of documentation mentions: ``section.key=...`` (an override),
    or a dotted name whose first key is a field of that section (``loss.eps_high``,
    ``data.countdown.n_train``); module names (``parallel.linear_stats``), Hugging Face
    attributes (``model.generate``) and file names are something else."""
    keys = []
    for match in _KEY.finditer(line):
        key = match.group(1)
        override = line[match.end() : match.end() + 1] == "="
        section, field = key.split(".")[:2]
        named = field in {
            f.name for f in init_fields(section_type(type_hints(TrainConfig)[section]))
        }
        if not _FILE_SUFFIX.search(key) and (override or named or field == "preset"):
            keys.append(key)
    return keys


def config_key_exists(key: str) -> bool:
    """Whether ``section.field[.field...]`` names a key of :class:`TrainConfig`."""
    tp: object = TrainConfig
    for part in key.split("."):
        section = section_type(tp)
        if section is None:
            return False
        if part == preset_key(section):
            return True
        hints = type_hints(section)
        if part not in {f.name for f in init_fields(section)}:
            return False
        tp = hints[part]
    return True


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def test_no_internal_issue_numbers() -> None:
    pattern = re.compile(r"\b[Ii]ssues? ?#?\d+|\bissue-\d+|\bthe issue's\b|\(issue\)|#\d{1,4}\b")
    hits = [
        f"{_rel(path)}:{i}: {line.strip()}"
        for path in USER_FACING
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, "docs speak to users; rewrite without internal issue numbers:\n" + "\n".join(
        hits
    )


def test_bash_commands_name_examples_that_exist() -> None:
    missing = []
    for path in DOCS:
        for block in bash_blocks(path.read_text()):
            for name in re.findall(r"(?<![\w/])(examples/[\w./-]*\w)", block):
                if not (ROOT / name).exists():
                    missing.append(f"{_rel(path)}: {name}")
    assert not missing, missing


def test_config_keys_in_the_docs_exist() -> None:
    unknown = []
    for path in DOCS:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for key in doc_keys(line):
                if key not in INTENTIONALLY_BAD and not config_key_exists(key):
                    unknown.append(f"{_rel(path)}:{i}: {key}")
    assert not unknown, unknown


def test_key_finder_finds_and_skips() -> None:
    line = (
        "`loss.eps_high=0.3`, loss.preset, data.countdown.n_train, not trainer.py, model.generate"
    )
    assert doc_keys(line) == ["loss.eps_high", "loss.preset", "data.countdown.n_train"]
    assert doc_keys("loss.eps_hgh=1 and loss.eps_high.x") == ["loss.eps_hgh", "loss.eps_high.x"]
    assert not config_key_exists("loss.eps_hgh") and config_key_exists("data.countdown.n_train")


def _readme_override_lists() -> list[list[str]]:
    """Every run of ``section.key=value`` words in the README's inline code and commands."""
    text = (ROOT / "README.md").read_text()
    found = []
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for chunk in re.findall(r"`([^`]+)`", prose) + bash_blocks(text):
        try:
            words = shlex.split(chunk.replace("\\\n", " "), comments=True)
        except ValueError:  # prose with an apostrophe
            words = chunk.split()
        words = [w for w in words if "=" in w]
        overrides = [w for w in words if w.split("=", 1)[0].split(".")[0] in SECTIONS]
        if overrides:
            found.append(overrides)
    return found


def test_readme_overrides_load_on_the_tiny_config() -> None:
    lists = _readme_override_lists()
    assert any("loss.preset=grpo" in o for o in lists), lists
    for overrides in lists:
        load_config(TrainConfig, ROOT / "examples/tiny_cpu.yaml", overrides)


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_docs_mention_no_missing_repo_paths(path: Path) -> None:
    """Backticked repository paths (``examples/...``, ``slurm/...``, ``docs/...``) exist."""
    missing = [
        name
        for name in re.findall(
            r"`((?:examples|slurm|docs|launch|benchmarks|scripts)/[\w./-]*\w)`", path.read_text()
        )
        if "*" not in name and not (ROOT / name).exists()
    ]
    assert not missing, missing


_DURATION = re.compile(r"\d+ min(?: \d+ s)?|~\d+ min")


def test_readme_first_screen_quotes_the_figures_of_its_own_sections() -> None:
    """Every duration the quick start quotes (the tests' time) is one its sections measured:
    the first screen said ~10 min while the Tests section said 32."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first, rest = text.split("\n## What it is", 1)
    quoted = _DURATION.findall(first)
    assert quoted, "the quick start quotes no time any more: drop this test or the claim"
    for figure in quoted:
        assert not figure.startswith("~") and figure in rest, (
            f"README's first screen says {figure!r}, which no section below measured"
        )
