"""AOTInductor raises hop's refusals as themselves, as ``torch.compile`` does.

Inductor wraps every exception its graph compilation raises in an
``InductorError``, so a loop whose carries change size, which hop's lowering
refuses with ``hop.errors.CompileUnsupported``, reached an AOTInductor user as an
``InductorError`` that ``except CompileUnsupported`` does not catch (under
``torch.compile`` Dynamo's handlers refuse such programs before Inductor runs).
The AOTInductor entry points (``torch._inductor.aoti_compile_and_package`` and
``aot_compile``) are wrapped once ``torch._inductor`` loads: a ``HopError`` inside
the wrapper is raised itself, with the wrapper as its cause. Any other error is
left as it was.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

from hop.compile._hooks import on_import
from hop.errors import HopError

ENTRY_POINTS = ("aoti_compile_and_package", "aot_compile")


def hop_error_inside(error: BaseException) -> HopError | None:
    """The HopError that ``error`` wraps (as ``inner_exception`` or cause), if any."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, HopError):
            return current
        seen.add(id(current))
        inner = getattr(current, "inner_exception", None)
        current = inner if isinstance(inner, BaseException) else current.__cause__
    return None


def _raising_hop_errors(entry: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(entry)
    def entry_point(*args: Any, **kwargs: Any) -> Any:
        try:
            return entry(*args, **kwargs)
        except HopError:
            raise
        except Exception as e:
            refusal = hop_error_inside(e)
            if refusal is None:
                raise
            raise refusal from e

    entry_point.__hop_wrapped__ = entry  # type: ignore[attr-defined]
    return entry_point


def _wrap(inductor: ModuleType) -> None:
    for name in ENTRY_POINTS:
        entry = getattr(inductor, name, None)
        if entry is not None and not hasattr(entry, "__hop_wrapped__"):
            setattr(inductor, name, _raising_hop_errors(entry))


on_import("torch._inductor", _wrap)
