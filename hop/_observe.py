"""What hop records of its calls: ``hop.debug.trace()``, ``HOP_LOG=dispatch`` and ``TORCH_TRACE``.

Note [watching a call]
The public functions (``hop.cond``, ...) have eager paths that never reach the
dispatcher, so its records alone would leave an eager program's trace empty.
While a sink is installed (``SINKS`` is not empty) each public function diverts,
with one truthiness test near its top, to ``hop._observe_calls.watch``: it opens a
:class:`Frame` (:func:`frame`), runs the public function again (:func:`claim` lets that second
entry through), and emits one record of kind ``"call"`` when it returns. The code
the call runs notes what it decided into the innermost frame of its operator
(:func:`note`, the validation and closure hooks, the dispatcher's records), so the
eager fast paths themselves are never touched. No sink: none of this runs.

TORCH_TRACE artifacts (traced subgraphs, unification decisions, runtime asserts,
validation verdicts, graph breaks) do not depend on the sinks: they are emitted
when torch's structured trace has somewhere to write (:func:`structured_on`),
from paths that trace or validate, which are slow anyway.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch._logging import _internal as _torch_logging

from hop._records import SINKS, DispatchRecord

__all__ = ["SINKS", "claim", "frame", "note", "emit", "structured_on", "artifact"]

Fn = Callable[..., Any]
_LOCAL = threading.local()
# dispatcher routes that pass a call on rather than decide it: a frame's route is
# the first record past them
_PASSING = ("below-autograd", "torch-function", "past user mode")


@dataclasses.dataclass
class Frame:
    """What one public call decided so far (Note [watching a call])."""

    op: str
    depth: int
    landing: DispatchRecord | None = None  # the dispatcher's first deciding record
    inline: bool = False  # the general eager path ran (not the fast path)
    branch: int | None = None
    trips: int | None = None
    length: int | None = None
    validation: str | None = None  # "ran", "failed", "cached", "off"
    validation_us: float = 0.0
    import_us: float = 0.0  # Note [the first ShapeEnv imports torch._dynamo] in hop._fake_run
    closures: list[str] = dataclasses.field(default_factory=list)
    detail: str | None = None
    traced: bool = False  # a node was put in a traced program: no branch ran for the program


def _frames() -> list[Frame]:
    frames: list[Frame] | None = getattr(_LOCAL, "frames", None)
    if frames is None:
        frames = _LOCAL.frames = []
    return frames


def current(op: str | None = None) -> Frame | None:
    """The innermost open frame, if it is ``op``'s (any operator's without ``op``)."""
    frames = _frames()
    if not frames or (op is not None and frames[-1].op != op):
        return None
    return frames[-1]


def depth(op: str) -> int:
    """How many public calls enclose a record of ``op`` (its own call not counted)."""
    frames = _frames()
    return len(frames) - 1 if frames and frames[-1].op == op else len(frames)


def emit(record: DispatchRecord) -> None:
    for sink in list(SINKS):
        sink(record)


# --- public calls --------------------------------------------------------------------------


def claim() -> bool:
    """Whether a public function, with sinks installed, should divert to :func:`watch`:
    False exactly once after :func:`watch` re-entered it."""
    if getattr(_LOCAL, "reentry", False):
        _LOCAL.reentry = False
        return False
    return True


@contextlib.contextmanager
def frame(op: str) -> Iterator[Frame]:
    """The frame of one watched public call of ``op``, open while the public function
    runs again (its :func:`claim` lets that entry through)."""
    frames = _frames()
    opened = Frame(op, len(frames))
    frames.append(opened)
    _LOCAL.reentry = True
    try:
        yield opened
    finally:
        _LOCAL.reentry = False  # consumed by the public function's claim(); never left set
        frames.pop()


def note(
    op: str,
    *,
    inline: bool = False,
    branch: int | None = None,
    trips: int | None = None,
    detail: str | None = None,
) -> None:
    """What ``op``'s code decided, into the innermost frame if it is ``op``'s."""
    frame = current(op)
    if frame is None:
        return
    frame.inline = frame.inline or inline
    if branch is not None and frame.branch is None:
        frame.branch = branch
    if trips is not None:
        frame.trips = trips
    if detail is not None:
        frame.detail = detail


def counted(op: str, fn: Fn) -> Fn:
    """``fn`` (a loop's condition) counting the trips of the loop into ``op``'s frame."""
    frame = current(op)
    if frame is None:
        return fn
    frame.trips = -1  # the last call of the condition ends the loop

    def counting(*args: Any) -> Any:
        frame.trips = (frame.trips or 0) + 1
        return fn(*args)

    return counting


def dispatched(record: DispatchRecord) -> None:
    """A record of hop's dispatcher: the innermost frame of its operator takes the
    first one that decides the call as its route."""
    frame = current(record.op)
    if frame is not None and frame.landing is None and record.route not in _PASSING:
        frame.landing = record


def closures(values: Sequence[Any]) -> None:
    """Tensors (and sizes) a call lifted from what its callables close over."""
    frame = current()
    if frame is not None:
        frame.closures.extend(describe(v) for v in values)


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        shape = ", ".join(str(s) for s in value.shape)
        grad = " requires_grad" if value.requires_grad else ""
        return f"{str(value.dtype).removeprefix('torch.')}[{shape}]{grad}"
    return f"{type(value).__name__} {value}"


# --- validation -------------------------------------------------------------------------------


def validation_cached(off: bool) -> None:
    """The validate-once verdict cache answered (or validation is off)."""
    frame = current()
    if frame is not None and frame.validation is None:
        frame.validation = "off" if off else "cached"


@contextlib.contextmanager
def validation_run() -> Iterator[None]:
    """Around one validation run on fake tensors: its time and, on failure, its error."""
    frame = current()
    start = time.perf_counter()
    try:
        yield
    except BaseException as e:
        us = (time.perf_counter() - start) * 1e6
        if frame is not None:
            frame.validation, frame.validation_us = "failed", frame.validation_us + us
        if structured_on():
            op = getattr(e, "op", None) or (frame.op if frame is not None else None)
            verdict = {"op": op, "verdict": "failed", "error": f"{type(e).__name__}: {e}", "us": round(us)}
            artifact(f"hop_validation_{op}", verdict)
        raise
    us = (time.perf_counter() - start) * 1e6
    _LOCAL.last_validation_us = us
    if frame is not None:
        frame.validation, frame.validation_us = "ran", frame.validation_us + us


def one_time_import(us: float) -> None:
    """The call made the process's first ShapeEnv, which imported torch._dynamo in ``us``."""
    frame = current()
    if frame is not None:
        frame.import_us += us


def verdict(key: Any, kind: Any, describe: Callable[[Any], str]) -> None:
    """A validation passed and was remembered under ``key`` (its first item: the
    operator); ``describe`` puts its output kind in words (validation's, above this module)."""
    if not structured_on():
        return
    op = key[0] if isinstance(key, tuple) and key and isinstance(key[0], str) else "?"
    us, _LOCAL.last_validation_us = getattr(_LOCAL, "last_validation_us", None), None
    output = _kind_str(kind, describe)
    payload = {"op": op, "verdict": "passed", "output": output, "us": None if us is None else round(us)}
    artifact(f"hop_validation_{op}", payload)


def _kind_str(kind: Any, describe: Callable[[Any], str]) -> str:
    if kind is None:
        return "not checked (cannot run on fake tensors)"
    try:
        return describe(kind)
    except Exception:  # a kind this version cannot describe: the raw value still says something
        return repr(kind)


# --- torch's structured trace (TORCH_TRACE) ------------------------------------------------------


def structured_on() -> bool:
    """Whether torch's structured trace writes anywhere: its lazy file handler with a
    directory (``TORCH_TRACE=<dir>``), or a handler someone added to read it. The
    handlers pytest's log capture puts on every logger do not count (under pytest the
    trace would otherwise always be on, and hop's artifacts formatted for nothing)."""
    lazy = _torch_logging.LazyTraceHandler
    return any(
        h.root_dir is not None if isinstance(h, lazy) else not type(h).__module__.startswith("_pytest")
        for h in _torch_logging.trace_log.handlers
    )


def artifact(name: str, payload: str | dict[str, Any]) -> None:
    """One structured-trace artifact: text (FX code) or a JSON object."""
    encoding = "string" if isinstance(payload, str) else "json"
    _torch_logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": encoding},
        payload_fn=lambda: payload,
        expect_trace_id=False,  # also outside torch.compile (make_fx, export, eager)
    )
