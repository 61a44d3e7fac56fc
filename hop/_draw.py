"""A picture of a control-flow program: :func:`draw` writes an FX program as Graphviz DOT.

Each branch and loop body of a higher-order operator node is a GraphModule passed as a
``get_attr`` argument of the node. It is drawn as a cluster (``subgraph cluster_N``) nested
in the cluster of the graph that calls it, labelled with the operator and the role the
subgraph plays (``hop.cond: true_fn``). Inside a cluster its inputs (placeholders) and its
output are ordinary nodes, so nested control flow reads as nested boxes.

Two things of a traced program that a plain graph dump hides are marked:

- a node that binds a data-dependent (unbacked) size, ``meta["unbacked_bindings"]``, is
  filled yellow and lists ``u0 = [0].size()[0]`` (the symbol and where in its value it sits);
- a runtime assert (``aten._assert_scalar``) is a red octagon with its condition and message.

DOT is plain text, so drawing needs nothing; rendering SVG or PNG runs Graphviz's ``dot``.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from hop import _spec
from hop.errors import HopRuntimeError, HopTypeError, HopValueError, format_message, type_name

__all__ = ["draw", "to_dot"]

_OP = "debug.draw"

_RENDERED = {".svg": "svg", ".png": "png"}
# Runtime asserts: on a SymBool (unbacked ranges, torch.export's shape checks) and on a
# bool tensor (switch's index range, torch's _assert_async).
_ASSERTS = (torch.ops.aten._assert_scalar.default, torch.ops.aten._assert_async.msg)
_MAX_LABEL = 70  # long assert messages and reprs are cut so the boxes stay readable


def draw(gm_or_exported_program: Any, path: str | os.PathLike[str] | None = None) -> str:
    """Draw a program: a GraphModule (from make_fx) or a torch.export ExportedProgram.

    Returns the DOT text. With ``path``, also writes it: ``.dot`` writes the text;
    ``.svg`` and ``.png`` render it with Graphviz's ``dot`` executable, which must be
    installed (``apt install graphviz``, ``brew install graphviz``, ``conda install graphviz``).
    """
    dot = to_dot(gm_or_exported_program)
    if path is not None:
        _write(dot, os.fspath(path))
    return dot


def to_dot(gm_or_exported_program: Any) -> str:
    """The DOT text of a program, each subgraph of a higher-order operator a nested cluster."""
    w = _Writer()
    w.line("digraph program {")
    w.line('  compound=true; rankdir=TB; node [shape=box, fontname="monospace", fontsize=10];')
    w.line('  edge [fontname="monospace", fontsize=9];')
    w.emit_graph(_graph_module(gm_or_exported_program), indent=1)
    w.line("}")
    return "\n".join(w.lines) + "\n"


def _graph_module(program: Any) -> torch.fx.GraphModule:
    if isinstance(program, torch.export.ExportedProgram):
        program = program.graph_module
    if isinstance(program, torch.fx.GraphModule):
        return program
    raise HopTypeError(
        format_message(
            _OP,
            f"expected a torch.fx.GraphModule or a torch.export.ExportedProgram, got {type_name(program)}",
            role="gm_or_exported_program",
            fix="Trace the function first: make_fx(f)(*args) or torch.export.export(module, args).",
        ),
        op=_OP,
        role="gm_or_exported_program",
    )


class _Writer:
    """Accumulates DOT lines; hands out ids unique across every nested graph."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._count = 0

    def fresh(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}{self._count}"

    def line(self, text: str) -> None:
        self.lines.append(text)

    def emit_graph(self, gm: torch.fx.GraphModule, indent: int) -> str:
        """Emit the nodes, edges and nested clusters of ``gm``; returns its first node's id."""
        pad = "  " * indent
        clusters = {node: _subgraphs(gm, node) for node in gm.graph.nodes}
        # a branch's or body's get_attr is drawn as the cluster of the node that runs it
        hidden = {attr for subs in clusters.values() for attr, _, _ in subs}
        ids: dict[torch.fx.Node, str] = {}
        for node, subs in clusters.items():
            if node in hidden:
                continue
            ids[node] = self.fresh("n")
            self.line(f"{pad}{ids[node]} [{_attributes(node)}];")
            for _, sub, role in subs:
                self._emit_cluster(sub, f"{_op_name(node.target)}: {role}", ids[node], role, indent)
        for node, target in ids.items():
            for src in node.all_input_nodes:
                if src in ids:
                    self.line(f"{pad}{ids[src]} -> {target};")
        return next(iter(ids.values()))

    def _emit_cluster(self, gm: torch.fx.GraphModule, label: str, caller: str, role: str, indent: int) -> None:
        pad = "  " * indent
        cluster = self.fresh("cluster_")
        self.line(f"{pad}subgraph {cluster} {{")
        self.line(f'{pad}  label={_quote(label)}; style="rounded,dashed"; color=blue; fontcolor=blue;')
        first = self.emit_graph(gm, indent + 1)
        self.line(f"{pad}}}")
        # An edge to a node inside the cluster, clipped at its border (lhead; needs compound=true).
        self.line(f"{pad}{caller} -> {first} [lhead={cluster}, style=dashed, color=blue, label={_quote(role)}];")


def _attribute(gm: torch.fx.GraphModule, target: str) -> Any:
    return functools.reduce(getattr, target.split("."), gm)


def _subgraph_of(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.GraphModule | None:
    """The GraphModule a ``get_attr`` node reads, if it reads one (a branch or body)."""
    if node.op != "get_attr" or not isinstance(node.target, str):
        return None
    value = _attribute(gm, node.target)
    return value if isinstance(value, torch.fx.GraphModule) else None


def _subgraphs(gm: torch.fx.GraphModule, node: torch.fx.Node) -> list[tuple[torch.fx.Node, torch.fx.GraphModule, str]]:
    """The subgraphs a higher-order operator node runs, each with its get_attr node and
    its role, in argument order."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return []
    args = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, torch.fx.Node)]
    subs = [(a, s) for a in args if (s := _subgraph_of(gm, a)) is not None]
    return [(a, s, _spec.role_of(node.target._name, k)) for k, (a, s) in enumerate(subs)]


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"{getattr(target, 'namespace', 'higher_order')}.{target._name}"
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    name = getattr(target, "__name__", str(target))
    return f"operator.{name}" if getattr(target, "__module__", None) == "_operator" else name


def _attributes(node: torch.fx.Node) -> str:
    """DOT attributes of one node: its label, and a shape and colour for what it is."""
    lines = [_headline(node), _describe(node.meta.get("val"))]
    style = ""
    if node.op in ("placeholder", "output"):
        style = ", shape=ellipse"
    elif node.target in _ASSERTS:
        lines = _assert_lines(node)
        style = ", shape=octagon, color=red, fontcolor=red"
    elif isinstance(node.target, torch._ops.HigherOrderOperator):
        style = ", shape=box3d, color=blue, fontcolor=blue"
    bindings = node.meta.get("unbacked_bindings") or {}
    if bindings:
        lines += [f"unbacked {sym} = {''.join(map(str, path))}" for sym, path in bindings.items()]
        style += ", style=filled, fillcolor=lightyellow"
    return f"label={_quote(chr(10).join(line for line in lines if line))}{style}"


def _assert_lines(node: torch.fx.Node) -> list[str]:
    """``assert u0 >= 0`` (the condition: a SymBool's expression, else the tested node) and the message."""
    cond, *message = node.args
    value = cond.meta.get("val") if isinstance(cond, torch.fx.Node) else cond
    expr = _describe(value) if isinstance(value, (torch.SymBool, bool)) else str(cond)
    return [f"assert {expr}", *(_cut(str(m)) for m in message)]


def _headline(node: torch.fx.Node) -> str:
    if node.op == "placeholder":
        return f"input {node.name}"
    if node.op == "output":
        return "output"
    if node.op == "get_attr":
        return f"{node.name} = self.{node.target}"
    return f"{node.name} = {_op_name(node.target)}"


def _describe(value: Any) -> str:
    """``float32[s0, 4]`` for a tensor, the expression for a symbolic scalar, tuples itemwise."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}[{', '.join(str(s) for s in value.shape)}]"
    if isinstance(value, (torch.SymInt, torch.SymBool, torch.SymFloat, int, float, bool)):
        return _cut(str(value))
    if isinstance(value, (tuple, list)):
        return _cut(f"({', '.join(_describe(v) for v in value)})")
    return ""


def _cut(text: str) -> str:
    return text if len(text) <= _MAX_LABEL else text[: _MAX_LABEL - 3] + "..."


def _quote(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def _write(dot: str, path: str) -> None:
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".dot":
        with open(path, "w") as f:
            f.write(dot)
        return
    if suffix not in _RENDERED:
        raise HopValueError(
            format_message(
                _OP,
                f"cannot write {path!r}: the file name must end in .dot, .svg or .png",
                role="path",
                fix="Use a .dot path for the DOT text, or .svg/.png for a picture (needs Graphviz).",
            ),
            op=_OP,
            role="path",
        )
    _render(dot, path, _RENDERED[suffix])


def _render(dot: str, path: str, fmt: str) -> None:
    exe = shutil.which("dot")
    if exe is None:
        raise HopRuntimeError(
            format_message(
                _OP,
                f"writing {path!r} needs Graphviz's `dot` executable, which is not on PATH",
                role="path",
                fix="Install Graphviz (apt install graphviz, brew install graphviz or conda install graphviz), "
                "or pass a .dot path and render it elsewhere.",
            ),
            op=_OP,
            role="path",
        )
    done = subprocess.run([exe, f"-T{fmt}", "-o", path], input=dot.encode(), capture_output=True, check=False)
    if done.returncode != 0:
        raise HopRuntimeError(
            format_message(
                _OP,
                f"Graphviz's dot failed writing {path!r} (exit {done.returncode}): "
                f"{done.stderr.decode(errors='replace').strip()}",
                role="path",
                fix="Check that the directory exists and is writable; the DOT text is returned by draw(program).",
            ),
            op=_OP,
            role="path",
        )
