"""The README's main job: ``python -m hop`` runs end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_demo_runs_and_reports_each_step() -> None:
    proc = subprocess.run([sys.executable, "-m", "hop"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for step in ("eager", "autograd", "torch.export", "torch.compile", "save/load/run", "unbacked"):
        assert step in proc.stdout
    assert "matches eager" in proc.stdout
