"""The code's layout as docs/design.md describes it: small modules, families in folders
that import one way, lazy imports that say why, and a map that names every module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HOP = ROOT / "hop"
FAMILIES = ("branching", "scanning", "while_loops")
MODULES = sorted(p for p in HOP.rglob("*.py"))


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _hop_imports(tree: ast.AST) -> list[tuple[ast.stmt, str]]:
    """Every import of a hop module in ``tree``, with the module (or package) it names."""
    found: list[tuple[ast.stmt, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "hop":
            found += [(node, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node, a.name) for a in node.names if a.name.split(".")[0] == "hop"]
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_is_over_500_lines(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= 500, f"{path.relative_to(ROOT)}: split it along a seam"


def test_families_import_one_way() -> None:
    """branching and scanning import no other family, and what every family shares
    (``hop.ops._common``, ``_lean_body``) imports none; while_loops imports both (its
    masked loop is a cond, its reverse mode a scan)."""
    allowed = {"branching": set(), "scanning": set(), "while_loops": {"branching", "scanning"}}
    wrong = []
    for path in MODULES:
        parts = _name(path).split(".")
        if parts[:2] != ["hop", "ops"] or len(parts) < 3:
            continue
        own = parts[2] if parts[2] in FAMILIES else None
        for node, imported in _hop_imports(ast.parse(path.read_text())):
            target = imported.split(".")
            family = target[2] if len(target) > 2 and target[:2] == ["hop", "ops"] else None
            if family in FAMILIES and family != own and family not in allowed.get(own or "", set()):
                wrong.append(f"{_name(path)}:{node.lineno} imports {imported}")
    assert not wrong, "\n".join(wrong)


def test_a_lazy_import_of_hop_says_why() -> None:
    """An import of a hop module inside a function has a comment on its line, on the
    line above, or on another import of its group: the reason it is not at the top."""
    bare = []
    for path in MODULES:
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        functions = [f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node, _ in {id(n): (n, m) for f in functions for n, m in _hop_imports(f)}.values():
            first = node.lineno - 1
            while first > 0 and lines[first - 1].strip().startswith(("from ", "import ", "#")):
                first -= 1
            group = lines[first : node.end_lineno]
            if not any("#" in line for line in group):
                bare.append(f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not bare, "\n".join(bare)


def test_design_md_names_every_module() -> None:
    """docs/design.md's map: a module directly in a package by its path, a module of an
    operator family by its file name in that family's block."""
    text = (ROOT / "docs" / "design.md").read_text()
    blocks = {f: re.search(rf"^hop/ops/{f}/ .*?(?=^\S|\Z)", text, re.M | re.S) for f in FAMILIES}
    missing = []
    for path in MODULES:
        rel = path.relative_to(ROOT).as_posix()
        family = path.parent.name if path.parent.parent == HOP / "ops" else None
        if family in FAMILIES:
            block = blocks[family]
            if path.name != "__init__.py" and (block is None or not re.search(rf"\b{re.escape(path.name)}", block[0])):
                missing.append(rel)
        elif rel != "hop/__init__.py" and not re.search(rf"(^|[\s,]){re.escape(rel)}\b", text, re.M):
            missing.append(rel)
    assert not missing, "docs/design.md does not name: " + ", ".join(missing)
