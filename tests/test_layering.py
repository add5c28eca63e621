"""The layers import in one direction, checked for every package from one table.

``algo`` (pure math) <- ``parallel`` (vocab-parallel ops) <- ``megatron`` (the only code that
touches megatron-core) <- ``rollout`` / ``rewards`` / ``data`` / trainer <- CLI and launchers;
``config`` is plain Python beside them all.

Two checks per package, because ``import torch`` itself loads ``torch.distributed`` (so
``sys.modules`` cannot tell whether *our* code uses it): a fresh interpreter imports every
module of the package and must not load the forbidden heavy modules, and a static pass over
the sources (imports inside functions included) finds forbidden imports and imports of
higher layers. ``vllm`` may only be imported inside functions (lazily), and only by rollout.
No package calls ``eval``/``exec``/``compile`` (model output and config values are data).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import reco_megatron

PKG = Path(reco_megatron.__file__).parent
HEAVY = ("megatron", "vllm", "transformer_engine", "apex")

# package -> (modules never loaded, imports never written, reco_megatron layers it may import)
RULES: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "algo": (HEAVY, (*HEAVY, "torch.distributed"), ("algo",)),
    "parallel": (HEAVY, HEAVY, ("algo", "parallel", "utils")),
    "config": (("torch", *HEAVY), ("torch", "numpy", *HEAVY), ("config", "utils")),
    "data": (
        (*HEAVY, "torch.distributed"),
        (*HEAVY, "torch.distributed"),
        ("algo", "config", "data", "utils"),
    ),
    "rewards": (
        (*HEAVY, "torch.distributed"),
        (*HEAVY, "torch.distributed"),
        ("algo", "config", "data", "rewards", "utils"),
    ),
    "rollout": (HEAVY, ("megatron", "transformer_engine", "apex"), ("algo", "rollout", "utils")),
}


def _modules(package: str) -> list[str]:
    return sorted(
        f"reco_megatron.{package}.{p.stem}" if p.stem != "__init__" else f"reco_megatron.{package}"
        for p in (PKG / package).glob("*.py")
        if not p.stem.startswith("_") or p.stem == "__init__"
    )


def _imports(path: Path) -> list[tuple[str, bool]]:
    """``(module, at_top_level)`` for every absolute import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {id(node) for node in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, id(node) in top))
    return out


def _matches(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("package", sorted(RULES))
def test_importing_the_package_loads_no_forbidden_module(package: str) -> None:
    never_loaded = RULES[package][0]
    code = (
        "import importlib, sys\n"
        f"for m in {_modules(package)!r}: importlib.import_module(m)\n"
        f"bad = {never_loaded!r}\n"
        "print(','.join(sorted(m for m in sys.modules "
        "if any(m == b or m.startswith(b + '.') for b in bad))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"reco_megatron.{package} loaded: {out.stdout.strip()}"


@pytest.mark.parametrize("package", sorted(RULES))
def test_sources_respect_the_layers(package: str) -> None:
    _, never_imported, layers = RULES[package]
    offenders = []
    for path in sorted((PKG / package).rglob("*.py")):
        for name, top_level in _imports(path):
            if _matches(name, never_imported):
                offenders.append(f"{path.name}: {name}")
            elif name.split(".")[0] == "vllm" and (package != "rollout" or top_level):
                offenders.append(f"{path.name}: {name} (vllm only lazily, only in rollout)")
            elif name.startswith("reco_megatron.") and name.split(".")[1] not in layers:
                offenders.append(f"{path.name}: {name} (a higher layer)")
    assert not offenders, f"reco_megatron.{package} breaks the layering:\n" + "\n".join(offenders)


def test_only_the_adapter_imports_megatron_core() -> None:
    offenders = [
        f"{path.relative_to(PKG)}: {name}"
        for path in sorted(PKG.rglob("*.py"))
        # the adapter, and the test harness (it preloads megatron-core into its forkserver)
        if path.parent.name not in ("megatron", "testing")
        for name, _ in _imports(path)
        if name.split(".")[0] == "megatron"
    ]
    assert not offenders, offenders


def test_no_eval_or_exec_anywhere() -> None:
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in ("eval", "exec", "compile"), f"{path}: {node.func.id}"
