"""``rollout`` sits above the Megatron adapter: it never imports megatron, and vLLM only lazily."""

from __future__ import annotations

import ast
from pathlib import Path

import reco_megatron.rollout

ROLLOUT_DIR = Path(reco_megatron.rollout.__file__).parent


def test_rollout_imports_no_megatron_and_vllm_only_inside_functions() -> None:
    offenders = []
    for path in sorted(ROLLOUT_DIR.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        top_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top == "megatron" or name.startswith("reco_megatron.megatron"):
                    offenders.append(f"{path.name}: {name}")
                elif top == "vllm" and id(node) in top_level:
                    offenders.append(f"{path.name}: module-level import of {name}")
    assert not offenders, "reco_megatron.rollout layering broken:\n" + "\n".join(offenders)
