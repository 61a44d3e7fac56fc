"""A public call watched, and its ``"call"`` record (Note [watching a call] in ``hop._observe``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from hop import _observe, _spec, config
from hop._observe import Frame
from hop._pytree import flatten_dropping_none
from hop._records import DispatchRecord

__all__ = ["branch_facts", "call_record", "static_length", "watch"]


def watch(op: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
    """``fn(*args, **kwargs)`` (the public function of ``op``), then one ``"call"`` record."""
    start = time.perf_counter()
    error: BaseException | None = None
    try:
        with _observe.frame(op) as frame:
            return fn(*args, **(kwargs or {}))
    except BaseException as e:
        error = e
        raise
    finally:
        elapsed = (time.perf_counter() - start) * 1e6
        _observe.emit(call_record(frame, args, kwargs or {}, elapsed, error))


def call_record(
    frame: Frame, args: tuple[Any, ...], kwargs: dict[str, Any], elapsed_us: float, error: BaseException | None
) -> DispatchRecord:
    """What ``frame`` learned, completed from the call's arguments where the eager
    fast path (which notes nothing) decided."""
    spec = _spec.spec_of(frame.op) or _spec.OpSpec(frame.op)  # an operator without one: nothing to add
    eager = frame.landing is None
    if eager and error is None:
        if spec.describe is not None:
            spec.describe(frame, args, kwargs)
        if spec.over is not None and not frame.inline:
            frame.detail = f"as hop.{spec.over} (its record is the one before)"
        if spec.validates and frame.validation is None and frame.detail is None:
            # the fast path read the verdict cache directly (validate "once") or skipped it
            frame.validation = "off" if config.validate == "never" else "cached"
    if eager:
        key, route, kernel = "eager", "fast-path" if spec.inline_cache and not frame.inline else "inline", None
        detail = frame.detail
    else:
        landing = frame.landing
        assert landing is not None
        key, route, kernel, detail = landing.key, landing.route, landing.kernel, landing.detail
    if frame.traced:  # a branch may have run to give the node's value: not the program's choice
        frame.branch, frame.trips = None, None
        detail = f"{detail}; traced" if detail else "traced"
    if error is not None:
        detail = f"raised {type(error).__name__}" + (f"; {detail}" if detail else "")
    return DispatchRecord(
        frame.op,
        key,
        route,
        kernel,
        detail,
        kind="call",
        role=None if frame.branch is None else spec.role(frame.branch),
        branch=frame.branch,
        trips=frame.trips,
        length=frame.length,
        validation=frame.validation,
        validation_us=frame.validation_us or None,
        closures=tuple(frame.closures),
        elapsed_us=elapsed_us,
        depth=frame.depth,
        import_us=frame.import_us or None,
    )


def branch_facts(frame: Frame, python: type, what: str, k: int, selector: Any) -> None:
    """The fast path notes nothing: the branch is the one the selector's value picks."""
    if type(selector) is python:
        frame.detail, frame.inline = f"{what}: the branch just runs", True
    elif type(selector).__module__ == "numpy":  # the call with its Python value is the record before
        frame.detail, frame.inline = f"a numpy {type(selector).__name__}: run as a Python value", True
    if frame.branch is None:
        frame.branch = k


def static_length(xs: Any, dim: Any) -> int | None:
    leaves = [x for x in flatten_dropping_none(xs)[0] if isinstance(x, torch.Tensor)]
    if not leaves or type(dim) is not int or not -leaves[0].dim() <= dim < leaves[0].dim():
        return None
    n = leaves[0].shape[dim]
    return n if type(n) is int else None
