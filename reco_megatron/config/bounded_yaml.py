"""YAML parsed in bounded time and memory: a size cap, a node cap, no duplicate keys.

``yaml.safe_load`` keeps an alias (``*a``) as a reference to the anchored value, so nine
levels of nine aliases is a 1 KB file whose tree has 9**9 nodes once anything copies it (the
config loader does, to apply overrides). :func:`load_bounded` therefore composes the YAML
node graph first (linear in the text: aliases stay shared there), counts the nodes the
*expanded* tree would have, and refuses more than :data:`MAX_NODES` before anything is
constructed; files larger than :data:`MAX_BYTES` are refused before they are read. Both
limits can be raised with the environment variables :data:`MAX_BYTES_ENV` and
:data:`MAX_NODES_ENV` (every shipped config is under 6 KB and 400 nodes).

A mapping that repeats a key (two ``trainer:`` blocks) is refused with both line numbers:
``safe_load`` silently keeps the last one, dropping everything the first one set.
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from reco_megatron.config.errors import ConfigError

__all__ = ["MAX_BYTES", "MAX_BYTES_ENV", "MAX_NODES", "MAX_NODES_ENV", "load_bounded"]

MAX_BYTES = 1 << 20
"""Default size cap of a config file (1 MiB; the largest shipped config is 5.5 KB)."""
MAX_BYTES_ENV = "RECO_CONFIG_MAX_BYTES"
"""Environment variable that raises :data:`MAX_BYTES` (a number of bytes)."""
MAX_NODES = 100_000
"""Default cap on the nodes of the expanded YAML tree (every alias counted as a copy)."""
MAX_NODES_ENV = "RECO_CONFIG_MAX_NODES"
"""Environment variable that raises :data:`MAX_NODES`."""


def limit(env: str, default: int) -> int:
    """The limit from ``env`` (a positive integer) or ``default``; ConfigError if malformed."""
    raw = os.environ.get(env, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError([f"{env}={raw!r} must be a positive whole number (or unset)"])
    return value


def _where(node: yaml.Node) -> str:
    return f"line {node.start_mark.line + 1}"


def _check(root: yaml.Node, max_nodes: int) -> None:
    """Count the expanded nodes under ``root`` (memoised per shared node, so the walk is
    linear in the composed graph) and look for repeated keys; raise ConfigError."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise ConfigError(["the config refers to itself (a recursive YAML alias)"])
        active.add(key)
        total = 1
        if isinstance(node, yaml.MappingNode):
            _duplicates(node)  # once per node: a node seen before returns from sizes above
            for k, v in node.value:
                total += size(k) + size(v)
                if total > max_nodes:
                    break
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                total += size(item)
                if total > max_nodes:
                    break
        active.discard(key)
        if total > max_nodes:
            raise ConfigError(
                [
                    f"the YAML expands to more than {max_nodes} values (aliases counted as "
                    f"copies; near {_where(node)}): is it an alias bomb? Raise the limit with "
                    f"the environment variable {MAX_NODES_ENV}=N if the config is meant to be "
                    "this large"
                ]
            )
        sizes[key] = total
        return total

    size(root)


def _duplicates(node: yaml.MappingNode) -> None:
    seen: dict[str, yaml.Node] = {}
    for k, _ in node.value:
        if not isinstance(k, yaml.ScalarNode) or k.tag == "tag:yaml.org,2002:merge":
            continue
        if k.value in seen:
            raise ConfigError(
                [
                    f"key {k.value!r} appears twice in one mapping ({_where(seen[k.value])} "
                    f"and {_where(k)}): the second would silently replace the first; merge "
                    "them into one"
                ]
            )
        seen[k.value] = k


def load_bounded(text: str, *, max_nodes: int | None = None) -> Any:
    """``yaml.safe_load(text)`` after :func:`_check` (node cap, duplicate keys).

    Raises:
        ConfigError: too many expanded nodes, a repeated key, or a recursive alias.
        yaml.YAMLError: the text is not YAML (the caller words it).
    """
    cap = max_nodes if max_nodes is not None else limit(MAX_NODES_ENV, MAX_NODES)
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if root is None:
        return None
    _check(root, cap)
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_document(root)
    finally:
        loader.dispose()
