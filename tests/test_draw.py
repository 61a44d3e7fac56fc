"""hop.debug.draw: a program as Graphviz DOT, each branch and loop body a nested cluster."""

from __future__ import annotations

import io
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import hop
from hop.errors import HopRuntimeError, HopTypeError, HopValueError

_CLUSTER = re.compile(r'^\s*label="([^"]*)"; style=')
_NODE = re.compile(r'^\s*n\d+ \[label="((?:[^"\\]|\\.)*)"')


def nodes_by_cluster(dot: str) -> list[tuple[tuple[str, ...], str]]:
    """Every node's label with the labels of the clusters it sits in, outermost first."""
    stack: list[str] = []
    found: list[tuple[tuple[str, ...], str]] = []
    for line in dot.splitlines():
        if line.strip().startswith("subgraph cluster_"):
            stack.append("")
        elif (m := _CLUSTER.match(line)) and stack and not stack[-1]:
            stack[-1] = m.group(1)
        elif line.strip() == "}" and stack:
            stack.pop()
        elif m := _NODE.match(line):
            found.append((tuple(stack), m.group(1)))
    assert not stack, "unbalanced clusters"
    return found


def where(dot: str, label_start: str) -> list[tuple[str, ...]]:
    return [path for path, label in nodes_by_cluster(dot) if label.startswith(label_start)]


def nested(c: torch.Tensor, xs: torch.Tensor) -> Any:
    """A cond inside a while_loop inside a scan; the cond's true branch has a data-dependent size."""

    def combine(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def body(i: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            def grow(a: torch.Tensor) -> torch.Tensor:
                return a * 2 + a[a > 0].sum()

            return i + 1, hop.cond(h.sum() > 0, grow, lambda a: a - 1, (h,))

        _, h = hop.while_loop(lambda i, h: i < 3, body, (torch.zeros((), dtype=torch.int64), c + x))
        return h, h.sum()

    return hop.scan(combine, c, xs)


@pytest.fixture(scope="module")
def nested_dot() -> str:
    gm = make_fx(nested, tracing_mode="symbolic")(torch.randn(3), torch.randn(4, 3))
    return hop.debug.draw(gm)


def test_nested_control_flow_nests_clusters(nested_dot: str) -> None:
    scan, loop = "hop.scan: combine_fn", "hop.while_loop: body_fn"
    assert where(nested_dot, "scan = hop.scan") == [()]
    assert where(nested_dot, "while_loop = hop.while_loop") == [(scan,)]
    assert where(nested_dot, "cond = hop.cond") == [(scan, loop)]
    assert where(nested_dot, "lt = aten.lt") == [(scan, "hop.while_loop: cond_fn")]
    assert where(nested_dot, "sub = aten.sub") == [(scan, loop, "hop.cond: false_fn")]


def test_clusters_show_their_inputs_and_output(nested_dot: str) -> None:
    inner = ("hop.scan: combine_fn", "hop.while_loop: body_fn", "hop.cond: true_fn")
    labels = [label for path, label in nodes_by_cluster(nested_dot) if path == inner]
    assert labels[0].startswith("input arg0_1\\nfloat32[s")
    assert labels[-1] == "output"


def test_unbacked_size_and_assert_are_marked(nested_dot: str) -> None:
    inner = ("hop.scan: combine_fn", "hop.while_loop: body_fn", "hop.cond: true_fn")
    (binding,) = [label for path, label in nodes_by_cluster(nested_dot) if "\\nunbacked u" in label]
    assert re.fullmatch(r"index = aten\.index\.Tensor\\nfloat32\[(u\d+)\]\\nunbacked \1 = \.size\(\)\[0\]", binding)
    assert where(nested_dot, "index = ") == [inner]
    asserts = [(path, label) for path, label in nodes_by_cluster(nested_dot) if label.startswith("assert ")]
    assert asserts and all(path == inner for path, _ in asserts)
    assert re.match(r"assert u\d+ >= 0\\nRuntime assertion failed", asserts[0][1])
    assert "fillcolor=lightyellow" in nested_dot and "shape=octagon, color=red" in nested_dot


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = hop.cond(x.sum() > 0, lambda a: a.cos(), lambda a: a.sin(), (self.lin(x),))
        mode = (x.abs().mean() * 3).long().clamp(0, 2)
        out: torch.Tensor = hop.switch(mode, [torch.relu, torch.tanh, torch.sigmoid], (h,))
        return out


def test_exported_program() -> None:
    ep = torch.export.export(Model(), (torch.randn(3, 4),))
    dot = hop.debug.draw(ep)
    assert where(dot, "cos = aten.cos") == [("hop.cond: true_fn",)]
    assert where(dot, "sigmoid = aten.sigmoid") == [("hop.switch: branches[2]",)]
    assert where(dot, "input p_lin_weight") == [()]
    assert dot.count('label="branches[') == 3
    # switch's index check is an assert on a bool tensor: drawn as an assert naming the tested node
    assert where(dot, "assert and_1\\nhop.switch: index out of range for 3 branches") == [()]


def test_saved_and_loaded_program_draws_the_same_clusters() -> None:
    ep = torch.export.export(Model(), (torch.randn(3, 4),))
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    loaded = hop.debug.draw(torch.export.load(buffer))
    assert [path for path, _ in nodes_by_cluster(loaded)] == [path for path, _ in nodes_by_cluster(hop.debug.draw(ep))]
    assert where(loaded, "tanh = aten.tanh") == [("hop.switch: branches[1]",)]


def many(x: torch.Tensor) -> Any:
    m = hop.map(lambda r: r * 2, x)
    a = hop.associative_scan(lambda p, q: p + q, m, dim=0)
    return hop.switch(torch.tensor(1), [torch.sin, torch.cos], (a,))


def test_every_role_is_named() -> None:
    dot = hop.debug.draw(make_fx(many)(torch.randn(2, 3)))
    roles = sorted({path[0] for path, _ in nodes_by_cluster(dot) if path})
    assert roles == [
        "hop.associative_scan: combine_fn",
        "hop.map: f",
        "hop.switch: branches[0]",
        "hop.switch: branches[1]",
    ]


def test_writes_dot_file(tmp_path: Path, nested_dot: str) -> None:
    gm = make_fx(nested, tracing_mode="symbolic")(torch.randn(3), torch.randn(4, 3))
    path = tmp_path / "program.dot"
    assert hop.debug.draw(gm, path) == path.read_text() == nested_dot


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
def test_svg_with_graphviz(tmp_path: Path) -> None:
    path = tmp_path / "program.svg"
    hop.debug.draw(make_fx(many)(torch.randn(2, 3)), path)
    assert "hop.map: f" in path.read_text()


def test_svg_without_graphviz_names_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(HopRuntimeError, match=r"hop\.debug\.draw: path: .*needs Graphviz's `dot`.*Install Graphviz"):
        hop.debug.draw(make_fx(many)(torch.randn(2, 3)), tmp_path / "program.svg")
    assert not (tmp_path / "program.svg").exists()


def fake_dot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    """A stand-in for Graphviz's ``dot`` on PATH, so the rendering call is checked without it."""
    script = tmp_path / "dot"
    script.write_text(f"#!{sys.executable}\nimport sys\n{body}\n")
    script.chmod(0o755)
    monkeypatch.setattr(shutil, "which", lambda name: str(script) if name == "dot" else None)


def test_png_is_rendered_by_dot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_dot(tmp_path, monkeypatch, "open(sys.argv[3], 'w').write(sys.argv[1] + ' ' + sys.stdin.read())")
    dot = hop.debug.draw(make_fx(many)(torch.randn(2, 3)), tmp_path / "program.png")
    assert (tmp_path / "program.png").read_text() == "-Tpng " + dot


def test_dot_failure_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_dot(tmp_path, monkeypatch, "sys.stderr.write('syntax error in line 3'); sys.exit(2)")
    with pytest.raises(HopRuntimeError, match=r"dot failed writing .*\(exit 2\): syntax error in line 3"):
        hop.debug.draw(make_fx(many)(torch.randn(2, 3)), tmp_path / "program.svg")


def test_misuse() -> None:
    with pytest.raises(HopTypeError, match=r"gm_or_exported_program: expected a torch\.fx\.GraphModule .*got function"):
        hop.debug.draw(many)
    with pytest.raises(HopValueError, match=r"must end in \.dot, \.svg or \.png"):
        hop.debug.draw(make_fx(many)(torch.randn(2, 3)), "program.pdf")
