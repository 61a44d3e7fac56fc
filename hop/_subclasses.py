"""A hop operator's node over traceable wrapper subclasses, run on their inner tensors.

Note [subclass operands desugared]
In plain eager a public call with a tensor subclass operand runs as the Python program
(Note [tensor subclasses run as Python] in hop.ops._common). Where a program is traced
(``torch.compile``, ``torch.export``), AOTAutograd keeps a traceable wrapper subclass
(one with ``__tensor_flatten__``: ``TwoTensor``, ``DTensor``, torchao's quantized
weights) as a wrapper around traced inner tensors, and the raw op meets the wrapper at
the Python key. With no rule registered for its class, the op is desugared, as
AOTAutograd desugars every aten op: the operands, carries and additional inputs that
are such subclasses are replaced by their inner tensors (recursively), each callable is
wrapped to rebuild the instances from the inner tensors, call the user's callable (whose
ops the subclass's ``__torch_dispatch__`` turns into ops on the inner tensors) and
flatten what it returns, and the node's outputs are rebuilt from the inner tensors it
returns. The recorded node holds plain tensors only.

What keeps its meaning that way is refused with a ``CompileUnsupported``: a subclass
selector (which branch runs would be read from an inner tensor), ``xs`` or stacked
outputs of a subclass (slicing or stacking the inner tensors is the subclass's slice
only for some subclasses: not for a DTensor sharded along the scanned dim), a loop body
that changes a carry's subclass or its metadata, and branches that return different
subclasses for one output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from hop import _spec
from hop.errors import CompileUnsupported, format_message

__all__ = ["desugar", "user_subclasses"]

Fn = Callable[..., Any]
# a subclass instance's type, attribute names, flatten context, inner metas, outer size and stride
Meta = tuple[type, list[str], Any, list[Any], Any, Any] | None


def user_subclasses(op: Any, args: Sequence[Any]) -> list[type] | None:
    """The classes of the tensor subclasses among ``args`` that the node would be
    desugared for (tracing's own, fake and functional tensors, aside), or None where it
    cannot be: one is no traceable wrapper, or the operator has no layout to read."""
    spec = _spec.spec_of(op.name())
    found = [type(t) for t in _tensors(args) if type(t) not in _PLAIN and not _tracing_tensor(t)]
    if not found or spec is None or spec.layout is None:
        return None
    if not all(hasattr(c, "__tensor_flatten__") and hasattr(c, "__tensor_unflatten__") for c in found):
        return None
    return list(dict.fromkeys(found))


def desugar(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Note [subclass operands desugared]."""
    name = op.name()
    spec = _spec.spec_of(name)
    assert spec is not None and spec.layout is not None
    layout = spec.layout
    positions = layout.subgraph_positions(args)
    if layout.selector is not None and _is_subclass(args[layout.selector]):
        args = (*args[: layout.selector], _plain_selector(name, args[layout.selector]), *args[layout.selector + 1 :])
    xs = tuple(args[layout.xs]) if layout.xs is not None else ()
    if any(_is_subclass(x) for x in xs):
        _refuse(name, "xs that are tensor subclasses (their slices are not their inner tensors' slices in general)")
    carries = tuple(args[layout.carries]) if layout.carries is not None else ()
    inputs = tuple(args[layout.inputs]) if layout.inputs is not None else ()
    carry_leaves, carry_metas = _flatten_all(carries)
    input_leaves, input_metas = _flatten_all(inputs)
    branching = layout.body is None and layout.selector is not None
    outputs: dict[int, list[Meta]] = {}
    sequences: dict[int, bool] = {}  # whether each callable returned a tuple (a branch's node does too)

    def wrap(k: int, fn: Fn) -> Fn:
        def on_inner(*flat: Any) -> Any:
            nc, ni = len(carry_leaves), len(input_leaves)
            rebuilt_carries = _unflatten_all(carry_metas, flat[:nc])
            rebuilt_inputs = _unflatten_all(input_metas, flat[len(flat) - ni :])
            with torch._C._EnableTorchFunction():
                out = fn(*rebuilt_carries, *flat[nc : len(flat) - ni], *rebuilt_inputs)
            leaves, metas = _flatten_all(out if isinstance(out, (tuple, list)) else (out,))
            if branching:  # before the operator compares the branches' flat outputs
                for j, earlier in outputs.items():
                    if j != k and not _same_metas(metas, earlier):
                        what = f"branches that return different tensor subclasses ({spec.role(j)} and {spec.role(k)})"
                        _refuse(name, what)
            outputs[k], sequences[k] = metas, isinstance(out, (tuple, list))
            return tuple(leaves) if sequences[k] or len(leaves) > 1 else leaves[0]

        on_inner.__qualname__ = getattr(fn, "__qualname__", type(fn).__qualname__)
        return on_inner

    new_args = list(args)
    for k, p in enumerate(positions):
        new_args[p] = wrap(k, args[p])
    if layout.carries is not None:
        new_args[layout.carries] = tuple(carry_leaves)
    if layout.inputs is not None:
        new_args[layout.inputs] = tuple(input_leaves)
    out = op(*new_args, **kwargs)
    flat = list(out) if isinstance(out, (tuple, list)) else [out]
    metas = _output_metas(name, spec, positions, outputs, carry_metas, len(flat) - len(carry_leaves) + len(carry_metas))
    if all(m is None for m in metas):
        return out
    rebuilt = _unflatten_all(metas, flat)
    as_sequence = sequences.get(0, False) if branching else len(rebuilt) > 1  # the raw ops' conventions
    return tuple(rebuilt) if as_sequence or len(rebuilt) > 1 else rebuilt[0]


def _output_metas(
    name: str,
    spec: _spec.OpSpec,
    positions: Sequence[int],
    outputs: dict[int, list[Meta]],
    carries: list[Meta],
    count: int,
) -> list[Meta]:
    """The subclass of each node output, from what the callables returned."""
    layout = spec.layout
    assert layout is not None
    order = {p: k for k, p in enumerate(positions)}
    if layout.body is None and layout.selector is not None:  # branches: each output as every branch gives it
        given = [outputs[k] for k in range(len(positions)) if k in outputs]
        for k, metas in enumerate(given[1:], 1):
            if not _same_metas(metas, given[0]):
                _refuse(name, f"branches that return different tensor subclasses ({spec.role(0)} and {spec.role(k)})")
        return given[0] if given else []
    if layout.condition is not None and any(m is not None for m in outputs.get(order[layout.condition], [])):
        _refuse(name, f"{spec.role(order[layout.condition])} returning a tensor subclass")
    if layout.body is None:  # associative_scan's combine: outputs like its xs
        if any(m is not None for metas in outputs.values() for m in metas):
            _refuse(name, f"{spec.role(0)} returning a tensor subclass")
        return [None] * len(next(iter(outputs.values()), []))
    if order[layout.body] not in outputs:  # an eager loop of no step: the carries as they came
        return [*carries, *[None] * (count - len(carries))]
    body = outputs[order[layout.body]]
    if not _same_metas(body[: len(carries)], carries):
        _refuse(name, f"{spec.role(order[layout.body])} changing a carry's tensor subclass or its metadata")
    if any(m is not None for m in body[len(carries) :]):
        _refuse(name, "outputs stacked over the steps that are tensor subclasses")
    return body


def _same_metas(a: Sequence[Meta], b: Sequence[Meta]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if isinstance(x, _Kept) or isinstance(y, _Kept):
            if x != y:
                return False
            continue
        if (x is None) != (y is None):
            return False
        if x is not None and y is not None:
            try:
                same = x[0] is y[0] and x[1] == y[1] and bool(x[2] == y[2]) and _same_metas(x[3], y[3])
            except Exception:  # a context without a meaningful ==
                same = x[0] is y[0] and x[1] == y[1]
            if not same:
                return False
    return True


def _flatten_all(values: Sequence[Any]) -> tuple[list[Any], list[Meta]]:
    leaves: list[Any] = []
    metas = [_flatten(v, leaves) for v in values]
    return leaves, metas


def _flatten(value: Any, leaves: list[Any]) -> Meta:
    if not _is_subclass(value):
        leaves.append(value)
        return None
    attrs, ctx = value.__tensor_flatten__()
    values = [getattr(value, a) for a in attrs]
    inner = [_flatten(v, leaves) if isinstance(v, torch.Tensor) else _Kept(v) for v in values]
    return (type(value), list(attrs), ctx, inner, value.size(), value.stride())


def _unflatten_all(metas: Sequence[Meta], leaves: Sequence[Any]) -> list[Any]:
    it = iter(leaves)
    return [_unflatten(m, it) for m in metas]


class _Kept:
    """An inner value that is no tensor (DTensor's device mesh, an opaque object):
    kept aside, not passed through the node."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Kept):
            return False
        # a traced program holds a fake of the object (real_obj: the one it stands for)
        a, b = getattr(self.value, "real_obj", self.value), getattr(other.value, "real_obj", other.value)
        try:
            return a is b or bool(a == b)
        except Exception:  # an object without a meaningful ==
            return False

    __hash__ = None  # type: ignore[assignment]


def _unflatten(meta: Meta | _Kept, leaves: Iterator[Any]) -> Any:
    if isinstance(meta, _Kept):
        return meta.value
    if meta is None:
        return next(leaves)
    cls, attrs, ctx, inner, size, stride = meta
    rebuilt = {a: _unflatten(m, leaves) for a, m in zip(attrs, inner, strict=True)}
    unflatten: Any = cls.__tensor_unflatten__  # type: ignore[attr-defined]
    return unflatten(rebuilt, ctx, size, stride)


def _plain_selector(name: str, selector: Any) -> Any:
    """The value a subclass selector stands for, as a plain tensor: a DTensor's global
    value (``full_tensor()``, which a traced program gathers); no other subclass says
    which of its inner tensors is its value."""
    full = getattr(selector, "full_tensor", None)
    plain = full() if callable(full) else None
    if not isinstance(plain, torch.Tensor) or _is_subclass(plain):
        _refuse(
            name,
            f"a {type(selector).__qualname__} selector (which branch runs would be read from one of its inner tensors)",
            "Compute the predicate or index as a plain tensor (from the inner tensor that holds its value).",
        )
    return plain


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _tracing_tensor(value: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(value, (FakeTensor, FunctionalTensor))


def _is_subclass(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and type(value) not in _PLAIN
        and not _tracing_tensor(value)
        and is_traceable_wrapper_subclass(value)
    )


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for x in tree:
            yield from _tensors(x)


def _refuse(name: str, what: str, fix: str | None = None) -> None:
    fix = fix or "Run it in eager (the callables then see the subclass instances), or pass plain tensors."
    raise CompileUnsupported(format_message(name, f"traced with {what}: not supported", fix=fix), op=name)
