"""The layers import in one direction, checked for every package from one table.

``algo`` (pure math) <- ``parallel`` (vocab-parallel ops) <- ``megatron`` (the only code that
touches megatron-core) <- ``rollout`` / ``rewards`` / ``data`` <- ``envs`` (episodes over
a rollout engine and isolated environment workers) <- trainer <- CLI and launchers;
``config`` is plain Python beside them all.

Two checks per package, because ``import torch`` itself loads ``torch.distributed`` (so
``sys.modules`` cannot tell whether *our* code uses it): a fresh interpreter imports every
module of the package and must not load the forbidden heavy modules, and a static pass over
the sources (imports inside functions included) finds forbidden imports and imports of
higher layers. ``vllm`` may only be imported inside functions (lazily), and only by rollout.
No package reaches ``eval``/``exec``/``compile`` by name, through ``builtins`` or ``getattr``
(model output and config values are data).

Inside ``megatron`` there is a folder per job: the engine (``step``, ``model``, ``decoding``,
``memory`` and the flat ``distributed`` / ``device``), megatron-core's compatibility layer
(``megatron/compat``: versions and the CPU backend), Hugging Face weights (``megatron/hf``) and
training checkpoints (``megatron/checkpoint``); at most six flat modules beside them. Code
outside ``megatron`` imports only the names its ``__init__`` exports, never a submodule, and
no module inside imports that face (it loads them lazily; a module that did would be a cycle).
The CPU backend is enabled only by the start-up paths (a run's, and the memory census's fake
world), neither the weights room nor the checkpoint room imports the engine (the checkpoint
code takes an engine object; it never builds one), and Megatron-Bridge is never loaded at
import time. No module of the package takes part in an import cycle (imports inside functions
included).
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
    "envs": (
        HEAVY,
        (*HEAVY, "torch.distributed"),
        ("algo", "config", "data", "envs", "rewards", "rollout", "utils"),
    ),
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
        if path.relative_to(PKG).parts[0] not in ("megatron", "testing")
        for name, _ in _imports(path)
        if name.split(".")[0] == "megatron"
    ]
    assert not offenders, offenders


DYNAMIC = ("eval", "exec", "compile")
"""Builtins that run text as code."""


def _runs_text_as_code(tree: ast.AST) -> list[str]:
    """Every way ``tree`` reaches :data:`DYNAMIC`: the bare names (called or not), an
    attribute of ``builtins`` / ``__builtins__`` (or a name bound to them), ``getattr(x,
    "eval")``, a subscript ``[...]["exec"]``, ``from builtins import exec``, and loading the
    ``builtins`` module by name. ``re.compile`` / ``model.eval()`` are other objects' methods
    and a field named ``eval`` is not a use."""
    aliases = {"builtins", "__builtins__"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name == "builtins"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in DYNAMIC and isinstance(node.ctx, ast.Load):
            found.append(node.id)
        elif isinstance(node, ast.Attribute) and node.attr in DYNAMIC:
            if isinstance(node.value, ast.Name) and node.value.id in aliases:
                found.append(f"{node.value.id}.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "builtins":
            found += [f"from builtins import {a.name}" for a in node.names if a.name in DYNAMIC]
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            if node.slice.value in DYNAMIC:
                found.append(f"[{node.slice.value!r}]")
        elif isinstance(node, ast.Call):
            args = [a.value for a in node.args if isinstance(a, ast.Constant)]
            name = (
                node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            )
            if name == "getattr" and any(a in DYNAMIC for a in args):
                found.append(f"getattr(..., {next(a for a in args if a in DYNAMIC)!r})")
            elif name in ("__import__", "import_module") and "builtins" in args:
                found.append(f"{name}('builtins')")
    return found


@pytest.mark.parametrize(
    "source",
    [
        "exec('x = 1')",
        "run = eval",
        "import builtins\nbuiltins.exec(text)",
        "import builtins as b\nb.compile(text, 'f', 'exec')",
        "__builtins__.eval(text)",
        "import builtins\ngetattr(builtins, 'eval')(text)",
        "vars(builtins)['exec'](text)",
        "from builtins import exec as run",
        "importlib.import_module('builtins')",
        "__import__('builtins')",
    ],
)
def test_the_dynamic_code_check_sees(source: str) -> None:
    assert _runs_text_as_code(ast.parse(source)), source


def test_the_dynamic_code_check_leaves_methods_alone() -> None:
    ok = "re.compile('x')\nmodel.eval()\ntorch.compile(f)\neval: int = 1\nos.execv(a, b)"
    assert _runs_text_as_code(ast.parse(ok)) == []


def test_no_eval_or_exec_anywhere() -> None:
    offenders = [
        f"{path.relative_to(PKG)}: {how}"
        for path in sorted(PKG.rglob("*.py"))
        for how in _runs_text_as_code(ast.parse(path.read_text()))
    ]
    assert not offenders, offenders


# ----------------------------------------------------------------- the rooms of megatron/
MEGATRON = PKG / "megatron"
ROOMS = ("compat", "hf", "checkpoint")
"""Sub-packages that are not the engine."""
ENGINE_FOLDERS = ("step", "model", "decoding", "memory")
"""The engine's folders, one per job."""
CPU_BACKEND = (
    "reco_megatron.megatron.compat.cpu_backend",
    "reco_megatron.megatron.compat.cpu_patches",
    "reco_megatron.megatron.compat.cpu_rng",
)
# The engine's start-up path: the only engine module that may enable the CPU backend.
STARTUP = (
    "reco_megatron.megatron.distributed",  # a run's start-up
    "reco_megatron.megatron.memory.census",  # a layout census: its own (fake) process group
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _all_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PKG.rglob("*.py")}


ENGINE_MODULES = tuple(
    _module_name(p)
    for p in sorted(MEGATRON.rglob("*.py"))
    if p.relative_to(MEGATRON).parts[0] not in ROOMS and p != MEGATRON / "__init__.py"
)


def test_the_rooms_exist() -> None:
    assert "reco_megatron.megatron.step.engine" in ENGINE_MODULES
    for room in (*ROOMS, *ENGINE_FOLDERS):
        assert (MEGATRON / room / "__init__.py").exists(), room
    assert not [
        p.name
        for p in MEGATRON.glob("*.py")
        if p.stem in ("bridge", "cpu_backend") or p.stem.startswith("checkpoint")
    ]


def test_megatron_keeps_at_most_six_flat_modules() -> None:
    flat = sorted(p.name for p in MEGATRON.glob("*.py") if p.stem != "__init__")
    assert len(flat) <= 6, f"reco_megatron/megatron/ has {len(flat)} flat modules: {flat}"


def _submodule_imports(path: Path) -> list[str]:
    """Imports in ``path`` that name a module below ``reco_megatron.megatron`` (not the face)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("reco_megatron.megatron.")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("reco_megatron.megatron."):
                out.append(node.module)
            elif node.module == "reco_megatron.megatron":
                modules = _all_modules()
                out += [
                    f"reco_megatron.megatron.{a.name}"
                    for a in node.names
                    if f"reco_megatron.megatron.{a.name}" in modules
                ]
    return out


def test_nothing_outside_megatron_imports_its_submodules() -> None:
    """The rest of the package imports the adapter's exported names, never its files."""
    offenders = [
        f"{path.relative_to(PKG)}: {name}"
        for path in sorted(PKG.rglob("*.py"))
        if path.relative_to(PKG).parts[0] != "megatron"
        for name in _submodule_imports(path)
    ]
    assert not offenders, (
        "import these from reco_megatron.megatron (export the name in its __init__ if it is "
        "missing):\n" + "\n".join(offenders)
    )


def test_the_submodule_rule_catches_a_submodule_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from reco_megatron.megatron.step.engine import ReCoEngine\n"
        "from reco_megatron.megatron import checkpoint\n"
        "from reco_megatron.megatron import ReCoEngine\n"
        "def f():\n    import reco_megatron.megatron.device\n"
    )
    assert _submodule_imports(bad) == [
        "reco_megatron.megatron.step.engine",
        "reco_megatron.megatron.checkpoint",
        "reco_megatron.megatron.device",
    ]


def test_no_module_inside_megatron_imports_its_face() -> None:
    offenders = [
        f"{name}: from reco_megatron.megatron import {alias.name}"
        for name, path in _all_modules().items()
        if name.startswith("reco_megatron.megatron.")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module == "reco_megatron.megatron"
        for alias in node.names
        if f"reco_megatron.megatron.{alias.name}" not in _all_modules()
    ]
    assert not offenders, offenders


@pytest.mark.dist
def test_the_face_exports_resolve_and_load_nothing_heavy() -> None:
    """Every exported name exists where the face says, and importing the face loads no torch
    and no megatron-core (its names load on first use)."""
    code = (
        "import sys\n"
        "import reco_megatron.megatron as face\n"
        "heavy = sorted(m for m in ('torch', 'megatron.core') if m in sys.modules)\n"
        "missing = [n for n in face.__all__ if not hasattr(face, n)]\n"
        "print(heavy, missing)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[] []", out.stdout


def test_only_the_startup_path_imports_the_cpu_backend() -> None:
    offenders = [
        f"{name}: {imported}"
        for name, path in _all_modules().items()
        if name not in STARTUP and not name.startswith("reco_megatron.megatron.compat")
        for imported, _ in _imports(path)
        if _matches(imported, CPU_BACKEND)
    ]
    assert not offenders, offenders


def test_the_weights_room_never_imports_the_engine() -> None:
    # The architecture definitions (model and its MoE block) are shared with the weights room.
    shared = ("reco_megatron.megatron.model.config", "reco_megatron.megatron.model.moe")
    engine = tuple(m for m in ENGINE_MODULES if m not in shared)
    offenders = [
        f"{path.name}: {imported}"
        for path in sorted((MEGATRON / "hf").rglob("*.py"))
        for imported, _ in _imports(path)
        if imported in (*engine, *CPU_BACKEND)
    ]
    assert not offenders, offenders


def test_the_checkpoint_room_never_imports_the_engine_or_the_weights() -> None:
    room = ("reco_megatron.megatron.checkpoint",)
    offenders = [
        f"{name}: {imported}"
        for name, path in _all_modules().items()
        if _matches(name, room)
        for imported, _ in _imports(path)
        if _matches(imported, (*ENGINE_MODULES, *CPU_BACKEND, "reco_megatron.megatron.hf"))
    ]
    assert not offenders, offenders


def test_checkpoint_modules_import_each_other_not_the_package() -> None:
    """Inside the room, modules import their siblings (``from ...checkpoint.format import``),
    never the package ``__init__`` that re-exports them all (that would be a cycle)."""
    offenders = [
        f"{name}: from reco_megatron.megatron.checkpoint import {alias.name}"
        for name, path in _all_modules().items()
        if name.startswith("reco_megatron.megatron.checkpoint.")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module == "reco_megatron.megatron.checkpoint"
        for alias in node.names
        if f"reco_megatron.megatron.checkpoint.{alias.name}" not in _all_modules()
    ]
    assert not offenders, offenders


@pytest.mark.dist
def test_megatron_bridge_is_never_imported_at_import_time() -> None:
    """Neither ``megatron.bridge`` nor our ``hf.bridge`` at module level, anywhere; and
    importing every module below the trainer loads neither (a fresh interpreter)."""
    bridge = ("megatron.bridge", "reco_megatron.megatron.hf.bridge")
    offenders = [
        f"{name}: {imported}"
        for name, path in _all_modules().items()
        for imported, top_level in _imports(path)
        if top_level and _matches(imported, bridge)
    ]
    assert not offenders, offenders
    below_trainer = sorted(
        m
        for m in _all_modules()
        if m.split(".")[1:2]
        and m.split(".")[1] in ("megatron", "rollout", "data", "rewards")
        and not _matches(m, bridge)
    )
    code = (
        "import importlib, sys\n"
        f"for m in {below_trainer!r}: importlib.import_module(m)\n"
        f"print(','.join(m for m in sys.modules if m.startswith({bridge!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", out.stdout


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (``from pkg import mod`` resolved to ``mod``)."""
    modules = _all_modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [
                    f"{node.module}.{a.name}"
                    if f"{node.module}.{a.name}" in modules
                    else node.module
                    for a in node.names
                ]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_package() -> None:
    assert _cycles(_import_graph()) == []
