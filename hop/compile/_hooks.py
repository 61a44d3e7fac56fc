"""Run a callback once a module of torch's compiler is imported, without importing it.

``torch._dynamo`` and ``torch._inductor`` cost most of a second to import, so hop
does not import them at ``import hop``. What hop registers there (Dynamo's
handlers for hop's operators, Inductor's lowerings) waits for them: a meta-path
finder wraps the loading of the named module and runs the callbacks right after
it has executed. If the module is already loaded the callback runs at once.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

__all__ = ["on_import"]

Callback = Callable[[ModuleType], None]
_PENDING: dict[str, list[Callback]] = {}


def on_import(fullname: str, callback: Callback) -> None:
    """Call ``callback(module)`` when ``fullname`` has been imported (now if it already is)."""
    module = sys.modules.get(fullname)
    if module is not None and fullname not in _LOADING:
        callback(module)
        return
    _PENDING.setdefault(fullname, []).append(callback)
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


_LOADING: set[str] = set()


def _run(fullname: str, module: ModuleType) -> None:
    for callback in _PENDING.pop(fullname, []):
        callback(module)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds a watched module as usual, then runs its callbacks after it has loaded."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _PENDING or fullname in _LOADING:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            _LOADING.add(fullname)
            try:
                run(module)
            finally:
                _LOADING.discard(fullname)
            _run(fullname, module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
