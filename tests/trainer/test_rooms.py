"""The trainer's rooms: a folder per job, each with a face, imports one way.

``reco_megatron/trainer/`` holds the loop and what it reads on its top floor, the run's
configuration on its bottom floor, and a sub-package ("room") per job between them:

- bottom floor, the configuration: ``config``, ``sections``, ``rollout_config``,
  ``value_ranges``. They import no room and nothing of the top floor.
- the rooms: ``orchestration`` (where a step's groups come from), ``lifecycle`` (the run's
  directory, lock, resume check, signals and guards), ``reporting`` (metrics, trackers, plots,
  summary, health), ``memory`` (the example configs' memory budgets). A room imports the
  configuration, other rooms' faces (without a cycle between rooms) and the layers below the
  trainer, never the top floor.
- top floor: ``loop`` (:class:`Trainer`), ``setup``, ``preflight``, ``sft_warmup``.

Code outside a room imports the names its ``__init__`` exports, never a module inside it (the
tests may: they test the modules); a module inside a room never imports its own face.
``docs/package-map.md`` lists every folder of the package, checked here against the tree.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import reco_megatron

PKG = Path(reco_megatron.__file__).parent
REPO = PKG.parent
TRAINER = PKG / "trainer"
ROOMS = ("orchestration", "lifecycle", "reporting", "memory")
CONFIG_FLOOR = ("config", "sections", "rollout_config", "value_ranges")
TOP_FLOOR = ("loop", "setup", "preflight", "sft_warmup")
MAX_FLAT = 8
MAX_LINES = 380
TRAINER_CLASS_MAX = 200
OUTSIDE = ("reco_megatron", "benchmarks", "examples", "launch", "scripts")
"""Where code that must use the faces lives (tests may reach inside a room)."""


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` for every absolute import in ``path`` (inside functions too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [a.name for a in node.names]))
    return out


def _type_checking_lines(path: Path) -> set[int]:
    """Line numbers inside ``if TYPE_CHECKING:`` blocks (imports for annotations only)."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _trainer_targets(module: str, names: list[str]) -> list[str]:
    """The trainer modules or rooms an import names (``trainer.x.y``, ``from trainer import x``)."""
    prefix = "reco_megatron.trainer"
    if module == prefix:
        return [f"{prefix}.{n}" for n in names]
    return [module] if module.startswith(prefix + ".") else []


def _room_of(target: str) -> str | None:
    parts = target.split(".")
    return parts[2] if len(parts) > 2 and parts[2] in ROOMS else None


def inner_imports(path: Path, home: str | None) -> list[str]:
    """Imports in ``path`` of a module inside a room other than ``home`` (the file's own)."""
    out = []
    for module, names in _imports(path):
        targets = _trainer_targets(module, names)
        if module.startswith("reco_megatron.trainer.") and _room_of(module):
            # from reco_megatron.trainer.<room> import <submodule> reaches inside too
            room = _room_of(module)
            if module.count(".") == 2:
                targets = [f"{module}.{n}" for n in names if (TRAINER / room / f"{n}.py").exists()]
        for target in targets:
            room = _room_of(target)
            if room and room != home and target.count(".") >= 3:
                out.append(target)
    return out


def _package_files() -> list[tuple[Path, str | None]]:
    files = []
    for top in OUTSIDE:
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).parts
            home = rel[2] if rel[:2] == ("reco_megatron", "trainer") and len(rel) > 3 else None
            files.append((path, home))
    return files


def test_the_rooms_exist_with_a_face() -> None:
    for room in ROOMS:
        face = TRAINER / room / "__init__.py"
        assert face.exists(), f"trainer/{room}/ has no __init__.py"
        assert "__all__" in face.read_text(), f"trainer/{room}/__init__.py exports no __all__"


def test_the_trainer_keeps_at_most_eight_flat_modules() -> None:
    flat = sorted(p.stem for p in TRAINER.glob("*.py") if p.stem != "__init__")
    assert len(flat) <= MAX_FLAT, f"trainer/ has {len(flat)} flat modules: {flat}"
    assert set(flat) == {*CONFIG_FLOOR, *TOP_FLOOR}, (
        f"trainer/'s flat modules {flat} are not the configuration {CONFIG_FLOOR} and the "
        f"top floor {TOP_FLOOR}: put a new module in the room of its job"
    )


def test_nothing_outside_a_room_imports_its_modules() -> None:
    offenders = [
        f"{path.relative_to(REPO)}: {target}"
        for path, home in _package_files()
        for target in inner_imports(path, home)
    ]
    assert not offenders, (
        "import these from the room's face (export the name in its __init__ if it is "
        "missing):\n" + "\n".join(offenders)
    )


def test_the_inner_import_rule_catches_each_form(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from reco_megatron.trainer.lifecycle.run_lock import RunLock\n"
        "from reco_megatron.trainer.reporting import summary\n"
        "from reco_megatron.trainer.orchestration import WorkerLost\n"
        "def f():\n    import reco_megatron.trainer.memory.budget\n"
    )
    assert inner_imports(bad, None) == [
        "reco_megatron.trainer.lifecycle.run_lock",
        "reco_megatron.trainer.reporting.summary",
        "reco_megatron.trainer.memory.budget",
    ]
    assert inner_imports(bad, "lifecycle") == [
        "reco_megatron.trainer.reporting.summary",
        "reco_megatron.trainer.memory.budget",
    ]


def test_no_module_in_a_room_imports_its_own_face() -> None:
    offenders = [
        f"{path.relative_to(REPO)}: from reco_megatron.trainer.{room} import {names}"
        for room in ROOMS
        for path in sorted((TRAINER / room).glob("*.py"))
        if path.stem != "__init__"
        for module, names in _imports(path)
        if module == f"reco_megatron.trainer.{room}"
        and any(not (TRAINER / room / f"{n}.py").exists() for n in names)
    ]
    assert not offenders, offenders


def _trainer_arrows() -> list[tuple[str, str, str]]:
    """``(file, from-part, to-part)`` for every runtime import between parts of the trainer,
    a part being a room or a flat module (imports for annotations only are left out)."""
    arrows = []
    for path in sorted(TRAINER.rglob("*.py")):
        rel = path.relative_to(TRAINER).parts
        part = rel[0] if len(rel) > 1 else path.stem
        if part == "__init__":
            continue
        hidden = _type_checking_lines(path)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom) or node.lineno in hidden:
                continue
            if isinstance(node, ast.Import):
                pairs = [(a.name, []) for a in node.names]
            elif node.module and node.level == 0:
                pairs = [(node.module, [a.name for a in node.names])]
            else:
                continue
            for module, names in pairs:
                for target in _trainer_targets(module, names):
                    other = target.split(".")[2]
                    if other != part:
                        arrows.append((str(path.relative_to(REPO)), part, other))
    return arrows


def test_imports_run_one_way_through_the_floors() -> None:
    """Configuration <- rooms <- top floor: nothing points back up."""
    offenders = []
    for where, src, dst in _trainer_arrows():
        if src in CONFIG_FLOOR and dst not in CONFIG_FLOOR:
            offenders.append(f"{where}: the configuration imports {dst}")
        elif src in ROOMS and dst in TOP_FLOOR:
            offenders.append(f"{where}: room {src} imports the top floor's {dst}")
    assert not offenders, "\n".join(offenders)


def test_the_rooms_import_each_other_without_a_cycle() -> None:
    edges: dict[str, set[str]] = {room: set() for room in ROOMS}
    for _, src, dst in _trainer_arrows():
        if src in ROOMS and dst in ROOMS:
            edges[src].add(dst)
    seen: dict[str, int] = {}

    def visit(room: str, path: tuple[str, ...]) -> None:
        if seen.get(room) == 1:
            raise AssertionError("rooms import each other in a circle: " + " -> ".join(path))
        if seen.get(room) == 2:
            return
        seen[room] = 1
        for other in sorted(edges[room]):
            visit(other, (*path, other))
        seen[room] = 2

    for room in ROOMS:
        visit(room, (room,))


def test_every_module_of_the_package_stays_under_the_line_limit() -> None:
    long = {
        str(p.relative_to(REPO)): n
        for p in sorted(PKG.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"


def test_the_trainer_class_reads_as_its_steps() -> None:
    tree = ast.parse((TRAINER / "loop.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer"]
    lines = cls.end_lineno - cls.lineno + 1
    assert lines < TRAINER_CLASS_MAX, f"Trainer is {lines} lines (< {TRAINER_CLASS_MAX})"


def test_the_package_map_lists_every_folder() -> None:
    """``docs/package-map.md`` names each folder of the package exactly once, as a heading
    row of its table (`reco_megatron/<path>/`), and no folder that is gone."""
    text = (REPO / "docs" / "package-map.md").read_text()
    documented = set(re.findall(r"`(reco_megatron(?:/[a-z_]+)*/)`", text))
    actual = {
        str(p.relative_to(REPO)) + "/"
        for p in [PKG, *PKG.rglob("*")]
        if p.is_dir() and (p / "__init__.py").exists()
    }
    assert documented == actual, (
        f"docs/package-map.md misses {sorted(actual - documented)} and names "
        f"{sorted(documented - actual)}, which do not exist"
    )


@pytest.mark.parametrize("room", ROOMS)
def test_each_face_exports_names_that_exist(room: str) -> None:
    import importlib

    face = importlib.import_module(f"reco_megatron.trainer.{room}")
    missing = [n for n in face.__all__ if not hasattr(face, n)]
    assert not missing, f"reco_megatron.trainer.{room} exports missing names {missing}"
