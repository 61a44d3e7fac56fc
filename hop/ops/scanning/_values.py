"""How a loop's operands and outputs are laid out: slices of ``xs``, stacked ``ys``, the flat output.

:func:`slices` and :func:`empty_slices` cut ``xs`` along the scanned dimension (or
stand in for one slice), :func:`stack_ys` and :func:`stack_dim` stack what the
iterations return, :func:`pack` is the raw ops' output convention (a bare value
for one leaf) and :func:`no_alias` keeps a loop from returning its operands.
Plain tensor manipulation, shared by the eager paths, the rules, scan's
derivatives and the Dynamo handlers; apart from the checks, which say what is
wrong, and from the rules, which decide what runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optree
import torch

from hop import _effects
from hop.ops.scanning._checks import Fn, Names, ys_error

_Tensor = torch.Tensor


def raw_output(flat: Sequence[Any]) -> Any:
    """The raw ops' output convention: a bare value for one leaf, else a tuple."""
    return flat[0] if len(flat) == 1 else tuple(flat)


def stack_ys(looping: Names, fn: Fn, ys: Sequence[Any], dim: int, root: str) -> Any:
    """The outputs of every iteration, each leaf stacked along ``dim``."""
    try:
        if isinstance(ys[0], _Tensor):
            return torch.stack(_same_dtype(ys), dim)
        return optree.tree_map(
            lambda *col: torch.stack(_same_dtype(col), dim), *ys, none_is_leaf=False, namespace="torch"
        )
    except (RuntimeError, TypeError, ValueError, IndexError) as e:
        raise ys_error(looping, fn, ys, dim, root) or e from None


def _same_dtype(col: Sequence[Any]) -> list[Any]:
    """``col``, whose tensors share one dtype: torch.stack would promote silently."""
    dtype = getattr(col[0], "dtype", None)
    for y in col:
        if getattr(y, "dtype", None) is not dtype:
            raise TypeError("iterations return different dtypes")
    return list(col)


def stack_dim(dim: int, rank: int) -> int:
    """``dim`` as a non-negative position in a stack of tensors of rank ``rank``."""
    return dim if dim >= 0 else dim + rank + 1


def slices(xs: Any, leaves: Sequence[torch.Tensor], spec: Any, dims: Sequence[int]) -> Sequence[Any]:
    """The slices of ``xs`` along ``dims``, as pytrees shaped like ``xs``."""
    if isinstance(xs, _Tensor):
        return xs.unbind(dims[0])
    columns = [x.unbind(d) for x, d in zip(leaves, dims, strict=True)]
    return [optree.tree_unflatten(spec, list(col)) for col in zip(*columns, strict=True)]


def empty_slices(leaves: Sequence[torch.Tensor], dims: Sequence[int]) -> list[torch.Tensor]:
    """Uninitialized tensors shaped like one slice of each leaf (to trace or run on fake tensors)."""
    return [
        torch.empty([s for k, s in enumerate(x.shape) if k != d], dtype=x.dtype, device=x.device)
        for x, d in zip(leaves, dims, strict=True)
    ]


def no_alias(leaves: Sequence[Any], inputs: Sequence[Any]) -> list[Any]:
    """``leaves`` with every tensor that is or views an input cloned."""
    if any(isinstance(o, _Tensor) and (o._is_view() or any(o is x for x in inputs)) for o in leaves):
        return _effects.clone_aliases(leaves, inputs)
    return list(leaves)
