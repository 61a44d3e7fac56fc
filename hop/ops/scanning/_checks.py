"""The checks scan, map and associative_scan make of their arguments and of what their callable returns.

Arguments: :func:`check_callable`, :func:`check_leaves`, :func:`check_xs` (each
leaf's scanned dimension and the common length). Outputs: :func:`check_carry` and
:func:`check_like` (a next carry against ``init``), :func:`not_a_pair`,
:func:`ys_error` (why the iterations' outputs cannot be stacked),
:func:`check_static` and :func:`on_fake` (the outputs of a loop of length 0). The
eager paths, the rules and the Dynamo handlers (``hop.compile._dynamo_scans``) all
call them, so each mistake reads the same wherever it is caught; apart from the
rules because they need only an operator's name and its callable's role
(:class:`Names`), not the family's record.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from hop import _fake_run, _output_checks, _validation
from hop._pytree import flatten_dropping_none, leaf_paths_dropping_none, structure_str
from hop.errors import HopRuntimeError, HopTypeError, HopValueError, OutputMismatchError, format_message, type_name
from hop.ops import _common

LENGTH = "the number of steps is the length of xs, which the trace fixes"  # Note [the legacy ONNX exporter]

Fn = Callable[..., Any]
_Tensor = torch.Tensor
_PAIR = (tuple, list)
_check: Callable[..., None] = torch._check  # untyped in torch


class Names(Protocol):
    """What the checks read of a looping operator's record (``hop.ops.scanning._rules.Looping``)."""

    @property
    def name(self) -> str: ...  # the operator: "scan"
    @property
    def role(self) -> str: ...  # its callable's parameter name: "combine_fn"


def check_callable(name: str, role: str, fn: Any) -> None:
    if not callable(fn):
        raise HopTypeError(format_message(name, f"{role} must be callable, got {type_name(fn)}"), op=name, role=role)


def check_leaves(name: str, root: str, tree: Any, leaves: Sequence[Any], *, ints: bool = False) -> None:
    """Every leaf is a tensor (or an int / SymInt when ``ints``)."""
    kinds = (torch.Tensor, int, torch.SymInt) if ints else (torch.Tensor,)
    for path, leaf in zip(leaf_paths_dropping_none(tree, root), leaves, strict=True):
        if not isinstance(leaf, kinds) or isinstance(leaf, bool):
            what = "a tensor or an int" if ints else "a tensor"
            raise HopTypeError(
                format_message(
                    name,
                    f"must be {what}, got {type_name(leaf)}",
                    path=path,
                    fix=f"Close over other values in the function instead of passing them in {root}.",
                ),
                op=name,
                role=root,
                path=path,
            )


def check_xs(name: str, xs: Any, leaves: Sequence[torch.Tensor], dim: Any) -> tuple[list[int], Any]:
    """Each leaf's scanned dimension (``dim`` made non-negative per leaf) and the common length."""
    if type(dim) is not int:
        raise HopTypeError(format_message(name, f"dim must be an int, got {type_name(dim)}"), op=name, role="dim")
    if not leaves:
        raise HopValueError(
            format_message(name, "xs must contain at least one tensor: the length of the loop is read from it"),
            op=name,
            role="xs",
        )
    check_leaves(name, "xs", xs, leaves)
    paths = leaf_paths_dropping_none(xs, "xs")
    dims: list[int] = []
    for path, x in zip(paths, leaves, strict=True):
        if x.dim() == 0 or not -x.dim() <= dim < x.dim():
            raise HopValueError(
                format_message(
                    name,
                    f"dim {dim} is out of range for a tensor of rank {x.dim()}",
                    path=path,
                    fix=f"Pass a dim in [-{x.dim()}, {x.dim() - 1}]." if x.dim() else "Pass tensors of rank >= 1.",
                ),
                op=name,
                role="dim",
                path=path,
            )
        dims.append(dim % x.dim())
    n = leaves[0].shape[dims[0]]
    if type(n) is not int:
        _common.refuse_legacy_onnx(name, LENGTH)
        n = _common.static_size(n)  # Note [sizes under jit.trace]
    for path, x, d in zip(paths[1:], leaves[1:], dims[1:], strict=True):
        if not _lengths_agree(x.shape[d], n, f"hop.{name}: {path} and {paths[0]} must have the same length"):
            raise HopValueError(
                format_message(
                    name,
                    f"has length {x.shape[d]} along dim {dim}, but {paths[0]} has length {n}",
                    path=path,
                    fix=f"Give every leaf of xs the same length along dim {dim}.",
                ),
                op=name,
                role="xs",
                path=path,
            )
    return dims, n


def _lengths_agree(a: Any, b: Any, message: str) -> bool:
    """Whether two leaves of xs have the same length: known equal, or symbols the trace
    may take as equal (a Dim shared by two inputs is two symbols until something
    guards their equality: this does, as torch's own ops do for the shapes they
    combine; a data-dependent length gets a runtime assert instead)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, guard_or_false, guard_or_true

    if _same_size(a, b) or guard_or_false(a == b):
        return True
    if free_unbacked_symbols(a) or free_unbacked_symbols(b) or guard_or_true(a == b):
        # undecided: a data-dependent length, or a trace that does not read sizes' hints
        # (torch's ONNX exporter traces with backed_size_oblivious): checked when it runs
        _check(a == b, lambda: message)
        return True
    return False


def _same_size(a: Any, b: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if a is b:
        return True
    if type(a) is int and type(b) is int:
        return a == b
    a, b = _common.static_size(a), _common.static_size(b)  # Note [sizes under jit.trace]
    return bool(statically_known_true(a == b))


def not_a_pair(looping: Names, fn: Fn, out: Any) -> HopTypeError:
    got = f"a {type(out).__name__} of length {len(out)}" if isinstance(out, _PAIR) else type_name(out)
    return HopTypeError(
        format_message(
            looping.name,
            f"{looping.role} must return a (next_carry, y) pair, got {got} "
            f"({looping.role} is {_output_checks.describe_fn(fn)})",
            fix="Return a tuple (next_carry, y); use () or None for an empty carry or no y.",
        ),
        op=looping.name,
        role=looping.role,
    )


def check_carry(looping: Names, fn: Fn, init: Any, carry: Any) -> list[Any]:
    """``carry``'s leaves, after checking it has ``init``'s structure, dtypes, devices and shapes."""
    fix = f"{looping.role} must return a next_carry with the structure, dtypes, devices and shapes of init."
    return check_like(looping.name, looping.role, fn, init, carry, "carry", "init and next_carry", fix)


def check_like(name: str, role: str, fn: Fn, ref: Any, out: Any, root: str, pair: str, fix: str = "") -> list[Any]:
    """``out``'s leaves, after checking it has ``ref``'s structure and, per tensor leaf,
    dtype, device and shape; errors name ``root``-based paths and ``pair`` ("init and next_carry")."""
    leaves, spec = flatten_dropping_none(out)
    ref_leaves, ref_spec = flatten_dropping_none(ref)
    where = f"({role} is {_output_checks.describe_fn(fn)})"
    fix = fix or f"{role} must return values with the structure, dtypes, devices and shapes of its inputs."
    if spec != ref_spec:
        raise OutputMismatchError(
            format_message(
                name,
                f"{pair} differ: structure {_shown(ref)} vs {_shown(out)} {where}",
                role=role,
                path=root,
                fix=fix,
            ),
            op=name,
            role=role,
            path=root,
        )
    paths = leaf_paths_dropping_none(ref, root)
    found = _common.untraced(_first_difference, paths, ref_leaves, leaves)  # Note [sizes under jit.trace]
    if found is not None:
        path, diff = found
        raise OutputMismatchError(
            format_message(name, f"{pair} differ: {diff} {where}", role=role, path=path, fix=fix),
            op=name,
            role=role,
            path=path,
        )
    return leaves


def _first_difference(paths: Sequence[str], refs: Sequence[Any], leaves: Sequence[Any]) -> tuple[str, str] | None:
    """The path of the first of ``leaves`` that differs from its ``refs``, and how."""
    for path, a, b in zip(paths, refs, leaves, strict=True):
        diff = leaf_difference(a, b)
        if diff is not None:
            return path, diff
    return None


def _shown(tree: Any) -> str:
    return structure_str(tree, dropping_none=True)


def leaf_difference(a: Any, b: Any) -> str | None:
    """How tensor ``b`` differs from tensor ``a`` in kind, dtype, device or shape (None if it does not)."""
    if not isinstance(b, _Tensor):
        return f"Tensor vs {type_name(b)}"
    if a.dtype != b.dtype:
        return f"dtype {_dtype(a)} vs {_dtype(b)}"
    if a.device != b.device:
        return f"device {a.device} vs {b.device}"
    if a.dim() != b.dim():
        return f"rank {a.dim()} vs {b.dim()} (shapes {tuple(a.shape)} vs {tuple(b.shape)})"
    if not all(_same_size(p, q) for p, q in zip(a.shape, b.shape, strict=True)):
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    return None


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def ys_error(looping: Names, fn: Fn, ys: Sequence[Any], dim: int, root: str) -> HopValueError | None:
    """Why the outputs of the iterations cannot be stacked along ``dim``."""
    where = f"({looping.role} is {_output_checks.describe_fn(fn)})"
    first, spec = flatten_dropping_none(ys[0])
    for path, leaf in zip(leaf_paths_dropping_none(ys[0], root), first, strict=True):
        if not isinstance(leaf, _Tensor):
            return _ys_fail(looping, f"must be a tensor, got {type_name(leaf)} {where}", path, "Return tensors.")
        if not -leaf.dim() - 1 <= dim <= leaf.dim():
            return _ys_fail(
                looping,
                f"a tensor of rank {leaf.dim()} cannot be stacked along dim {dim} {where}",
                path,
                f"Return tensors of rank >= {dim if dim >= 0 else -dim - 1} or scan along another dim.",
            )
    for i, y in enumerate(ys[1:], start=1):
        leaves, other = flatten_dropping_none(y)
        if other != spec:
            return _ys_fail(
                looping,
                f"iterations 0 and {i} return different structures: {_shown(ys[0])} vs {_shown(y)} {where}",
                root,
                "Return the same structure in every iteration.",
            )
        for path, a, b in zip(leaf_paths_dropping_none(ys[0], root), first, leaves, strict=True):
            diff = leaf_difference(a, b)
            if diff is not None:
                return _ys_fail(
                    looping,
                    f"iterations 0 and {i} differ: {diff} {where}",
                    path,
                    "Every iteration must return tensors of the same dtype, device and shape.",
                )
    return None


def _ys_fail(looping: Names, what: str, path: str, fix: str) -> HopValueError:
    return HopValueError(
        format_message(looping.name, what, role=looping.role, path=path, fix=fix),
        op=looping.name,
        role=looping.role,
        path=path,
    )


def on_fake(looping: Names, fn: Fn, leaves: Sequence[Any], make: Callable[[list[Any]], Any]) -> Any:
    """``make(fake leaves)`` on static fake copies of ``leaves``: the output metadata of an
    empty loop. Traced with symbolic sizes, on ``leaves`` themselves in the trace's own
    fake mode, recording nothing, so that the sizes stay the trace's symbols."""
    traced = _fake_run.traced_mode(leaves)
    if traced is not None:
        with _fake_run.in_traced_mode(traced):
            try:
                return make(list(leaves))
            except _validation.CANNOT_FAKE as e:
                raise _no_empty_metadata(looping, fn, e) from e
    with _validation.fake_inputs(leaves) as fake:
        try:
            _validation.check_hooks(fn)
            return make(fake)
        except _validation.CANNOT_FAKE as e:
            raise _no_empty_metadata(looping, fn, e) from e


def _no_empty_metadata(looping: Names, fn: Fn, e: Exception) -> HopRuntimeError:
    """The error for an empty loop whose function cannot run on fake tensors."""
    hooked = isinstance(e, _validation.HookedModule)  # Note [module hooks do not see validation]
    why = f"{type(e).__name__} ({e})" if hooked else type(e).__name__
    avoid = "calling modules with forward hooks" if hooked else "data-dependent shapes"
    return _empty_loop_error(
        looping,
        f"the shapes of the outputs cannot be found without running {looping.role} ({_output_checks.describe_fn(fn)}), "
        f"which fails on fake tensors: {why}",
        f"Scan over a non-empty dimension, or avoid {avoid} in the function.",
    )


def _empty_loop_error(looping: Names, what: str, fix: str, path: str | None = None) -> HopRuntimeError:
    """``xs has length 0, and <what>``: the outputs of an empty loop cannot be built."""
    return HopRuntimeError(
        format_message(looping.name, f"xs has length 0, and {what}", fix=fix),
        op=looping.name,
        role=looping.role,
        path=path,
    )


def check_static(looping: Names, fn: Fn, ys: Sequence[Any], paths: Sequence[str]) -> None:
    """The ``ys`` of a loop of length 0, run once on fake tensors: their sizes must not
    depend on data, since no step gives them (and torch.empty cannot take an unbacked
    symbol). A size traced symbolically from the inputs' (``dynamic=True``) is known."""
    for path, y in zip(paths, ys, strict=True):
        if any(free_unbacked_symbols(s) for s in y.shape if isinstance(s, torch.SymInt)):
            raise _empty_loop_error(
                looping,
                f"{looping.role} ({_output_checks.describe_fn(fn)}) returns {path} of a data-dependent shape "
                f"{tuple(y.shape)}: the shape of the empty output cannot be known",
                f"Loop over a non-empty dimension, or make the shapes of {looping.role}'s outputs data-independent.",
                path,
            )
