"""The code's shape, checked by walking it with ``ast``. The rules are written here and only
here (docs/ARCHITECTURE.md quotes them):

- no product file (``engine/``, ``kernels/``, ``serve_app/``, ``deploy/``) over
  ``MAX_FILE_LINES`` lines, no function over ``MAX_FUNCTION_LINES``: a file that grows past
  that is split by concept;
- each wing (a folder of ``engine/`` or ``serve_app/``, or the modules at the package's top)
  holds at most ``WING_CODE_LINES`` lines of code (lines that carry part of a statement: not
  blank, not only a comment, not in a docstring);
- no import circle between modules, counting every import: function-local and type-only ones
  too;
- the layers import downwards only (``kernels`` never imports ``engine`` or ``serve_app``;
  ``engine`` never imports ``serve_app`` or Ray), each through one door: ``serve_app`` imports
  only the ``engine`` package itself (what ``engine/__init__.py`` exports);
- inside a package, a wing imports only the wings ``WING_IMPORTS`` lets it (its own modules
  always).
"""

from __future__ import annotations

import ast
import io
import tokenize
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("engine", "kernels", "serve_app", "deploy")
MAX_FILE_LINES = 250
MAX_FUNCTION_LINES = 50
FORBIDDEN_IMPORTS = {"kernels": ("engine", "serve_app"), "engine": ("serve_app", "ray")}
# The one door of each package for the packages above it: the modules they may import.
DOORS = {("serve_app", "engine"): {"engine"},
         ("engine", "kernels"): {"kernels", "kernels.ops", "kernels.settings"}}
TOP = "(top)"  # the modules directly in a package, as one wing
WING_CODE_LINES = {
    "engine": {TOP: 1400, "core": 900, "executor": 900, "grammar": 600, "layers": 900,
               "models": 1200, "sample": 600},
    "serve_app": {TOP: 600, "autoscaling": 600, "cluster": 450, "config": 450, "metrics": 450,
                  "protocol": 900, "router": 1600, "worker": 450},
}
# Which wings a wing's modules may import (besides its own). The top's modules are split in
# two: the foundations below every wing and the faces above them all.
ENGINE_BASE = {"config", "envs", "distributed", "loader"}
SERVE_BASE = {"wire", "import_time"}
WING_IMPORTS = {
    "engine": {
        "base": set(),
        "grammar": set(),
        "core": {"base", "grammar"},
        "sample": {"base", "grammar", "core"},
        "layers": {"base"},
        "models": {"base", "core", "layers"},
        "executor": {"base", "core", "sample", "layers", "models"},
        "faces": {"base", "grammar", "core", "sample", "layers", "models", "executor", "faces"},
    },
    "serve_app": {
        "base": {"base"},
        "protocol": {"base"},
        "cluster": {"base"},
        "metrics": {"base"},
        "autoscaling": set(),
        "config": {"base", "autoscaling", "protocol", "metrics"},
        "router": {"base", "protocol", "cluster", "metrics", "config"},
        "worker": {"base", "router", "metrics", "config"},
        "faces": {"base", "protocol", "cluster", "metrics", "autoscaling", "config", "router",
                  "worker", "faces"},
    },
}


def _files(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module) -> set[str]:
    """Every module a file names in an import, wherever the import stands; ``from a import b``
    names ``a.b`` where that is a module of the project, else ``a``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            subs = {f"{node.module}.{a.name}" for a in node.names} & set(_modules())
            names.update(subs)
            if len(subs) < len(node.names):
                names.add(node.module)
    return names


@cache
def _modules() -> dict[str, Path]:
    return {module_name(p): p for p in _files("engine", "kernels", "serve_app")}


@cache
def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(ast.parse(p.read_text())) & set(mods) - {m} for m, p in mods.items()}


def wing(module: str) -> str:
    """The wing of a module of ``engine`` or ``serve_app``, as ``WING_IMPORTS`` names it."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and (_modules().get(module, ROOT).name == "__init__.py")):
        return parts[1]
    if len(parts) == 1:
        return "faces"  # the package's door
    base = ENGINE_BASE if parts[0] == "engine" else SERVE_BASE
    if parts[1] in base:
        return "base"
    return "config" if parts[0] == "serve_app" and parts[1] == "config" else "faces"


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


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (module -> modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


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


@pytest.mark.parametrize("outside, inside", sorted(DOORS))
def test_one_door(outside: str, inside: str):
    bad = [f"{m} imports {n}" for m, names in sorted(_graph().items()) if m.split(".")[0] == outside
           for n in sorted(names) if n.split(".")[0] == inside and n not in DOORS[outside, inside]]
    assert not bad, f"{outside} passes {inside}'s door: {bad}"


def test_no_import_circle():
    assert find_cycle(_graph()) is None


@pytest.mark.parametrize("package", sorted(WING_IMPORTS))
def test_wings_import_what_their_rules_allow(package: str):
    rules = WING_IMPORTS[package]
    bad = []
    for m, names in sorted(_graph().items()):
        if m.split(".")[0] != package:
            continue
        mine = wing(m)
        assert mine in rules, f"{m}: wing {mine} has no rule in WING_IMPORTS"
        for n in sorted(names):
            theirs = wing(n) if n.split(".")[0] == package else None
            if theirs is not None and theirs != mine and theirs not in rules[mine]:
                bad.append(f"{m} ({mine}) imports {n} ({theirs})")
    assert not bad


@pytest.mark.parametrize("package", sorted(WING_CODE_LINES))
def test_wing_sizes(package: str):
    sizes: dict[str, int] = {}
    for path in _files(package):
        parts = path.relative_to(ROOT / package).parts
        key = parts[0] if len(parts) > 1 else TOP
        sizes[key] = sizes.get(key, 0) + code_lines(path.read_text())
    caps = WING_CODE_LINES[package]
    assert set(sizes) <= set(caps), f"wings without a cap: {set(sizes) - set(caps)}"
    over = {k: f"{n} > {caps[k]}" for k, n in sizes.items() if n > caps[k]}
    assert not over, f"{package}: wings over their cap of code lines: {over}"


def test_the_checks_see_what_they_check():
    src = 'def f():\n    """doc\n    more"""\n    # a comment\n\n    return (1 +\n            2)\n'
    assert code_lines(src) == 3  # def, return, its continuation
    tree = ast.parse("import ray.serve\nfrom serve_app.router import router\nfrom . import x\n"
                     "def f():\n    from engine import SamplingParams\n")
    assert _imports(tree) == {"ray.serve", "serve_app.router.router", "engine"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    assert wing("engine.core.scheduler") == "core" and wing("engine.config") == "base"
    assert wing("engine.llm_engine") == "faces" and wing("serve_app.router.router") == "router"
    assert wing("serve_app.wire") == "base" and wing("serve_app.config") == "config"
    assert len(_files(*PRODUCT)) > 50
