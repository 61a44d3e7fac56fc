"""The bridge's list of private torch API resolves on the installed torch, and is complete."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest
import torch

import hop
from hop.compile import _torch_api

BRIDGE = [
    *sorted(pathlib.Path(hop.__file__).parent.joinpath("compile").glob("*.py")),
    pathlib.Path(hop.__file__).parent / "passes" / "inductor.py",
    *sorted(pathlib.Path(hop.__file__).parent.joinpath("deploy").glob("*.py")),
]
LISTED = {p.path for p in _torch_api.PRIVATE}


@pytest.mark.parametrize("symbol", _torch_api.PRIVATE, ids=lambda p: p.path)
def test_every_private_symbol_resolves_on_this_torch(symbol: _torch_api.Private) -> None:
    if not _torch_api.at_least(*symbol.since):
        with pytest.raises((ImportError, AttributeError)):
            _torch_api.resolve(symbol.path)
        return
    assert _torch_api.resolve(symbol.path) is not None


def _private_imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if re.search(r"(^|\.)_", full.removeprefix("torch.")) or ".experimental." in full:
                    names.add(full)
    return names


@pytest.mark.parametrize("path", BRIDGE, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_private_import_of_the_bridge_is_listed(path: pathlib.Path) -> None:
    unlisted = _private_imports(path) - LISTED
    # an imported module is listed through the members the bridge reads of it
    unlisted = {u for u in unlisted if not any(p.startswith(u + ".") for p in LISTED)}
    assert not unlisted, f"{path.name} imports private torch API not in hop.compile._torch_api.PRIVATE: {unlisted}"


def test_the_installed_torch_is_a_supported_release() -> None:
    assert _torch_api.VERSION in {_torch_api._release(v) for v in _torch_api.CHECKED_ON}, torch.__version__


def test_the_supported_releases_match_the_package_metadata() -> None:
    pyproject = pathlib.Path(hop.__file__).parent.parent / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("not a source checkout")
    bound = re.search(r'"torch>=([\d.]+),<([\d.]+)"', pyproject.read_text())
    assert bound is not None
    low, high = _torch_api._release(bound[1] + ".0"), _torch_api._release(bound[2] + ".0")
    releases = sorted(_torch_api._release(v) for v in _torch_api.CHECKED_ON)
    assert releases[0] == low
    assert releases[-1] < high and (releases[-1][0], releases[-1][1] + 1) == high


def test_fake_propagation_errors_cover_this_torch() -> None:
    from torch._dynamo import exc

    errors = _torch_api.fake_propagation_errors()
    assert exc.TorchRuntimeError in errors
    if _torch_api.at_least(2, 14):
        assert exc.FakeTensorObservedException in errors
