"""Observability: see where each hop operator call was routed and why.

``HOP_LOG=dispatch`` in the environment logs every dispatch decision to the
``hop.dispatch`` logger (on stderr). :func:`trace` records them in a list::

    with hop.debug.trace() as records:
        torch.ops.hop.cond(pred, f, g, (x,))
    for r in records:
        print(r)  # cond: AutogradCPU -> below autograd, then CPU -> cond_dense ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Iterator

from hop._draw import draw

__all__ = ["DispatchRecord", "draw", "trace"]

_logger = logging.getLogger("hop.dispatch")


@dataclasses.dataclass(frozen=True)
class DispatchRecord:
    """One routing decision of hop's dispatcher.

    Attributes:
        op: operator name (``"cond"``).
        key: the dispatch key the decision was taken at (``"AutogradCPU"``).
        route: what happened: ``"kernel"``, ``"mode"``, ``"subclass"``,
            ``"transform"``, ``"below-autograd"``, ``"torch-function"``, ...
        kernel: the qualified name of the function that ran, if any.
        detail: the mode, subclass or transform involved, if any.
    """

    op: str
    key: str
    route: str
    kernel: str | None = None
    detail: str | None = None

    def __str__(self) -> str:
        s = f"{self.op}: {self.key} -> {self.route}"
        if self.kernel:
            s += f" {self.kernel}"
        if self.detail:
            s += f" [{self.detail}]"
        return s


# Active sinks. The dispatcher's fast path checks only that this list is empty.
SINKS: list[Callable[[DispatchRecord], None]] = []


def _log_sink(record: DispatchRecord) -> None:
    _logger.info("%s", record)


def _install_env_logging() -> None:
    if "dispatch" not in os.environ.get("HOP_LOG", "").split(","):
        return
    if not _logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[hop.dispatch] %(message)s"))
        _logger.addHandler(handler)
    _logger.setLevel(logging.INFO)
    SINKS.append(_log_sink)


@contextlib.contextmanager
def trace() -> Iterator[list[DispatchRecord]]:
    """Record every dispatch decision made inside the block, in order."""
    records: list[DispatchRecord] = []
    SINKS.append(records.append)
    try:
        yield records
    finally:
        SINKS.remove(records.append)


_install_env_logging()
