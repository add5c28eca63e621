"""Make an unpacked Megatron-Bridge importable on a CPU box, for the cross-check test only.

Megatron-Bridge 0.6.2 does not import without transformer-engine, and it pins
``transformers<=5.12.1``. Neither matters for the Llama/Qwen2 conversion it is checked on, so
when ``RECO_TEST_MEGATRON_BRIDGE`` names a directory holding the unpacked wheel (``.ci/run``
makes one), :func:`install` puts it on ``sys.path`` and answers exactly two imports with inert
modules:

* ``megatron.bridge.peft.lora_layers`` (imports ``transformer_engine.pytorch`` at top level;
  LoRA is not on the conversion path);
* ``transformers.modeling_attn_mask_utils`` (removed in transformers 5.13+; imported by the
  Bailing-MoE model bridge only).

Everything else -- ``AutoBridge``, the Llama/Qwen2 bridges, the parameter mappings, the TP/PP
gathering -- is the bridge's real code. In a GPU container with the bridge installed, nothing
is stubbed: :func:`install` does nothing when ``megatron.bridge`` imports on its own.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from typing import ClassVar

ENV = "RECO_TEST_MEGATRON_BRIDGE"
STUBBED = ("megatron.bridge.peft.lora_layers", "transformers.modeling_attn_mask_utils")


class _Inert(types.ModuleType):
    """A module whose every attribute is another inert object (usable as a base class)."""

    __path__: ClassVar[list[str]] = []

    def __getattr__(self, name: str) -> _Inert:
        if name.startswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        return sys.modules.setdefault(full, _Inert(full))  # type: ignore[return-value]

    def __call__(self, *args: object, **kwargs: object) -> _Inert:
        return self

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)

    def __getitem__(self, key: object) -> _Inert:
        return self

    def __or__(self, other: object) -> _Inert:
        return self

    __ror__ = __or__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if any(name == s or name.startswith(s + ".") for s in STUBBED):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Inert(spec.name)

    def exec_module(self, module) -> None:
        pass


def install(probe: bool = True) -> bool:
    """True when ``megatron.bridge`` is importable afterwards (natively or via the shim).

    ``probe=False`` only puts the unpacked wheel in place (and returns True), leaving the first
    ``import megatron.bridge`` of the process to the caller."""
    import megatron.core  # the real namespace package first
    import transformers  # noqa: F401

    src = os.environ.get(ENV)
    if src and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.path.insert(0, src)
        sys.meta_path.insert(0, _Finder())
        import megatron

        bridge_pkg = os.path.join(src, "megatron")
        if bridge_pkg not in list(megatron.__path__):
            megatron.__path__.append(bridge_pkg)
    if not probe:
        return True
    try:
        from megatron.bridge import AutoBridge  # noqa: F401
    except Exception:
        return False
    return True
