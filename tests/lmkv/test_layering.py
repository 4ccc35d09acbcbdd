"""Dependencies point from the adapters to the core: lmkv never imports an engine."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "lmkv"


def test_the_core_imports_no_engine_and_no_adapter():
    offenders = []
    for path in CORE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(CORE.parent)}: {n}" for n in names
                          if n.split(".")[0] in ("lmkv_engines", "vllm", "lmkv_server")]
    assert not offenders, offenders
