"""The record of what hop decided about a call, and where records go.

:class:`DispatchRecord` and ``SINKS`` (the active sinks, with ``HOP_LOG=dispatch``'s
logger among them) live below everything that makes records: the dispatcher and the
observation modules (``hop._observe*``) import them from here, and ``hop.debug``,
the public face that adds :func:`hop.debug.trace` and :func:`hop.debug.draw`,
re-exports them. Kept apart from ``hop.debug`` so that no core module imports a
public module above it (docs/design.md, "Imports go one way").
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Callable

__all__ = ["SINKS", "DispatchRecord"]

_logger = logging.getLogger("hop.dispatch")


@dataclasses.dataclass(frozen=True)
class DispatchRecord:
    """One thing hop decided about an operator call.

    A record of kind ``"dispatch"`` is one routing decision of hop's dispatcher; a
    ``"call"`` record sums up one call of a public function (``hop.cond``, ...),
    eager included, and comes after the records of what ran inside it. Other kinds:
    ``"subgraph"`` (a branch or body traced into a graph), ``"unify"`` (sizes that
    differ between branches or loop iterations made one unbacked symbol),
    ``"assert"`` (a runtime assert put in a traced program) and ``"graph-break"``
    (torch.compile could not capture a call).

    Attributes:
        op: operator name (``"cond"``).
        key: the dispatch key the decision was taken at (``"AutogradCPU"``);
            ``"eager"`` for a public call that ran without the dispatcher, ``"trace"``
            for what tracing decided, ``"Dynamo"`` for a graph break.
        route: what happened: ``"kernel"``, ``"mode"``, ``"subclass"``,
            ``"transform"``, ``"below-autograd"``, ``"torch-function"``, ...; for an
            eager call ``"fast-path"`` or ``"inline"`` (the general eager path).
        kernel: the qualified name of the function that ran, if any.
        detail: the mode, subclass or transform involved, if any (or what else
            there is to say: a graph's size, a unification, a break's reason).
        kind: ``"dispatch"``, ``"call"``, ``"subgraph"``, ``"unify"``, ``"assert"``
            or ``"graph-break"``.
        role: the callable concerned (``"true_fn"``, ``"body_fn"``), if one is.
        branch: the index of the branch that ran (cond: 0 for ``true_fn``).
        trips: how many times a loop's body ran (while_loop, fori_loop, scan, map).
        length: the scanned length (scan, map, associative_scan).
        validation: ``"ran"`` (checked on fake tensors now), ``"failed"``,
            ``"cached"`` (the validate-once verdict was known) or ``"off"``
            (``hop.config.validate = "never"``); None where nothing validates.
        validation_us: how long the validation run took, in microseconds.
        closures: the tensors (and sizes) lifted from what the callables close
            over, described (``"float32[3] requires_grad"``).
        elapsed_us: how long the whole call took, in microseconds.
        depth: how many public calls enclose this record (0: called by the program).
        import_us: of ``elapsed_us``, torch's one-time import of ``torch._dynamo``, which
            the process's first validation pays (its shape environment imports it); None
            on every later call.
    """

    op: str
    key: str
    route: str
    kernel: str | None = None
    detail: str | None = None
    kind: str = "dispatch"
    role: str | None = None
    branch: int | None = None
    trips: int | None = None
    length: int | None = None
    validation: str | None = None
    validation_us: float | None = None
    closures: tuple[str, ...] = ()
    elapsed_us: float | None = None
    depth: int = 0
    import_us: float | None = None

    def __str__(self) -> str:
        s = f"{self.op}: {self.key} -> {self.route}"
        if self.kernel:
            s += f" {self.kernel}"
        if self.detail:
            s += f" [{self.detail}]"
        facts = self._facts()
        return f"{s}: {', '.join(facts)}" if facts else s

    def _facts(self) -> list[str]:
        facts = []
        if self.branch is not None:
            facts.append(f"branch {self.branch}" + (f" ({self.role})" if self.role else ""))
        elif self.role:
            facts.append(self.role)
        if self.trips is not None:
            facts.append(f"{self.trips} trip{'' if self.trips == 1 else 's'}")
        if self.length is not None:
            facts.append(f"length {self.length}")
        if self.validation is not None:
            took = f" in {self.validation_us:.0f} us" if self.validation_us else ""
            facts.append(f"validation {self.validation}{took}")
        if self.closures:
            facts.append(f"lifted {len(self.closures)} from closures ({', '.join(self.closures)})")
        if self.elapsed_us is not None:
            facts.append(f"took {self.elapsed_us:.0f} us")
        if self.import_us is not None:
            facts.append(f"of which {self.import_us:.0f} us torch's one-time import of torch._dynamo")
        return facts


DispatchRecord.__module__ = "hop.debug"  # its public home, as before: pickles and reprs name it there

# Active sinks. The eager fast paths check only that this list is empty.
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


_install_env_logging()
