"""``load_config``: YAML file (or mapping) + dotted overrides -> checked config dataclass."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from reco_megatron.config.bounded_yaml import MAX_BYTES, MAX_BYTES_ENV, limit, load_bounded
from reco_megatron.config.build import FAIL, build_dataclass
from reco_megatron.config.dump import config_to_dict
from reco_megatron.config.errors import ConfigError, Problems, describe_value
from reco_megatron.config.overrides import Override, apply_override, parse_override
from reco_megatron.config.schema import is_dataclass_instance, validate_schema

T = TypeVar("T")


def _copy_tree(value: Any, active: set[int]) -> Any:
    """Copy of the dict/list skeleton (leaves shared); rejects self-referencing YAML."""
    if isinstance(value, (Mapping, list, tuple)) and not is_dataclass_instance(value):
        if id(value) in active:
            raise ConfigError(["the config refers to itself (a recursive YAML alias)"])
        active.add(id(value))
        try:
            if isinstance(value, Mapping):
                return {k: _copy_tree(v, active) for k, v in value.items()}
            return [_copy_tree(v, active) for v in value]
        finally:
            active.discard(id(value))
    return value


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a YAML file, parsed in bounded memory
    (:mod:`~reco_megatron.config.bounded_yaml`: size and node caps, no repeated keys);
    ConfigError if it is not one."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"config file not found: {str(path)!r}"])
    cap = limit(MAX_BYTES_ENV, MAX_BYTES)
    try:
        with path.open("rb") as f:
            raw = f.read(cap + 1)
    except OSError as exc:
        raise ConfigError([f"cannot read config file: {exc}"], str(path)) from exc
    if len(raw) > cap:
        raise ConfigError(
            [
                f"the config file is larger than {cap} bytes: a config is a few KB; raise the "
                f"limit with the environment variable {MAX_BYTES_ENV}=N if it is meant to be"
            ],
            str(path),
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([f"cannot read config file: {exc}"], str(path)) from exc
    try:
        data = load_bounded(text)
    except ConfigError as exc:
        raise ConfigError(exc.problems, str(path)) from None
    except Exception as exc:  # yaml errors, ValueError (bad dates), RecursionError
        reason = " ".join(str(exc).split())
        raise ConfigError([f"invalid YAML: {reason}"], str(path)) from exc
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            [f"the top level must be a mapping of keys to values, got {describe_value(data)}"],
            str(path),
        )
    return _copy_tree(data, set())


def _read_source(source: str | Path | Mapping[str, Any] | None) -> tuple[dict[str, Any], str]:
    if source is None:
        return {}, ""
    if isinstance(source, (str, Path)):
        return read_yaml(source), str(source)
    if is_dataclass_instance(source):
        return config_to_dict(source), ""
    if isinstance(source, Mapping):
        return _copy_tree(source, set()), ""
    raise TypeError(
        f"config source must be a YAML path, a mapping or None, got {type(source).__name__}"
    )


def load_config(
    cls: type[T],
    source: str | Path | Mapping[str, Any] | None = None,
    overrides: Sequence[str] = (),
) -> T:
    """Build config dataclass ``cls`` from a YAML file or mapping, then dotted overrides.

    Precedence, lowest first: the dataclass defaults, ``source`` (a path to a YAML file,
    read with ``yaml.safe_load``; a mapping; an instance of a config class; or None), then
    each override in order (``"loss.eps_high=0.28"``; later ones win). A class with a
    ``complete_raw(raw, problems)`` classmethod may then fill keys the user left out from
    what they named (``TrainConfig``: the architecture of ``checkpoint.init_hf``). Every value is
    checked against its field's annotation (see :mod:`reco_megatron.config.build`) and each
    section's ``__post_init__`` runs.

    Raises:
        ConfigError: with every problem found, each starting with the dotted path of the
            offending key (unknown keys with a "did you mean" and the valid keys, wrong
            types quoting the value, missing required fields, ``__post_init__`` errors).
        TypeError: ``cls`` is not a dataclass or uses an unsupported annotation (a bug in
            the class, not in the config), or ``source`` / ``overrides`` have the wrong type.
    """
    validate_schema(cls)
    if isinstance(overrides, (str, bytes)):
        raise TypeError(
            f"overrides must be a sequence of 'key=value' strings, not one string: "
            f"pass [{overrides!r}]"
        )
    raw, label = _read_source(source)
    problems = Problems()
    parsed: list[Override] = []
    for text in overrides:
        try:
            parsed.append(parse_override(text))
        except ConfigError as exc:
            problems.extend(exc.problems)
    for override in parsed:
        apply_override(raw, cls, override, problems)  # a bad key is reported, not applied
    complete = getattr(cls, "complete_raw", None)  # e.g. the model from init_hf's config.json
    if callable(complete) and not problems:
        complete(raw, problems)
    config = build_dataclass(cls, raw, (), problems)
    problems.raise_if_any(label or None)
    assert config is not FAIL
    return config
