"""``data`` and ``rewards`` sit beside the trainer: no megatron, no torch.distributed.

A fresh interpreter imports every module of both packages (and uses the loggers' import
path) and must not load megatron, vllm, transformer-engine or torch.distributed; a static
pass over the sources checks the same for imports hidden inside functions.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import reco_megatron

PKG = Path(reco_megatron.__file__).parent
MODULES = sorted(
    f"reco_megatron.{p.parent.name}.{p.stem}"
    for sub in ("data", "rewards")
    for p in (PKG / sub).glob("*.py")
    if p.stem != "__init__"
)
FORBIDDEN = ("megatron", "vllm", "transformer_engine", "torch.distributed")


def test_modules_import_without_megatron_or_torch_distributed() -> None:
    code = (
        "import importlib, sys\n"
        f"for m in {MODULES!r}: importlib.import_module(m)\n"
        f"bad = [m for m in sys.modules if m.split('.')[0] in {FORBIDDEN[:3]!r}"
        " or m.startswith('torch.distributed')]\n"
        "print(','.join(sorted(bad)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"data/rewards pulled in: {out.stdout.strip()}"


def test_sources_import_no_heavy_module_anywhere() -> None:
    offenders = []
    for sub in ("data", "rewards"):
        for path in sorted((PKG / sub).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                offenders += [
                    f"{path.name}: {n}"
                    for n in names
                    if n.split(".")[0] in FORBIDDEN[:3]
                    or n.startswith("torch.distributed")
                    or n.startswith("reco_megatron.megatron")
                    or n.startswith("reco_megatron.parallel")
                ]
    assert not offenders, "\n".join(offenders)


def test_sources_never_eval_or_exec() -> None:
    for sub in ("data", "rewards"):
        for path in sorted((PKG / sub).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                    assert node.func.id not in ("eval", "exec", "compile"), path.name
