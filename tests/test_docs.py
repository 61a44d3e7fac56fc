"""Every ```python block of README.md and docs/*.md runs, page by page, in order."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_every_page_is_checked() -> None:
    assert len(PAGES) >= 4


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_examples_run(page: Path) -> None:
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
