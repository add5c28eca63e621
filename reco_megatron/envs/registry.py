"""Environments by name, import path or file path, validated at start-up.

A spec is a built-in name (``"calculator"``), ``"package.module:Class"``, or
``"path/to/file.py:Class"`` (a file outside any package). :func:`resolve_env` imports it and
checks that the attribute is a class with ``reset`` and ``step`` methods; every failure
raises :class:`EnvSpecError` naming the spec and saying what to fix. The class is built and
run only inside the isolated environment workers (:mod:`reco_megatron.envs.pool`).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from reco_megatron.rewards.registry import RewardSpecError

BUILTIN_ENVS: dict[str, str] = {
    "calculator": "reco_megatron.envs.calculator:CalculatorEnv",
    "python": "reco_megatron.envs.python_tool:PythonEnv",
}


class EnvSpecError(RewardSpecError):
    """``rollout.env`` cannot be imported or is not an environment class (a user error:
    ``reco-train`` reports it in one line and exits 2, like a bad reward spec)."""


def _module_from_file(path: Path, spec: str) -> object:
    if not path.is_file():
        raise EnvSpecError(f"rollout.env={spec!r}: the file {str(path)!r} does not exist")
    name = f"reco_env_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise EnvSpecError(f"rollout.env={spec!r}: {str(path)!r} is not a Python file")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise EnvSpecError(
            f"rollout.env={spec!r}: importing {str(path)!r} failed ({type(exc).__name__}: {exc})"
        ) from exc
    return module


def resolve_env(spec: str) -> type:
    """The environment class named by ``spec`` (see the module doc), validated."""
    if not isinstance(spec, str) or not spec.strip():
        raise EnvSpecError(
            f"rollout.env must be a built-in name {sorted(BUILTIN_ENVS)}, 'module:Class' or "
            f"'file.py:Class', got {spec!r}"
        )
    target = BUILTIN_ENVS.get(spec, spec)
    where, sep, attr = target.rpartition(":")
    if not sep or not where or not attr:
        raise EnvSpecError(
            f"rollout.env={spec!r} is neither a built-in ({sorted(BUILTIN_ENVS)}) nor of the "
            "form 'package.module:Class' or 'path/to/file.py:Class'"
        )
    if where.endswith(".py"):
        module = _module_from_file(Path(where), spec)
    else:
        try:
            module = importlib.import_module(where)
        except Exception as exc:
            raise EnvSpecError(
                f"rollout.env={spec!r}: module {where!r} cannot be imported "
                f"({type(exc).__name__}: {exc}); check the spelling and that it is on PYTHONPATH"
            ) from exc
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise EnvSpecError(
            f"rollout.env={spec!r}: {attr!r} is "
            f"{'missing' if cls is None else 'a ' + type(cls).__name__}; name a class with "
            "reset(row) and step(action_ids, finish)"
        )
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise EnvSpecError(
            f"rollout.env={spec!r}: class {attr!r} has no {' or '.join(missing)} method; an "
            "environment needs reset(row) -> prompt ids and step(action_ids, finish) -> Step"
        )
    return cls
