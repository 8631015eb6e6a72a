# SPDX-License-Identifier: Apache-2.0
"""The house rules a newcomer relies on, checked on the source (docs/architecture.md):

- one /proc boundary: only ``tieringd/kernel/procfs.py`` and ``kernel/sysfs.py`` name a /proc path,
  and only they open kernel files (psutil, which reads /proc itself, is used nowhere else);
- no private name crosses a module (``from x import _y``, ``x._y``), but for a package's private
  modules used inside that package;
- functions short enough to name (≤ 80 lines), modules under 800 lines;
- the module map in docs/architecture.md names every module of the tree, and only those.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "tieringd"
BOUNDARY = {"tieringd/kernel/procfs.py", "tieringd/kernel/sysfs.py"}
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 800


def modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def rel(p: Path) -> str:
    return p.relative_to(REPO).as_posix()


def dotted(p: Path) -> str:
    parts = list(p.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


_PROC_PATH = re.compile(r"/proc(/\S*)?")       # a path, not a label such as "/proc/vmstat (pages)"


def proc_paths(tree: ast.AST) -> list[int]:
    """Lines of string literals (f-strings included) that start a /proc path."""
    skip = docstrings(tree)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            first = node.values[0] if node.values else None
            if isinstance(first, ast.Constant) and _PROC_PATH.fullmatch(str(first.value)):
                lines.append(node.lineno)
            for v in node.values:
                skip.add(id(v))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip \
                and _PROC_PATH.fullmatch(node.value):
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("path", modules(), ids=rel)
def test_only_the_kernel_boundary_names_proc(path):
    if rel(path) in BOUNDARY:
        return
    tree = ast.parse(path.read_text())
    assert proc_paths(tree) == [], f"{rel(path)} builds /proc paths itself: use tieringd.kernel.procfs"
    imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names} | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "psutil" not in imported, f"{rel(path)} reads /proc through psutil: use tieringd.kernel.procfs"


def private_crossings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    here = dotted(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    aliases: dict[str, str] = {}          # local name -> tieringd module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.startswith("tieringd"):
            for a in node.names:
                target = f"{node.module}.{a.name}"
                if _private(a.name) and not _own_private_module(target, package):
                    found.append(f"line {node.lineno}: from {node.module} import {a.name}")
                aliases[a.asname or a.name] = target
        elif isinstance(node, ast.ImportFrom) and node.level:
            for a in node.names:
                aliases[a.asname or a.name] = f"{package}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("tieringd"):
                    aliases[a.asname or a.name] = a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in aliases and _private(node.attr):
            found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_private_module(target: str, package: str) -> bool:
    """``from tieringd.sampling import _libbpf`` inside tieringd.sampling: a package's private module."""
    parent, _, leaf = target.rpartition(".")
    return leaf.startswith("_") and parent == package and (PKG.parent / (target.replace(".", "/") + ".py")).exists()


@pytest.mark.parametrize("path", modules(), ids=rel)
def test_no_private_name_crosses_a_module(path):
    assert private_crossings(path) == []


@pytest.mark.parametrize("path", modules(), ids=rel)
def test_functions_are_short_and_modules_small(path):
    text = path.read_text()
    assert len(text.splitlines()) < MAX_MODULE_LINES, f"{rel(path)}: {len(text.splitlines())} lines"
    long = [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(ast.parse(text))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []


def test_the_architecture_map_names_every_module():
    doc = (REPO / "docs" / "architecture.md").read_text()
    block = re.search(r"<!-- module tree -->\n```\n(.*?)```", doc, re.S)
    assert block, "docs/architecture.md has no module tree block"
    documented, package = set(), ""
    for line in block.group(1).splitlines():
        m = re.match(r"(\s*)(\S+)", line)
        if not m:
            continue
        name = m.group(2)
        if name.endswith("/"):
            package = "tieringd/" + name.rstrip("/") if name != "tieringd/" else "tieringd"
            package = package.replace("tieringd/tieringd", "tieringd")
            documented.add(package + "/__init__.py")
        elif name.endswith(".py"):
            documented.add(f"{package}/{name}")
    actual = {rel(p) for p in modules()}
    assert documented == actual, (f"in the tree, not the map: {sorted(actual - documented)}; "
                                  f"in the map, not the tree: {sorted(documented - actual)}")
