"""``parse_cli``: split ``[CONFIG.yaml] [dotted.key=value ...] [--help-config]``."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from reco_megatron.config.errors import ConfigError
from reco_megatron.config.overrides import parse_override

USAGE = "usage: python -m reco_megatron.train [CONFIG.yaml] [dotted.key=value ...] [--help-config]"
"""One-line usage shown in command-line errors."""

HELP_FLAGS = ("--help-config", "--help", "-h")
"""Arguments that ask for the configuration reference (:func:`describe_config`)."""

_CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


class HelpRequested(Exception):
    """Raised by :func:`parse_cli` for ``--help-config``: show ``describe_config`` and exit 0."""


class CliArgs(NamedTuple):
    """What :func:`parse_cli` found; unpacks as ``config_path, overrides``."""

    config_path: Path | None
    """The YAML file, or None when the config is defaults plus overrides only."""

    overrides: list[str]
    """``dotted.key=value`` strings, in order, for :func:`load_config`."""


def _looks_like_config(arg: str) -> bool:
    return arg.endswith(_CONFIG_SUFFIXES) or Path(arg).is_file()


def parse_cli(argv: Sequence[str] | None = None) -> CliArgs:
    """Split ``argv`` (default ``sys.argv[1:]``) into a config path and overrides.

    The first argument may be the YAML file (``.yaml``/``.yml``/``.json``, or any existing
    file); every other argument must be ``dotted.key=value`` (checked with the loader's
    override parser, so syntax errors surface before anything starts).

    Raises:
        HelpRequested: ``--help-config`` (or ``--help`` / ``-h``) is among the arguments.
        ConfigError: a malformed argument, with :data:`USAGE` and an example.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if any(arg in HELP_FLAGS for arg in args):
        raise HelpRequested()
    config_path: Path | None = None
    overrides: list[str] = []
    problems: list[str] = []
    for i, arg in enumerate(args):
        if i == 0 and "=" not in arg and not arg.startswith("-") and _looks_like_config(arg):
            config_path = Path(arg)
            continue
        if "=" not in arg and not arg.startswith("-") and _looks_like_config(arg):
            problems.append(f"config file {arg!r} must come first, before the overrides")
            continue
        try:
            parse_override(arg)
        except ConfigError as exc:
            problems.extend(exc.problems)
            continue
        overrides.append(arg)
    if problems:
        raise ConfigError([*problems, USAGE])
    return CliArgs(config_path, overrides)
