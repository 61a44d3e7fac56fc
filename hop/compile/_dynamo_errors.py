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

from torch._dynamo.exc import Unsupported

from hop import _observe
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
        from hop._observe_traced import graph_break

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
