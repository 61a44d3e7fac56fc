"""Subgraph helpers shared by every hop operator.

- pytrees: :func:`flatten` / :func:`unflatten` (torch's C++ pytree when optree is
  installed), :func:`leaf_paths` naming each leaf as ``output[1]["h"]``;
- validation: :func:`check_same_outputs` compares the outputs of branches or
  bodies leaf by leaf and raises a path-naming :class:`OutputMismatchError`;
- tracing: :func:`trace_subgraph` turns a callable into an ``fx.GraphModule`` at
  the current make_fx level (re-entering the active tracer, or under a fresh fake
  mode); :func:`emit` records a call of a hop operator in the active proxy
  tracer's graph with its subgraphs as get_attr submodules;
- effects: :func:`find_mutations_and_aliases` reports the inputs a traced
  subgraph writes and the outputs that alias its inputs;
  :func:`clone_aliases` clones outputs that share storage with inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
import torch.utils._cxx_pytree as _pytree  # optree-backed: ~5x faster than _pytree
import torch.utils._pytree as py_pytree

from hop.errors import OutputMismatchError, format_message

__all__ = [
    "TreeSpec",
    "flatten",
    "unflatten",
    "leaf_paths",
    "describe",
    "check_same_outputs",
    "trace_subgraph",
    "emit",
    "Effects",
    "find_mutations_and_aliases",
    "clone_aliases",
]

TreeSpec = Any  # a py or cxx pytree spec; both support equality and unflatten


def flatten(tree: Any) -> tuple[list[Any], TreeSpec]:
    """Leaves and structure of a pytree."""
    return _pytree.tree_flatten(tree)


def unflatten(leaves: Sequence[Any], spec: TreeSpec) -> Any:
    """Inverse of :func:`flatten`."""
    return _pytree.tree_unflatten(list(leaves), spec)


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


def describe(value: Any) -> str:
    """Short description of a leaf for error messages."""
    if isinstance(value, torch.Tensor):
        shape = "x".join(str(s) for s in value.shape) or "scalar"
        return f"Tensor({shape}, {str(value.dtype).removeprefix('torch.')}, {value.device})"
    return f"{type(value).__name__}({value!r})"


@dataclasses.dataclass(frozen=True)
class _Meta:
    kind: str
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    ndim: int | None = None


def _meta(leaf: Any) -> _Meta:
    if isinstance(leaf, torch.Tensor):
        return _Meta("Tensor", leaf.dtype, leaf.device, leaf.dim())
    if isinstance(leaf, (int, torch.SymInt)) and not isinstance(leaf, bool):
        return _Meta("int")
    return _Meta(type(leaf).__name__)


def _fmt_dtype(d: torch.dtype | None) -> str:
    return str(d).removeprefix("torch.")


def check_same_outputs(
    op: str,
    roles: Sequence[str],
    outputs: Sequence[Any],
    *,
    root: str = "output",
    check_rank: bool = True,
) -> None:
    """Raise :class:`OutputMismatchError` unless every output has the structure,
    leaf kinds, dtypes, devices (and ranks) of ``outputs[0]``.

    Args:
        op: operator name for the message (``"cond"``).
        roles: a name per output, e.g. ``("true_fn", "false_fn")``.
        outputs: what each callable returned.
        root: the name of the output in paths (``output[1]["h"]``).
        check_rank: sizes may always differ; ranks too when False.
    """
    ref_leaves, ref_spec = flatten(outputs[0])
    for role, out in zip(roles[1:], outputs[1:], strict=True):
        leaves, spec = flatten(out)
        if spec != ref_spec:
            raise OutputMismatchError(
                format_message(
                    op,
                    f"{roles[0]} and {role} return different structures: {_spec_str(outputs[0])} vs {_spec_str(out)}",
                    fix=f"Make {roles[0]} and {role} return the same pytree structure.",
                ),
                op=op,
                role=role,
                path=root,
            )
        paths = leaf_paths(outputs[0], root)
        for path, a, b in zip(paths, ref_leaves, leaves, strict=True):
            ma, mb = _meta(a), _meta(b)
            diff = None
            if ma.kind != mb.kind:
                diff = f"{ma.kind} vs {mb.kind}"
            elif ma.dtype != mb.dtype:
                diff = f"dtype {_fmt_dtype(ma.dtype)} vs {_fmt_dtype(mb.dtype)}"
            elif ma.device != mb.device:
                diff = f"device {ma.device} vs {mb.device}"
            elif check_rank and ma.ndim != mb.ndim:
                diff = f"rank {ma.ndim} vs {mb.ndim} (shapes {tuple(a.shape)} vs {tuple(b.shape)})"
            if diff is not None:
                raise OutputMismatchError(
                    format_message(
                        op,
                        f"{roles[0]} and {role} disagree at {path}: {diff}",
                        fix=f"Make both return the same kind of value at {path}.",
                    ),
                    op=op,
                    role=role,
                    path=path,
                )


def _spec_str(tree: Any) -> str:
    return str(py_pytree.tree_map(lambda leaf: "*", tree)).replace("'*'", "*")


# --- tracing ------------------------------------------------------------------


def trace_subgraph(fn: Callable[..., Any], args: Sequence[Any]) -> torch.fx.GraphModule:
    """Trace ``fn(*args)`` into a GraphModule at the current level.

    Under make_fx (and so torch.export), the active tracer's sub-tracer is
    re-entered: it shares the fake mode, the ShapeEnv and the decomposition
    table. Otherwise ``fn`` is traced by a fresh make_fx under the inputs' fake
    mode (or a new one).
    """
    from torch.fx.experimental import proxy_tensor

    tracer = proxy_tensor._CURRENT_MAKE_FX_TRACER
    if tracer is not None:
        return tracer.trace_subgraph(fn, *args)
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode(list(args))
    if fake_mode is None:
        return proxy_tensor.make_fx(fn, tracing_mode="fake")(*args)
    with fake_mode:
        return proxy_tensor.make_fx(fn, tracing_mode="real")(*args)


def emit(mode: Any, op: Any, args: Sequence[Any], out: Any) -> Any:
    """Record ``op(*args)`` in ``mode``'s graph and bind ``out`` to the new node.

    GraphModules in ``args`` (also inside lists and tuples) are registered as
    submodules of the tracer's root, so they appear as get_attr arguments.
    ``out`` is the value the call produces (from the fake rule).
    """
    tracer = mode.tracer

    def to_arg(a: Any) -> Any:
        if isinstance(a, torch.fx.GraphModule):
            name = tracer.get_fresh_qualname(f"{op.name()}_graph_")
            tracer.root.register_module(name, a)
            return a
        return tracer.unwrap_proxy(a)

    from torch.fx.experimental.proxy_tensor import track_tensor_tree

    proxy_args = py_pytree.tree_map(to_arg, tuple(args))
    out_proxy = tracer.create_proxy("call_function", op, proxy_args, {})
    return track_tensor_tree(out, out_proxy, constant=None, tracer=tracer)


# --- effects ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Effects:
    """What a traced subgraph does to its inputs.

    Attributes:
        mutated: indices of placeholders written in place.
        aliased: (output index, input index) pairs sharing storage.
    """

    mutated: tuple[int, ...]
    aliased: tuple[tuple[int, int], ...]


def _storage(v: Any) -> int | None:
    """An id of ``v``'s storage, equal for tensors sharing memory (compared while alive)."""
    if isinstance(v, torch.Tensor) and v.layout == torch.strided:
        try:
            return int(v.untyped_storage()._cdata)
        except (NotImplementedError, RuntimeError):
            return None
    return None


def find_mutations_and_aliases(gm: torch.fx.GraphModule) -> Effects:
    """Inputs written in place and outputs aliasing inputs, from ``meta["val"]``.

    Writes are found on aten ops whose schema marks the argument as written
    (``add_``, ``copy_``, ``out=``); the graph must come from make_fx, so every
    placeholder and output carries ``meta["val"]``.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {n: i for i, n in enumerate(placeholders)}
    storages = [_storage(n.meta.get("val")) for n in placeholders]
    mutated: set[int] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for arg_schema, arg in zip(node.target._schema.arguments, node.args, strict=False):
            if arg_schema.is_write and isinstance(arg, torch.fx.Node):
                written = _storage(arg.meta.get("val"))
                for i, s in enumerate(storages):
                    if s is not None and s == written:
                        mutated.add(i)
        for name, arg in node.kwargs.items():
            if isinstance(arg, torch.fx.Node) and arg in index and _is_written_kwarg(node.target, name):
                mutated.add(index[arg])
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = py_pytree.tree_leaves(out_node.args[0])
    aliased = []
    for j, o in enumerate(outs):
        so = _storage(o.meta.get("val")) if isinstance(o, torch.fx.Node) else None
        for i, s in enumerate(storages):
            if so is not None and s == so:
                aliased.append((j, i))
    return Effects(tuple(sorted(mutated)), tuple(aliased))


def _is_written_kwarg(target: torch._ops.OpOverload, name: str) -> bool:
    return any(a.name == name and a.is_write for a in target._schema.arguments)


def clone_aliases(outputs: Sequence[Any], inputs: Sequence[Any]) -> list[Any]:
    """``outputs`` with every tensor that shares storage with an input (or an
    earlier output) cloned, so a HOP never returns an alias of its operands."""
    seen = {s for s in (_storage(i) for i in inputs) if s is not None}
    result = []
    for o in outputs:
        s = _storage(o)
        if s is not None and s in seen:
            o = o.clone()
            s = _storage(o)
        if s is not None:
            seen.add(s)
        result.append(o)
    return result
