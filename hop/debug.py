"""Observability: see where each hop operator call went and why.

``HOP_LOG=dispatch`` in the environment logs every record to the ``hop.dispatch``
logger (on stderr). :func:`trace` collects them in a list::

    with hop.debug.trace() as records:
        hop.cond(pred, f, g, (x,))
    for r in records:
        print(r)  # cond: eager -> inline: branch 0 (true_fn), validation ran in 900 us, ...

With ``TORCH_TRACE=<dir>`` hop also writes its traced subgraphs and decisions to
torch's structured trace, which ``tlparse`` renders (see docs/debugging.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from hop._draw import draw
from hop._records import SINKS, DispatchRecord

__all__ = ["DispatchRecord", "draw", "trace"]

# SINKS: the active sinks (hop._records), as before reachable here


@contextlib.contextmanager
def trace() -> Iterator[list[DispatchRecord]]:
    """Collect every record made inside the block, in order: each public call
    (eager included), each decision of the dispatcher, what tracing decided."""
    records: list[DispatchRecord] = []
    SINKS.append(records.append)
    try:
        yield records
    finally:
        SINKS.remove(records.append)
