"""Every ```python block of README.md and docs/*.md runs, page by page, in order."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_every_page_is_checked() -> None:
    assert len(PAGES) >= 4


# Pages whose examples start process groups run in a subprocess, with a deadline:
# gloo's teardown can hang in a process that holds many threads (seen twice in a
# pytest worker, never in a fresh process), and a hang must not stall the suite.
IN_SUBPROCESS = {"distributed.md"}
DEADLINE_S = 300


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_examples_run(page: Path) -> None:
    if page.name in IN_SUBPROCESS:
        _run_in_subprocess(page)
        return
    blocks = BLOCK.findall(page.read_text())
    # A real module: Dynamo (strict export) imports the module of the code it traces.
    module = types.ModuleType(f"docs_{page.stem}")
    sys.modules[module.__name__] = module
    try:
        for i, block in enumerate(blocks):
            code = compile(block, f"{page.name}[block {i}]", "exec")
            exec(code, module.__dict__)
    finally:
        del sys.modules[module.__name__]


def _run_in_subprocess(page: Path) -> None:
    """Every block of ``page`` in one fresh process, as a script (a retry after a hang)."""
    script = "\n\n".join(BLOCK.findall(page.read_text()))
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    for attempt in range(2):
        try:
            done = subprocess.run(
                [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=DEADLINE_S
            )
        except subprocess.TimeoutExpired:
            if attempt == 0:
                continue
            raise AssertionError(f"{page.name}'s examples hung twice (over {DEADLINE_S} s each)") from None
        assert done.returncode == 0, f"{page.name}'s examples failed:\n{done.stderr[-4000:]}"
        return
