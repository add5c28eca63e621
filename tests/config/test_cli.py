"""parse_cli: CONFIG.yaml key=value ... and --help-config."""

from __future__ import annotations

from pathlib import Path

import pytest

from reco_megatron.config import USAGE, ConfigError, HelpRequested, load_config, parse_cli
from tests.config._sample import SampleConfig


def test_config_and_overrides() -> None:
    config_path, overrides = parse_cli(["cfg.yaml", "loss.eps_high=0.28", "tags=[a, b]"])
    assert config_path == Path("cfg.yaml")
    assert overrides == ["loss.eps_high=0.28", "tags=[a, b]"]


def test_overrides_only_and_empty() -> None:
    assert parse_cli(["seed=1"]) == (None, ["seed=1"])
    assert parse_cli([]) == (None, [])


def test_existing_file_without_suffix(tmp_path: Path) -> None:
    path = tmp_path / "config"
    path.write_text("seed: 5\n")
    args = parse_cli([str(path), "debug=true"])
    assert args.config_path == path
    assert load_config(SampleConfig, args.config_path, args.overrides).seed == 5


@pytest.mark.parametrize("flag", ["--help-config", "--help", "-h"])
def test_help(flag: str) -> None:
    with pytest.raises(HelpRequested):
        parse_cli(["cfg.yaml", flag])


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["loss.eps_high"], r"override 'loss.eps_high' has no '='"),
        (["cfg.yaml", "seed"], r"override 'seed' has no '='"),
        (["seed=1", "cfg.yaml"], r"config file 'cfg.yaml' must come first"),
        (["a.yaml", "b.yaml"], r"config file 'b.yaml' must come first"),
        (["--seed=1"], r"drop the dashes"),
        (["--verbose"], r"drop the dashes"),
        (["seed=[1"], r"cannot parse '\[1' as a YAML value"),
    ],
)
def test_malformed_arguments(argv: list[str], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern) as info:
        parse_cli(argv)
    assert info.value.problems[-1] == USAGE


def test_all_malformed_arguments_reported() -> None:
    with pytest.raises(ConfigError) as info:
        parse_cli(["x", "y=", "z=1"])
    assert len(info.value.problems) == 3  # two problems and the usage line
