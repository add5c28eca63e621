"""reco_megatron.config is pure Python + PyYAML: no torch, no megatron."""

import ast
import subprocess
import sys
from pathlib import Path

import reco_megatron

CONFIG_DIR = Path(reco_megatron.__file__).parent / "config"


def test_import_loads_no_torch_or_megatron() -> None:
    code = (
        "import sys, reco_megatron.config\n"
        "heavy = ('torch', 'megatron', 'vllm', 'transformer_engine', 'apex')\n"
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in heavy)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"reco_megatron.config pulled in: {out.stdout.strip()}"


def test_sources_import_only_stdlib_yaml_and_config() -> None:
    offenders = []
    for path in sorted(CONFIG_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in ("torch", "megatron", "vllm", "numpy") or (
                    top == "reco_megatron" and not name.startswith("reco_megatron.config")
                ):
                    offenders.append(f"{path.name}: {name}")
    assert not offenders, offenders
