"""``import hop`` works wherever a user's process may first import it: under
``torch.no_grad()``, under ``torch.inference_mode()`` (an inference server importing
lazily), and lazily inside a function torch.compile traces, called under no_grad.
Each case runs in a fresh process, where hop was not imported yet."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CASES = {
    "no_grad": """
        with torch.no_grad():
            import hop
            out = hop.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, a * 2), (0, torch.ones(2)))[1]
        """,
    "inference_mode": """
        with torch.inference_mode():
            import hop
            out = hop.cond(torch.tensor(True), lambda a: a * 8, lambda a: a, (torch.ones(2),))
        """,
    "compiled_under_no_grad": """
        def f(x):
            import hop
            return hop.cond(x.sum() > 0, lambda a: a * 8, lambda a: a, (x,))
        with torch.no_grad():
            out = torch.compile(f, backend="aot_eager", fullgraph=True)(torch.ones(2))
        """,
}


@pytest.mark.parametrize("case", CASES)
def test_import(case: str) -> None:
    code = (
        "import torch\n"
        + textwrap.dedent(CASES[case])
        + textwrap.dedent("""
        assert out.tolist() == [8.0, 8.0], out
        assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        x = torch.ones(2, requires_grad=True)
        import hop
        hop.cond(x.sum() > 0, lambda a: a.exp(), lambda a: a, (x,)).sum().backward()
        assert x.grad is not None
        """)
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
