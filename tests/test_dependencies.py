"""Every third-party package glmtune's modules import at module level is one of pyproject.toml's
core dependencies, named there rather than left to arrive with another package: on the GPU image,
whose transformers came with a huggingface_hub that brings httpx but not httpx2, `glmtune eval`
in process failed at import (eval/endpoint_client.py imports httpx2). Imports inside a function or
a try block (an optional dependency with its fallback or its own message) are not counted."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module_level_imports(path: Path) -> set[str]:
    """Top-level package names imported by `path`'s module-level statements (not in try blocks)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("glmtune", "__future__")}


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_module_level_imports_are_core_dependencies():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    core = {_normalized(re.split(r"[<>=!~\[; ]", dep, maxsplit=1)[0]) for dep in deps}
    distributions = importlib.metadata.packages_distributions()
    undeclared = {}
    for path in sorted((ROOT / "glmtune").rglob("*.py")):
        for package in _module_level_imports(path):
            provided_by = {_normalized(d) for d in distributions.get(package, [package])}
            if not provided_by & core:
                undeclared.setdefault(package, []).append(str(path.relative_to(ROOT)))
    assert not undeclared, f"imported at module level but not a core dependency in pyproject.toml: {undeclared}"
