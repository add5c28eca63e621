"""The layers import in one direction: ``algo`` must stay pure tensor math.

Two checks, because ``import torch`` itself loads ``torch.distributed`` (so ``sys.modules``
cannot tell whether *our* code uses it): a fresh interpreter proves that importing
``reco_megatron.algo`` loads no megatron / vllm / transformer-engine, and a static pass over
the sources proves no module of ``algo`` imports ``torch.distributed`` or another layer.
"""

import ast
import subprocess
import sys
from pathlib import Path

import reco_megatron

HEAVY = ("megatron", "vllm", "transformer_engine", "apex")
ALGO_DIR = Path(reco_megatron.__file__).parent / "algo"


def test_algo_loads_no_megatron_or_vllm() -> None:
    code = (
        "import sys, reco_megatron.algo\n"
        f"print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"reco_megatron.algo pulled in: {out.stdout.strip()}"


def _imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_algo_sources_import_only_pure_modules() -> None:
    offenders = []
    for path in sorted(ALGO_DIR.rglob("*.py")):
        for name in _imported_modules(path):
            top = name.split(".")[0]
            if name == "torch.distributed" or name.startswith("torch.distributed.") or top in HEAVY:
                offenders.append(f"{path.name}: {name}")
            elif top == "reco_megatron" and not name.startswith("reco_megatron.algo"):
                offenders.append(f"{path.name}: {name} (another layer)")
    assert not offenders, "reco_megatron.algo must stay pure:\n" + "\n".join(offenders)
