"""The package's shape (docs/architecture.md): small modules, imports that flow one way.

These are the rules a reader relies on to find a concept by its file name; a change that
breaks one fails here rather than in a review."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "mixprec"
MODULES = sorted(SRC.rglob("*.py"))

#: The most lines a module may have: one concept, readable in one sitting.
MAX_LINES = 450
#: The most lines one class may span.
MAX_CLASS_LINES = 300


def _name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _subpackage(module: str) -> str:
    """``mixprec.checkpoint.load`` -> ``mixprec.checkpoint``; a top-level module is its own."""
    parts = module.split(".")
    return ".".join(parts[:2])


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_module_is_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(SRC)} has {lines} lines (> {MAX_LINES})"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            span = (node.end_lineno or node.lineno) - node.lineno + 1
            assert span <= MAX_CLASS_LINES, f"class {node.name} spans {span} lines"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_flow_one_way(path):
    """No module imports the package root (it imports them: a cycle), and no module imports
    another subpackage's private name or private module."""
    here = _name(path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                assert alias.name != "mixprec", f"{here} imports the package root"
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "mixprec":
                # ``from mixprec import data`` names a submodule, not the root's namespace.
                for alias in node.names:
                    assert (SRC / f"{alias.name}.py").exists() or (SRC / alias.name).is_dir(), (
                        f"{here} imports {alias.name!r} from the package root"
                    )
                continue
            if not node.module.startswith("mixprec.") or here.startswith(node.module):
                continue
            if _subpackage(node.module) == _subpackage(here):
                continue
            private = [
                a.name for a in node.names if a.name.startswith("_") and not a.name.endswith("__")
            ]
            assert not private, f"{here} imports private {private} from {node.module}"
            # Nor from another subpackage's private module: what it shares, its package
            # re-exports (the root's private leaves, ``mixprec._dtypes``, are shared).
            inner = node.module.split(".")[2:]
            assert not any(part.startswith("_") for part in inner), (
                f"{here} imports from {node.module}, a private module of another subpackage"
            )
