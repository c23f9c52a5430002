"""The code's shape, checked by walking it with ``ast``. The limits are written here and only
here (docs/ARCHITECTURE.md quotes them):

- no product file (``engine/``, ``kernels/``, ``serve_app/``, ``deploy/``) over
  ``MAX_FILE_LINES`` lines, no function over ``MAX_FUNCTION_LINES``;
- the layers import downwards only: ``kernels/`` never imports ``engine`` or ``serve_app``;
  ``engine/`` never imports ``serve_app`` or Ray;
- the engine core (``engine/`` without ``models/`` and ``layers/``) holds at most
  ``MAX_ENGINE_CORE_CODE_LINES`` lines of code (lines that carry part of a statement: not
  blank, not only a comment, not in a docstring).
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("engine", "kernels", "serve_app", "deploy")
MAX_FILE_LINES = 300
MAX_FUNCTION_LINES = 50
MAX_ENGINE_CORE_CODE_LINES = 3000
FORBIDDEN_IMPORTS = {"kernels": ("engine", "serve_app"), "engine": ("serve_app", "ray")}


def _files(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


def _imports(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def code_lines(source: str) -> int:
    """Lines that carry part of a statement: not blank, not only a comment, not a docstring."""
    tree = ast.parse(source)
    docs: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                docs.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER}
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - docs)


@pytest.mark.parametrize("path", _files(*PRODUCT), ids=lambda p: str(p.relative_to(ROOT)))
def test_file_and_function_sizes(path: Path):
    source = path.read_text()
    assert len(source.splitlines()) <= MAX_FILE_LINES, f"{path.name}: over {MAX_FILE_LINES} lines"
    sizes = [(f"{node.name} (line {node.lineno})", (node.end_lineno or node.lineno) - node.lineno + 1)
             for node in ast.walk(ast.parse(source))
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    long = [(name, n) for name, n in sizes if n > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


@pytest.mark.parametrize("layer", sorted(FORBIDDEN_IMPORTS))
def test_layers_import_downwards_only(layer: str):
    bad = []
    for path in _files(layer):
        for name in _imports(ast.parse(path.read_text())):
            if name.split(".")[0] in FORBIDDEN_IMPORTS[layer]:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad


def test_engine_core_size():
    core = [p for p in _files("engine")
            if p.relative_to(ROOT / "engine").parts[0] not in ("models", "layers")]
    total = sum(code_lines(p.read_text()) for p in core)
    assert total <= MAX_ENGINE_CORE_CODE_LINES, f"engine core: {total} lines of code"


def test_the_checks_see_what_they_check():
    src = 'def f():\n    """doc\n    more"""\n    # a comment\n\n    return (1 +\n            2)\n'
    assert code_lines(src) == 3  # def, return, its continuation
    tree = ast.parse("import ray.serve\nfrom serve_app.router import Router\nfrom . import x\n")
    assert _imports(tree) == {"ray.serve", "serve_app.router"}
    assert len(_files(*PRODUCT)) > 50
