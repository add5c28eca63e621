"""Typed configuration: YAML files and dotted overrides -> checked config dataclasses.

Pure Python + PyYAML (no torch, no megatron). Config classes are ``@dataclass(kw_only=True)``
with a docstring string under each field and a ``__post_init__`` that raises ValueError::

    config = load_config(TrainConfig, "examples/reco.yaml", ["loss.eps_high=0.28"])
    dump_config(config, run_dir / "config.yaml")       # load_config(TrainConfig, it) == config
    reference = describe_config(TrainConfig)           # dotted keys, types, defaults, docs

The syntax, the error messages and the section-to-dataclass mapping: ``docs/configuration.md``.
"""

from reco_megatron.config.cli import USAGE, CliArgs, HelpRequested, parse_cli
from reco_megatron.config.docs import describe_config, field_docs
from reco_megatron.config.dump import config_to_dict, dump_config, dumps_config
from reco_megatron.config.errors import ConfigError
from reco_megatron.config.loader import load_config, read_yaml
from reco_megatron.config.overrides import Override, parse_override

__all__ = [
    "USAGE",
    "CliArgs",
    "ConfigError",
    "HelpRequested",
    "Override",
    "config_to_dict",
    "describe_config",
    "dump_config",
    "dumps_config",
    "field_docs",
    "load_config",
    "parse_cli",
    "parse_override",
    "read_yaml",
]
