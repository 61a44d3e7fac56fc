"""Check hop's import graph for cycles and upward imports (docs/design.md, "Imports go one way").

Every ``import`` of a hop module counts, at module level or inside a function (a
lazy import is still a dependency). A package's import of its own ``__init__`` is
not an edge (every module of hop does it), and neither are imports of non-hop
modules.

An upward import is one from a core module (a module directly in ``hop/``: the
operator class, the dispatcher, pytrees, tracing, validation, observation, ...) into
a layer above it: ``hop.ops``, ``hop.compile``, ``hop.deploy``, ``hop.passes``, ``hop.testing`` or
``hop.debug`` (the public observation API; the record type it shows lives below, in
``hop._records``). The package ``hop`` itself, ``hop.__main__``, ``hop._demo``, ``hop._quick_check`` and
``hop.debug`` sit on top and are not core.

Usage: ``python tools/check_layers.py`` (exit 1, printing each cycle with the line
of every import in it, and each upward import), or ``--graph`` to print every edge.
CI runs it.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "hop"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports(path: Path, name: str, known: set[str]) -> Iterator[tuple[str, int]]:
    """The hop modules ``path`` imports, with the line of each import."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in known:  # from hop.ops import cond: the module hop.ops.branching.cond
                    yield full, node.lineno
                elif base in known:
                    yield base, node.lineno


def graph() -> dict[str, dict[str, int]]:
    known = modules()
    names = set(known)
    edges: dict[str, dict[str, int]] = {}
    for name, path in sorted(known.items()):
        deps = edges.setdefault(name, {})
        for dep, line in imports(path, name, names):
            if dep != name and not name.startswith(dep + "."):  # a package's own __init__
                deps.setdefault(dep, line)
    return edges


# Modules directly in hop/ that sit on top of the stack rather than in its core.
NOT_CORE = frozenset({"hop", "hop.__main__", "hop._demo", "hop._quick_check", "hop.debug"})
# The layers above the core.
UPPER = ("hop.ops", "hop.compile", "hop.deploy", "hop.passes", "hop.testing", "hop.debug")


def is_core(name: str) -> bool:
    return name.count(".") == 1 and name not in NOT_CORE and not is_upper(name)


def is_upper(name: str) -> bool:
    return any(name == layer or name.startswith(layer + ".") for layer in UPPER)


def upward(edges: dict[str, dict[str, int]]) -> list[tuple[str, int, str]]:
    """Each import of a layer above the core by a core module: (module, line, imported)."""
    return sorted(
        (name, line, dep)
        for name, deps in edges.items()
        if is_core(name)
        for dep, line in deps.items()
        if is_upper(dep)
    )


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def main(argv: list[str]) -> int:
    edges = graph()
    if "--graph" in argv:
        for name, deps in edges.items():
            for dep, line in sorted(deps.items()):
                print(f"{name}:{line} -> {dep}")
        return 0
    found = cycles(edges)
    for component in found:
        members = set(component)
        print(f"import cycle of {len(component)} modules:")
        for name in component:
            for dep, line in sorted(edges[name].items()):
                if dep in members:
                    print(f"  {name}:{line} -> {dep}")
    up = upward(edges)
    for name, line, dep in up:
        print(f"upward import: {name}:{line} -> {dep}")
    return 1 if found or up else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
