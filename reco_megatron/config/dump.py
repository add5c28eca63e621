"""Config dataclass -> plain dict -> YAML, such that loading the YAML gives the same object.

Keys keep the dataclass field order (stable from run to run, and grouped the way the class
groups them); tuples become lists and paths strings, which the loader turns back. Short
lists of scalars are written in flow style (``[1, 2]``), everything else in block style.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from reco_megatron.config.schema import init_fields, is_dataclass_instance

_FLOW_MAX_ITEMS = 16
_SCALAR_TYPES = (str, int, float, bool, type(None))


def to_plain(value: Any) -> Any:
    """``value`` with dataclasses as dicts, tuples as lists and paths as strings."""
    if is_dataclass_instance(value):
        return {f.name: to_plain(getattr(value, f.name)) for f in init_fields(type(value))}
    if isinstance(value, Mapping):
        return {key: to_plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(item) for item in value]
    if isinstance(value, Path):
        return str(value)
    return value


def config_to_dict(config: Any) -> dict[str, Any]:
    """Plain nested dict (lists, str, numbers, bools, None) of a config dataclass instance."""
    if not is_dataclass_instance(config):
        raise TypeError(f"config_to_dict expects a dataclass instance, got {type(config)!r}")
    return to_plain(config)


class _Dumper(yaml.SafeDumper):
    """SafeDumper writing short scalar lists inline and never emitting aliases."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    flow = len(data) <= _FLOW_MAX_ITEMS and all(isinstance(x, _SCALAR_TYPES) for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def _yaml(plain: dict[str, Any], allow_unicode: bool) -> str:
    return yaml.dump(
        plain,
        Dumper=_Dumper,
        sort_keys=False,
        default_flow_style=False,
        allow_unicode=allow_unicode,
        width=100,
    )


def dumps_config(config: Any, header: str | None = None) -> str:
    """The YAML text of a config instance; ``header`` lines are written as ``#`` comments."""
    plain = config_to_dict(config)
    text = _yaml(plain, allow_unicode=True)
    if yaml.safe_load(text) != plain:
        # PyYAML writes a few line-break characters (U+0085) raw inside quotes, where they
        # read back as spaces; escaping every non-ASCII character avoids that.
        text = _yaml(plain, allow_unicode=False)
    if header:
        comments = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
        text = comments + text
    return text


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def dump_config(config: Any, path: str | Path, header: str | None = None) -> Path:
    """Write ``config`` as YAML to ``path`` (parents created, atomic replace, the mode a new
    file gets from the umask, like the run's other outputs); returns it.

    ``load_config(type(config), path) == config`` holds for every config the loader built.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = dumps_config(config, header)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a plain file gets 0644
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
