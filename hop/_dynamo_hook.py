"""Keep Dynamo from mistaking hop's operators for torch's (TORCH_INTERNALS 8).

Dynamo picks its handler for a HigherOrderOperator by ``__name__``: a raw
``torch.ops.hop.while_loop`` or ``scan`` (in user code, or in the code of an
exported program's ``ep.module()``) would be traced as torch's operator of that
name, whose argument layout differs, and fail inside Dynamo. hop marks such
operators as *disallowed callables*: Dynamo breaks the graph there and calls
them eagerly, through hop's dispatcher. Operators whose layout Dynamo's handler
understands (``cond``, ``map``) pass ``dynamo_traceable=True`` and stay in the
compiled graph.

torch._dynamo is imported lazily (it costs most of a second), so the
registration waits for it: a meta-path finder wraps the loading of
``torch._dynamo.trace_rules`` and registers every pending operator right after.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["hide"]

_TRACE_RULES = "torch._dynamo.trace_rules"
_PENDING: list[Any] = []


def hide(op: Any) -> None:
    """Make Dynamo graph-break on calls to ``op`` (now, or once Dynamo is imported)."""
    module = sys.modules.get(_TRACE_RULES)
    if module is not None and hasattr(module, "_disallowed_callable_ids"):
        module._disallowed_callable_ids.add(id(op))
        return
    _PENDING.append(op)
    if not any(isinstance(f, _AfterTraceRules) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTraceRules())


def _register(module: ModuleType) -> None:
    for op in _PENDING:
        module._disallowed_callable_ids.add(id(op))
    _PENDING.clear()


class _AfterTraceRules(importlib.abc.MetaPathFinder):
    """Finds ``torch._dynamo.trace_rules`` as usual, then runs :func:`_register` after it loads."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TRACE_RULES:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _register(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
