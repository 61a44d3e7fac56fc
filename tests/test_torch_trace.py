"""TORCH_TRACE: hop's subgraphs and decisions in torch's structured trace, as tlparse shows them.

The structured trace is configured when torch starts, from the environment, so the
model runs in a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hop
from hop import _observe

MODEL = """
import torch
import hop


class Model(torch.nn.Module):
    def forward(self, x):
        h = hop.cond(x.sum() > 0, lambda a: a.sin(), lambda a: a[a > 0], (x,))
        return hop.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v.cos()), (torch.tensor(0), h))[1]


def checkpointed(x):
    out = hop.while_loop(lambda i, v: i < 2, lambda i, v: (i + 1, v * 2), (torch.tensor(0), x), checkpoint=True)
    return out[1] + 1


x = torch.randn(4)
hop.cond(torch.tensor(True), lambda a: a + 1, lambda a: a - 1, (x,))  # eager: a validation verdict
torch.compile(Model(), backend="aot_eager", fullgraph=True)(x)
torch.compile(checkpointed, backend="eager")(x)  # a graph break
torch.export.export(Model(), (x,))
"""


def _run_model(tmp_path: Path) -> tuple[Path, str]:
    trace_dir = tmp_path / "trace"
    env = {**os.environ, "TORCH_TRACE": str(trace_dir), "HOP_LOG": "dispatch"}
    root = Path(hop.__file__).parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", MODEL], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return trace_dir, done.stderr


def _artifacts(log: Path) -> dict[str, list[str]]:
    """hop's artifacts in the raw trace: name -> payloads."""
    found: dict[str, list[str]] = {}
    lines = log.read_text().splitlines()
    for i, line in enumerate(lines):
        if '"artifact"' not in line or '"name": "hop_' not in line:
            continue
        meta = json.loads(line[line.index("{") :])
        payload = []
        for nxt in lines[i + 1 :]:  # payload lines are tab-indented after their record
            if not nxt.startswith("\t"):
                break
            payload.append(nxt[1:])
        found.setdefault(meta["artifact"]["name"], []).append("\n".join(payload))
    return found


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    return _run_model(tmp_path_factory.mktemp("torch_trace"))


def test_hop_artifacts_in_the_structured_trace(traced: tuple[Path, str]) -> None:
    trace_dir, stderr = traced
    (log,) = trace_dir.glob("*.log")
    found = _artifacts(log)
    for name in (
        "hop_subgraph_cond_true_fn",
        "hop_subgraph_cond_false_fn",
        "hop_subgraph_while_loop_cond_fn",
        "hop_subgraph_while_loop_body_fn",
        "hop_dynamo_subgraph_cond_true_fn",
        "hop_unify_cond",
        "hop_assert_cond",
        "hop_validation_cond",
        "hop_graph_break_while_loop",
    ):
        assert name in found, sorted(found)
    assert any("# hop.cond: false_fn" in p and "torch.ops.aten.index" in p for p in found["hop_subgraph_cond_false_fn"])
    unify = json.loads(found["hop_unify_cond"][0])
    assert unify["op"] == "cond" and unify["sizes"]["true_fn"] == "4" and unify["symbol"].startswith("u")
    verdict = json.loads(found["hop_validation_cond"][0])
    assert verdict["verdict"] == "passed" and verdict["us"] >= 0
    graph_break = json.loads(found["hop_graph_break_while_loop"][0])
    assert graph_break["error"] == "CompileUnsupported" and "checkpoint" in graph_break["reason"]
    # HOP_LOG=dispatch logs the same records, the eager call's included
    assert "[hop.dispatch] cond: eager -> inline: branch 0 (true_fn), validation ran" in stderr


# on PATH, or beside this Python (a virtual environment not activated)
TLPARSE = shutil.which("tlparse") or shutil.which("tlparse", path=str(Path(sys.executable).parent))


@pytest.mark.skipif(TLPARSE is None, reason="tlparse is not installed")
def test_tlparse_shows_hop_artifacts(traced: tuple[Path, str], tmp_path: Path) -> None:
    trace_dir, _ = traced
    (log,) = trace_dir.glob("*.log")
    out = tmp_path / "tl_out"
    assert TLPARSE is not None
    done = subprocess.run([TLPARSE, str(log), "-o", str(out), "--no-browser"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    files = [p for p in out.rglob("hop_*") if p.is_file()]
    names = {p.name.rsplit("_", 1)[0] for p in files}
    assert {"hop_subgraph_cond_true_fn", "hop_unify_cond", "hop_graph_break_while_loop"} <= names, names
    compiled = [p for p in files if p.parent.name != "-_-_-_-"]  # listed under the compiled frame
    assert any(p.name.startswith("hop_subgraph_while_loop_body_fn") for p in compiled)
    index = (out / "index.html").read_text()
    assert "hop_subgraph_cond_false_fn" in index
    body = next(p for p in files if p.name.startswith("hop_subgraph_cond_false_fn")).read_text()
    assert "# hop.cond: false_fn" in body


def test_structured_trace_is_off_here() -> None:
    # pytest's log capture puts handlers on torch's trace logger: they do not turn it on
    assert not _observe.structured_on()
