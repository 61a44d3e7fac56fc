"""What branches and bodies return, compared: :func:`check_same_outputs` and the words of its messages.

:func:`check_same_outputs` compares the outputs of branches or bodies leaf by leaf
(structure, kind, dtype, device, rank) and raises an :class:`OutputMismatchError`
naming the path that differs; :func:`describe`, :func:`describe_fn` and
:class:`LeafMeta` describe values and callables for it and for every other message.
Separate from tracing and effects: it reads values (real, fake or metadata only)
and never traces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from hop._pytree import flatten, leaf_paths, structure_str
from hop.errors import OutputMismatchError, format_message

__all__ = ["LeafMeta", "check_same_outputs", "describe", "describe_fn", "leaf_meta"]


def describe(value: Any) -> str:
    """Short description of a leaf for error messages."""
    if isinstance(value, torch.Tensor):
        shape = "x".join(str(s) for s in value.shape) or "scalar"
        return f"Tensor({shape}, {str(value.dtype).removeprefix('torch.')}, {value.device})"
    return f"{type(value).__name__}({value!r})"


@dataclasses.dataclass(frozen=True)
class LeafMeta:
    """What output checks compare of a leaf: its kind, dtype, device and shape."""

    kind: str
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    shape: tuple[Any, ...] = ()

    @property
    def ndim(self) -> int:
        return len(self.shape)


def leaf_meta(leaf: Any) -> LeafMeta:
    """The :class:`LeafMeta` of a leaf (a LeafMeta is returned unchanged)."""
    if isinstance(leaf, LeafMeta):
        return leaf
    if isinstance(leaf, torch.Tensor):
        return LeafMeta("Tensor", leaf.dtype, leaf.device, tuple(leaf.shape))
    if isinstance(leaf, (int, torch.SymInt)) and not isinstance(leaf, bool):
        return LeafMeta("int")
    return LeafMeta(type(leaf).__name__)


def describe_fn(fn: Any) -> str:
    """``name (file.py:12)`` for a callable, for error messages."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__func__", None), "__code__", None)
    if code is None:
        return name
    return f"{name} ({code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno})"


def _fmt_dtype(d: torch.dtype | None) -> str:
    return str(d).removeprefix("torch.")


def check_same_outputs(
    op: str,
    roles: Sequence[str],
    outputs: Sequence[Any],
    *,
    root: str = "output",
    check_rank: bool = True,
    fns: Sequence[Any] | None = None,
) -> None:
    """Raise :class:`OutputMismatchError` unless every output has the structure,
    leaf kinds, dtypes, devices (and ranks) of ``outputs[0]``.

    Args:
        op: operator name for the message (``"cond"``).
        roles: a name per output, e.g. ``("true_fn", "false_fn")``.
        outputs: what each callable returned (leaves may be :class:`LeafMeta`).
        root: the name of the output in paths (``output[1]["h"]``).
        check_rank: sizes may always differ; ranks too when False.
        fns: the callables, to name them and their source in the message.
    """
    ref_leaves, ref_spec = flatten(outputs[0])
    for k in range(1, len(outputs)):
        role, out = roles[k], outputs[k]
        pair = f"{roles[0]} and {role}"
        named = (
            []
            if fns is None
            else [f"{r} is {describe_fn(f)}" for r, f in ((roles[0], fns[0]), (role, fns[k])) if f is not None]
        )
        where = f" ({', '.join(named)})" if named else ""
        leaves, spec = flatten(out)
        if spec != ref_spec:
            raise OutputMismatchError(
                format_message(
                    op,
                    f"{pair} return different structures: {structure_str(outputs[0])} vs {structure_str(out)}{where}",
                    fix=f"Make {pair} return the same pytree structure.",
                ),
                op=op,
                role=role,
                path=root,
            )
        paths = leaf_paths(outputs[0], root)
        for path, a, b in zip(paths, ref_leaves, leaves, strict=True):
            ma, mb = leaf_meta(a), leaf_meta(b)
            diff = None
            if ma.kind != mb.kind:
                diff = f"{ma.kind} vs {mb.kind}"
            elif ma.dtype != mb.dtype:
                diff = f"dtype {_fmt_dtype(ma.dtype)} vs {_fmt_dtype(mb.dtype)}"
            elif ma.device != mb.device:
                diff = f"device {ma.device} vs {mb.device}"
            elif check_rank and ma.ndim != mb.ndim:
                diff = f"rank {ma.ndim} vs {mb.ndim} (shapes {tuple(ma.shape)} vs {tuple(mb.shape)})"
            if diff is not None:
                raise OutputMismatchError(
                    format_message(
                        op,
                        f"{pair} disagree at {path}: {diff}{where}",
                        fix=f"Make both return the same kind of value at {path}.",
                    ),
                    op=op,
                    role=role,
                    path=path,
                )
