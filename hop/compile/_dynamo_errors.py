"""hop's errors under Dynamo: a HopError raised while a call is captured leaves as a graph break.

:func:`as_graph_break` makes a HopError also Dynamo's ``Unsupported`` (a graph break
without ``fullgraph=True``, and with it the HopError the user catches), keeping its
class; :func:`hop_errors_break_graph` does it for whatever a handler's checks or
hop's fake rule raise (Dynamo wraps what fails in fake propagation);
:func:`unsupported` is the error for what runs eagerly but cannot be captured.
Apart from the capture machinery because every handler and the handler base
raise through it.

Everything here imports torch._dynamo: it is loaded only once Dynamo is.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._dynamo.exc import Unsupported

import hop
from hop import _observe
from hop._observe_traced import graph_break
from hop.compile._torch_api import fake_propagation_errors
from hop.errors import CompileUnsupported, HopError, format_message

__all__ = ["as_graph_break", "hop_errors_break_graph", "unsupported"]


_BREAKING: dict[type[HopError], type[Exception]] = {}


def _breaking(cls: type[HopError]) -> type[Exception]:
    """``cls`` that is also Dynamo's ``Unsupported``: a graph break without fullgraph,
    and, with it, the HopError the user catches."""
    if cls not in _BREAKING:

        def init(self: Any, error: HopError) -> None:
            Unsupported.__init__(self, str(error), gb_type=f"hop: {cls.__name__}")
            self.op, self.role, self.path = error.op, error.role, error.path

        _BREAKING[cls] = type(cls.__name__, (cls, Unsupported), {"__init__": init, "__module__": cls.__module__})
    return _BREAKING[cls]


def as_graph_break(error: HopError) -> Exception:
    """``error`` as a graph break that is still an instance of its own class."""
    if _observe.SINKS or _observe.structured_on():
        graph_break(error)
    if isinstance(error, Unsupported):
        return error
    breaking = _breaking(type(error))(error)
    breaking.__cause__ = error.__cause__
    return breaking


def unsupported(op: str, feature: str, fix: str) -> Exception:
    """:class:`CompileUnsupported` for a feature of ``op`` that runs eagerly but cannot be captured."""
    error = CompileUnsupported(
        format_message(op, f"{feature} runs in eager but torch.compile cannot capture it", fix=fix), op=op
    )
    return as_graph_break(error)


def untraceable(op: str, role: str, error: Unsupported) -> Exception:
    """Dynamo could not trace ``role``: say what Dynamo said (its reason and explanation)
    and where, the innermost line of the user's code it stopped at; for a write to an
    object from outside the callable, what to do about it."""
    lines = str(error.msg).split("\n")
    reason = lines[0]
    explanation = next((x.strip()[len("Explanation: ") :] for x in lines if x.strip().startswith("Explanation: ")), "")
    if explanation:
        reason = f"{reason}: {explanation.rstrip('.')}"
    where = _user_line(getattr(error, "real_stack", None) or [])
    at = f" at {where}" if where else ""
    if _in_kernels_wrapper(error):
        fix = (
            "That write is the kernels package's (transformers' hub kernels), which wraps a model's forward "
            "and writes a global on every call. Export the program instead (torch.export.export) and compile "
            "ep.module() with torch.compile, or package it with AOTInductor: the exported graph holds no such write."
        )
    elif "_buffers[name]" in str(error.msg) or "register_buffer" in (where or "") or _assigns_buffer(error):
        fix = (
            f"Write the buffer in place inside {role} (self.count.add_(1), self.cache.copy_(v)): an augmented "
            "assignment such as self.count += 1 also assigns the module's attribute, which torch.compile cannot "
            "capture inside an operator's callable."
        )
    elif any(word in lines[0].lower() for word in ("side effect", "method call", "mutation")):  # names vary by release
        fix = (
            f"Move that statement out of {role} (a global, a context variable or an object outside it, written "
            "on every call: write it before or after the operator, or once around the compiled call), or call "
            "the operator outside the compiled function."
        )
    else:
        fix = (
            f"Keep {role} traceable (no Python branching on tensor values, no I/O), or call the operator "
            "outside the compiled function."
        )
    return unsupported(op, f"{role}, which Dynamo cannot trace into one graph ({reason}){at},", fix=fix)


def _in_kernels_wrapper(error: Unsupported) -> bool:
    """Whether Dynamo stopped in the ``kernels`` package's forward wrapper."""
    stack = getattr(error, "real_stack", None) or []
    return any("/kernels/" in getattr(f, "filename", "") for f in stack)


def _assigns_buffer(error: Unsupported) -> bool:
    """Whether Dynamo stopped in torch's module code assigning a buffer (``self.count += 1``)."""
    return any(getattr(f, "name", "") == "register_buffer" for f in getattr(error, "real_stack", None) or [])


def _user_line(stack: Any) -> str | None:
    """``file.py:12 in fn (`source`)`` for the innermost frame of ``stack`` outside hop and torch."""
    import os

    roots = [os.path.dirname(os.path.abspath(str(m.__file__))) + os.sep for m in (hop, torch)]
    for frame in reversed(list(stack)):
        filename = getattr(frame, "filename", "")
        if filename and any(os.path.abspath(filename).startswith(r) for r in roots):
            continue
        text = f"{os.path.basename(filename)}:{frame.lineno} in {frame.name}"
        source = (frame.line or "").strip()
        return f"{text} (`{source}`)" if source else text
    return None


def _hop_cause(error: BaseException) -> HopError | None:
    """The HopError that ``error`` wraps (Dynamo wraps what fails in fake propagation)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, HopError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


_CAUGHT: tuple[type[BaseException], ...] = (Unsupported, *fake_propagation_errors())


@contextmanager
def hop_errors_break_graph() -> Iterator[None]:
    """A HopError raised inside (by hop's checks, or by its fake rule during fake
    propagation) leaves as a graph break that is still that HopError."""
    try:
        yield
    except _CAUGHT as e:  # fake propagation wraps what fails in all but the first
        cause = _hop_cause(e)
        if cause is None or isinstance(e, HopError):
            raise
        raise as_graph_break(cause) from None
    except HopError as e:
        raise as_graph_break(e) from None
