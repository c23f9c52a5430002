"""docs/ARCHITECTURE.md stays true to the code: every repo path it names exists, and every code
reference names a real definition, found with ``ast`` (nothing is imported).

The map's notation, in backticks:

- a path from the repository's root: ``engine/core/scheduler.py``, ``serve_app/router/``,
  ``deploy/autoscaling/*.yaml`` (a glob must match something);
- a code reference: ``engine/core/scheduler.py:Scheduler.schedule``, a module-level class,
  function or assignment, then attributes or methods of classes, dot by dot;
- a dotted module (``serve_app.cluster.ingress``, ``python -m`` style), optionally followed by
  a symbol in the same way (``serve_app.cluster.ingress.prepare_cluster_env``);
- once a class has been named with its file, the short form ``Class.member`` further down the
  page (``Scheduler.finish_step``) is checked against that file too.

Markdown links to files, in the map and in the other pages a reader follows (README.md,
docs/perf/*.md, k8s/README.md, deploy/grafana/README.md), must point at files that exist.
Every wing (a package folder of ``engine/`` or ``serve_app/``) must be named in the map.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "docs" / "ARCHITECTURE.md"
MAP_MAX_LINES = 300  # a map a newcomer reads, not a lab notebook (measurements: docs/perf/)
TOP_DIRS = ("engine", "kernels", "serve_app", "deploy", "k8s", "load_tests", "tests", "docs",
            "scripts")
ROOT_FILES = ("README.md", "Makefile", "pyproject.toml", "constraints-cpu.txt")
PACKAGES = ("engine", "kernels", "serve_app", "deploy", "load_tests", "tests")
LINKED_PAGES = ("README.md", "docs/ARCHITECTURE.md", "docs/perf/*.md", "k8s/README.md",
                "deploy/grafana/README.md")

_TOP = "|".join(TOP_DIRS)
# a repo path, optionally ``file.py:Symbol.attr``
PATH_REF = re.compile(rf"^(?P<path>(?:{_TOP})/[\w.*\-/]*|{'|'.join(map(re.escape, ROOT_FILES))})"
                      rf"(?::(?P<symbol>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*))?$")
SHORT_REF = re.compile(r"^(?P<cls>[A-Z]\w*)(?:\.[A-Za-z_]\w*)+$")
DOTTED_REF = re.compile(rf"^(?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class Ref:
    line: int
    text: str


def code_spans(markdown: str) -> list[Ref]:
    """Every inline code span, with its line; fenced blocks are skipped."""
    refs: list[Ref] = []
    fenced = False
    for number, line in enumerate(markdown.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            refs += [Ref(number, m.group(2).strip()) for m in CODE_SPAN.finditer(line)]
    return refs


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _names(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    """What a module or class body defines: functions, classes and assigned names."""
    out: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            out.update((t.id, node) for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
    return out


def symbol_error(path: Path, symbol: str) -> str | None:
    """None when ``symbol`` (``Name`` or ``Class.attr...``) is defined in ``path``, else why not."""
    body: list[ast.stmt] = _tree(path).body
    done: list[str] = []
    for part in symbol.split("."):
        node = _names(body).get(part)
        where = ".".join(done) or "the module"
        if node is None:
            return f"{path.relative_to(ROOT)} defines no {part!r} in {where}"
        done.append(part)
        if isinstance(node, ast.ClassDef):
            body = node.body
        elif part != symbol.split(".")[-1]:
            return f"{path.relative_to(ROOT)}: {'.'.join(done)} is not a class"
    return None


def path_error(text: str) -> str | None:
    """None when a path reference (``a/b.py``, ``a/b/``, ``a/*.yaml``, ``a/b.py:Sym``) holds."""
    m = PATH_REF.match(text)
    assert m is not None
    path, symbol = m.group("path"), m.group("symbol")
    if "*" in path:
        return None if any(ROOT.glob(path)) else f"no file matches {path}"
    target = ROOT / path
    if not target.exists():
        return f"{path} does not exist"
    if path.endswith("/") and not target.is_dir():
        return f"{path} is not a folder"
    if symbol is not None:
        if target.suffix != ".py":
            return f"{path} is not a Python file, so it has no {symbol}"
        return symbol_error(target, symbol)
    return None


def dotted_error(text: str) -> str | None:
    """None when ``pkg.module[.Symbol...]`` names a module, and the rest a symbol in it."""
    parts = text.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else (
            base / "__init__.py")
        if module.is_file():
            rest = ".".join(parts[i:])
            return symbol_error(module, rest) if rest else None
    return f"no module {parts[0]}"


def _class_file(text: str) -> tuple[str, Path] | None:
    """``(Class, file)`` when a path reference names a class (or a member of one)."""
    m = PATH_REF.match(text)
    if m is None or m.group("symbol") is None or not m.group("path").endswith(".py"):
        return None
    name, path = m.group("symbol").split(".")[0], ROOT / m.group("path")
    node = _names(_tree(path).body).get(name) if path.is_file() else None
    return (name, path) if isinstance(node, ast.ClassDef) else None


def reference_errors(markdown: str, page: str) -> list[str]:
    """One message per reference of ``markdown`` that names nothing real."""
    errors = []
    classes: dict[str, Path] = {}  # classes named with their file so far
    for ref in code_spans(markdown):
        short = SHORT_REF.match(ref.text)
        if PATH_REF.match(ref.text):
            why = path_error(ref.text)
            if why is None and (named := _class_file(ref.text)) is not None:
                classes[named[0]] = named[1]
        elif DOTTED_REF.match(ref.text):
            why = dotted_error(ref.text)
        elif short is not None and short.group("cls") in classes:
            why = symbol_error(classes[short.group("cls")], ref.text)
        else:
            continue
        if why is not None:
            errors.append(f"{page}:{ref.line}: `{ref.text}`: {why}")
    return errors


def link_errors(page: Path) -> list[str]:
    """One message per relative Markdown link of ``page`` whose file does not exist."""
    errors = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        for m in LINK.finditer(line):
            target = m.group(1).split("#", 1)[0]
            if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue  # an anchor on the same page, or a URL
            if not (page.parent / target).exists():
                errors.append(f"{page.relative_to(ROOT)}:{number}: link to {target!r}: "
                              f"{(page.parent / target).resolve()} does not exist")
    return errors


def _fail(errors: list[str]) -> None:
    if errors:
        pytest.fail("stale references in the docs (fix the page or the code):\n"
                    + "\n".join(errors), pytrace=False)


def test_every_path_and_symbol_the_map_names_exists() -> None:
    _fail(reference_errors(MAP.read_text(), "docs/ARCHITECTURE.md"))


def test_the_map_names_enough_to_be_checked() -> None:
    """A parser that stopped finding references would pass the check above vacuously."""
    refs = [r for r in code_spans(MAP.read_text()) if PATH_REF.match(r.text)]
    assert len(refs) >= 80, f"only {len(refs)} path references found in docs/ARCHITECTURE.md"
    assert sum(":" in r.text for r in refs) >= 20, "fewer than 20 file.py:symbol references"


def test_every_wing_is_on_the_map() -> None:
    text = MAP.read_text()
    wings = sorted(f"{p.parent.relative_to(ROOT)}/" for pkg in ("engine", "serve_app")
                   for p in (ROOT / pkg).glob("*/__init__.py"))
    missing = [w for w in wings if f"`{w}`" not in text]
    assert not missing, f"docs/ARCHITECTURE.md does not name these wings: {missing}"


def test_the_map_stays_a_map() -> None:
    lines = len(MAP.read_text().splitlines())
    assert lines <= MAP_MAX_LINES, (
        f"docs/ARCHITECTURE.md has {lines} lines (at most {MAP_MAX_LINES}): measurements go to "
        "docs/perf/, details to the modules' docstrings")


@pytest.mark.parametrize("pattern", LINKED_PAGES)
def test_relative_links_point_at_files(pattern: str) -> None:
    pages = sorted(ROOT.glob(pattern))
    assert pages, f"no page matches {pattern}"
    _fail([e for page in pages for e in link_errors(page)])


def test_a_broken_reference_is_named() -> None:
    """The checker itself: each kind of bad reference is reported with its line and why."""
    page = ("`engine/core/scheduler.py:Scheduler.schedule` is fine, `engine/core/nope.py` is\n"
            "not, nor `engine/core/scheduler.py:Scheduler.shedule`, nor `serve_app.nope.x`;\n"
            "`serve_app/wire.py:StepMessage` and `deploy/autoscaling/*.yaml` hold, so does\n"
            "`Scheduler.finish_step`, not `Scheduler.finish`; `Unnamed.x` is not checked.\n")
    assert reference_errors(page, "p.md") == [
        "p.md:1: `engine/core/nope.py`: engine/core/nope.py does not exist",
        "p.md:2: `engine/core/scheduler.py:Scheduler.shedule`: engine/core/scheduler.py "
        "defines no 'shedule' in Scheduler",
        "p.md:2: `serve_app.nope.x`: serve_app/__init__.py defines no 'nope' in the module",
        "p.md:4: `Scheduler.finish`: engine/core/scheduler.py defines no 'finish' in Scheduler",
    ]
