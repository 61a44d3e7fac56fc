"""hop's pytrees, both conventions: torch's, where ``None`` is a leaf, and the loops', where it is not.

:func:`flatten` / :func:`unflatten` are torch's C++ (optree-backed) pytree, with
``None`` a leaf; :func:`flatten_dropping_none` drops ``None`` (a scan body's
``return carry, None`` has no y) and unflattens with the same :func:`unflatten`.
:func:`leaf_paths` and :func:`leaf_paths_dropping_none` name each leaf as
``output[1]["h"]`` for messages, :func:`structure_str` a whole structure. Kept apart as the bottom of the stack: every
other module flattens, and none of this needs torch's tracing machinery.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
import torch.utils._cxx_pytree as _pytree  # optree-backed: ~5x faster than _pytree
import torch.utils._pytree as py_pytree

__all__ = [
    "TreeSpec",
    "flatten",
    "unflatten",
    "flatten_dropping_none",
    "leaf_paths",
    "leaf_paths_dropping_none",
    "map_tensors",
    "structure_str",
    "tensors_in",
]


TreeSpec = Any  # a py or cxx pytree spec; both support equality and unflatten


def flatten(tree: Any) -> tuple[list[Any], TreeSpec]:
    """Leaves and structure of a pytree."""
    return _pytree.tree_flatten(tree)


def unflatten(leaves: Sequence[Any], spec: TreeSpec) -> Any:
    """Inverse of :func:`flatten`."""
    return _pytree.tree_unflatten(list(leaves), spec)


def flatten_dropping_none(tree: Any) -> tuple[list[Any], Any]:
    """Leaves and structure, ``None`` an empty subtree (``return carry, None`` has no y),
    where :func:`flatten` (torch's convention) keeps ``None`` as a leaf; the
    structure unflattens with :func:`unflatten`."""
    return optree.tree_flatten(tree, none_is_leaf=False, namespace="torch")


def leaf_paths_dropping_none(tree: Any, root: str) -> list[str]:
    """``root[1]["h"]``-style names of the leaves of ``tree`` in :func:`flatten_dropping_none`'s order."""
    paths = []
    for accessor in optree.tree_accessors(tree, none_is_leaf=False, namespace="torch"):
        path = root
        for e in accessor:
            if isinstance(e, optree.NamedTupleEntry):
                path += f".{e.field}"
            elif isinstance(e, optree.GetAttrEntry):
                path += f".{e.name}"
            elif isinstance(e, optree.MappingEntry) and isinstance(e.entry, str):
                path += f'["{e.entry}"]'
            else:
                path += f"[{e.entry!r}]"
        paths.append(path)
    return paths


def _key_str(entry: Any) -> str:
    if isinstance(entry, py_pytree.SequenceKey):
        return f"[{entry.idx}]"
    if isinstance(entry, py_pytree.MappingKey):
        key = entry.key
        return f'["{key}"]' if isinstance(key, str) else f"[{key!r}]"
    if isinstance(entry, py_pytree.GetAttrKey):
        return f".{entry.name}"
    return str(entry)


def leaf_paths(tree: Any, root: str = "output") -> list[str]:
    """``root[1]["h"]``-style names for the leaves of ``tree``, in flatten order."""
    pairs, _ = py_pytree.tree_flatten_with_path(tree)
    return [root + "".join(_key_str(k) for k in path) for path, _ in pairs]


def structure_str(tree: Any, *, dropping_none: bool = False) -> str:
    """``tree``'s structure with each leaf shown as ``*``, for messages (``(*, [*, *])``);
    with ``dropping_none``, a ``None`` shows as itself, an empty subtree."""
    if dropping_none:
        shown = optree.tree_map(lambda _: "*", tree, none_is_leaf=False, namespace="torch")
    else:
        shown = py_pytree.tree_map(lambda _: "*", tree)
    return str(shown).replace("'*'", "*")


_Tensor = torch.Tensor  # a module global: these run on every dispatched call


def tensors_in(tree: Any, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The tensors in nested tuples, lists and dicts, in order (no pytree cost)."""
    if out is None:
        out = []
    if isinstance(tree, _Tensor):
        out.append(tree)
    elif type(tree) in (tuple, list):
        for x in tree:
            if isinstance(x, _Tensor):
                out.append(x)
            elif type(x) in (tuple, list, dict):
                tensors_in(x, out)
    elif type(tree) is dict:
        for x in tree.values():
            tensors_in(x, out)
    return out


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """Apply ``fn`` to every tensor in nested tuples, lists and dicts."""
    if isinstance(tree, _Tensor):
        return fn(tree)
    if type(tree) in (tuple, list):
        return type(tree)(map_tensors(fn, x) for x in tree)
    if type(tree) is dict:
        return {k: map_tensors(fn, v) for k, v in tree.items()}
    return tree
