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
import inspect
import pathlib
import re
import types
from collections.abc import Sequence
from typing import Any

import torch

from hop._pytree import flatten, leaf_paths, structure_str
from hop.errors import HopTypeError, OutputMismatchError, format_message

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
    """``name (file.py:12)`` for a callable, for error messages; for a graph Dynamo
    traced, the user's function its first recorded line was in."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    if isinstance(fn, torch.fx.GraphModule):
        return _traced_from(fn) or "a callable traced by torch.compile"
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__func__", None), "__code__", None)
    if code is None:
        return name
    return f"{name} ({code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno})"


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_OWN = str(pathlib.Path(__file__).resolve().parent)


def _traced_from(gm: torch.fx.GraphModule) -> str | None:
    """``body (model.py:7)``: the innermost frame outside hop and torch in the recorded
    stack traces of ``gm``'s nodes (the deepest: a node's trace also holds the caller's)."""
    best: list[tuple[str, str, str]] = []
    for node in gm.graph.nodes:
        frames = _FRAME.findall(node.meta.get("stack_trace") or "")
        user = [f for f in frames if not f[0].startswith(_OWN) and "/torch/" not in f[0]]
        if len(user) > len(best):
            best = user
    if not best:
        return None
    path, line, name = best[-1]
    return f"{name} ({path.rsplit('/', 1)[-1]}:{line})"


def storage_id(v: Any) -> int | None:
    """An id of ``v``'s storage, equal for tensors sharing memory (compared while alive)."""
    if isinstance(v, torch.Tensor) and v.layout == torch.strided:
        try:
            return int(v.untyped_storage()._cdata)
        except (NotImplementedError, RuntimeError):
            return None
    return None


def name_in(fn: Any, value: Any) -> str | None:
    """What the user calls the tensor ``value`` (or a traced stand-in for it: the same
    storage, size and offset) in ``fn``, unwrapped as :func:`describe_fn` does:
    a variable it closes over (``buf``), a parameter or buffer of a module it reaches
    through ``self`` or a closed-over module (``self.cache``), an attribute of a
    closed-over object; None when it is none of these (a carry passed in)."""
    if not isinstance(value, torch.Tensor):
        return None
    seen: set[int] = set()
    while True:
        found = _name_in_one(fn, value)
        if found is not None or not hasattr(fn, "__wrapped__") or id(fn) in seen:
            return found
        seen.add(id(fn))
        fn = fn.__wrapped__


def _name_in_one(fn: Any, value: torch.Tensor) -> str | None:
    roots: list[tuple[str, Any]] = []
    if isinstance(fn, types.MethodType):
        roots.append(("self", fn.__self__))
        fn = fn.__func__
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is not None and cells is not None:
        for var, cell in zip(code.co_freevars, cells, strict=False):
            try:
                roots.append((var, cell.cell_contents))
            except ValueError:  # not yet assigned
                continue
    if isinstance(fn, torch.nn.Module):
        roots.append(("self", fn))
    for var, obj in roots:
        if _names_tensor(obj, value):
            return var
        if isinstance(obj, torch.nn.Module):
            for attr, t in (*obj.named_parameters(), *obj.named_buffers()):
                if _names_tensor(t, value):
                    return f"{var}.{attr}"
        elif not isinstance(obj, type) and hasattr(obj, "__dict__"):
            field = next((a for a, v in vars(obj).items() if _names_tensor(v, value)), None)
            if field is not None:
                return f"{var}.{field}"
    return None


def _names_tensor(obj: Any, value: torch.Tensor) -> bool:
    if obj is value:
        return True
    if not isinstance(obj, torch.Tensor) or obj.shape != value.shape:
        return False
    s = storage_id(obj)
    return s is not None and s == storage_id(value) and obj.storage_offset() == value.storage_offset()


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
            counted = _count_difference(outputs[0], out)
            raise OutputMismatchError(
                format_message(
                    op,
                    f"{pair} return different structures: {structure_str(outputs[0])} vs {structure_str(out)}"
                    f"{counted}{where}",
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


def _count_difference(a: Any, b: Any) -> str:
    """``: 2 values vs 1`` when both are tuples or lists of different lengths (a body
    that returns one carry of two), else nothing."""
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) != len(b):
        return f": {len(a)} value{'s' if len(a) != 1 else ''} vs {len(b)}"
    if isinstance(a, (tuple, list)) and len(a) > 1 and not isinstance(b, (tuple, list)):
        return f": {len(a)} values vs a single one"
    return ""


# Positional arity of a plain function's code: (fewest, most or None), cached by code.
_ARITY: dict[Any, tuple[int, int | None] | None] = {}


def _arity(fn: Any) -> tuple[int, int | None] | None:
    """How many positional arguments ``fn`` takes, for a Python function or a bound method;
    None when unknown (a builtin, a partial, a module) or when a keyword-only argument
    has no default."""
    bound = 0
    if isinstance(fn, types.MethodType):
        fn, bound = fn.__func__, 1
    if not isinstance(fn, types.FunctionType):
        return None
    code = fn.__code__
    if code not in _ARITY:
        kw_defaults = fn.__kwdefaults__ or {}
        kwonly = code.co_varnames[code.co_argcount : code.co_argcount + code.co_kwonlyargcount]
        if any(k not in kw_defaults for k in kwonly):
            _ARITY[code] = None
        else:
            fewest = code.co_argcount - len(fn.__defaults__ or ())
            most = None if code.co_flags & inspect.CO_VARARGS else code.co_argcount
            _ARITY[code] = (fewest, most)
    found = _ARITY[code]
    if found is None:
        return None
    fewest, most = found
    return max(fewest - bound, 0), None if most is None else most - bound


def check_arity(op: str, role: str, fn: Any, n: int, takes: str) -> None:
    """A ``HopTypeError`` when ``fn`` cannot be called with ``n`` positional arguments
    (a body that takes ``val`` where ``(i, val)`` is passed), before it runs."""
    arity = _arity(fn)
    if arity is None:
        return
    fewest, most = arity
    if fewest <= n and (most is None or n <= most):
        return
    accepts = f"{fewest}" if fewest == most else f"{fewest} to {most}" if most is not None else f"at least {fewest}"
    raise HopTypeError(
        format_message(
            op,
            f"{role} takes {takes}: it is called with {n} positional argument{'s' if n != 1 else ''}, "
            f"but {describe_fn(fn)} accepts {accepts}",
            fix=f"Define {role} to take {takes}.",
        ),
        op=op,
        role=role,
    )
