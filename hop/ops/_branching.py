"""What cond and switch share: the user-level call and every rule.

cond is a two-branch switch: ``cond(pred, t, f)`` takes branch 0 when ``pred``
holds. Each rule below is written once against a :class:`Branching` (how a
selector picks a branch, how the raw op is called) and registered on both raw
ops by ``cond.py`` and ``switch.py``.

Note [eager branches run inline]
When the selector is concrete (a Python value, or a real tensor under every
functorch wrapper, while nothing traces), the rules run the chosen branch as
plain Python at the current level: autograd, grad, jvp and vmap (with an
unbatched selector) then see the branch's own ops, which gives exact derivatives
of every order and covers tensors the branch closes over. Only a selector that
cannot be read (SymBool/SymInt, fake, functional, batched) keeps the operator as
one node, with the rule that builds its derivative or batched version as new
branches. What the untaken branches read still gets a zero gradient: Note
[untaken branches get zero gradients] in ``_zero_grads``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from types import BuiltinFunctionType, FunctionType
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hop import _observe, _transforms, config
from hop import _validation as validation
from hop import subgraph as _subgraph
from hop._operator import HigherOrderOperator
from hop._unbacked import Unifier, assert_ranges, dense_order, recording
from hop.errors import (
    HopRuntimeError,
    HopTypeError,
    HopValueError,
    OutputMismatchError,
    format_message,
    type_name,
)
from hop.ops import _inline
from hop.ops._common import check_effects, differentiable, refuse_legacy_onnx, save_operands, saved_operands
from hop.ops._zero_grads import only_vmap_levels, reads_nothing, zero_untaken

Fn = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class Branching:
    """How one branching operator (cond or switch) reads its selector and calls its raw op."""

    name: str
    op: HigherOrderOperator
    call: Callable[[Any, Sequence[Fn], Sequence[Any]], Any]  # raw op call from (selector, branches, operands)
    index: Callable[[Any, int], int]  # concrete selector -> branch index (checked)
    masks: Callable[[Any, int], list[Any]]  # tensor selector -> one bool mask per branch
    roles: Callable[[int], tuple[str, ...]]
    node_args: Callable[[Any, Sequence[Any], tuple[Any, ...]], tuple[Any, ...]]  # (selector, graphs, operands)
    selector: str = "index"  # the selector's parameter name, for messages

    def __post_init__(self) -> None:
        BY_NAME[self.name] = self


BY_NAME: dict[str, Branching] = {}


# --- flat outputs ------------------------------------------------------------------------


def as_tuple(out: Any) -> tuple[Any, ...]:
    return out if isinstance(out, tuple) else (out,)


def like(out: Any, flat: Sequence[Any]) -> Any:
    """``flat`` in the raw op's output convention: a bare value for one leaf, else a tuple."""
    return tuple(flat) if isinstance(out, tuple) else flat[0]


def no_alias(out: Any, operands: Sequence[Any]) -> Any:
    """``out`` with every leaf that shares memory with an operand cloned."""
    flat = as_tuple(out)
    suspect = any(_subgraph.may_alias(o, operands) for o in flat) or len(flat) > 1
    if not suspect:
        return out
    return like(out, _subgraph.clone_aliases(flat, operands))


class _Outputs:
    """What the branches of one call returned so far, to check them against each other."""

    def __init__(self, b: Branching, branches: Sequence[Fn]) -> None:
        self.b = b
        self.fns = branches
        self.roles = b.roles(len(branches))
        self.first: tuple[int, Any] | None = None
        self.spec: _subgraph.TreeSpec | None = None
        self.kind: Any = None  # Note [outputs are checked on every call] in hop._validation

    def record(self, k: int, out: Any, spec: _subgraph.TreeSpec) -> None:
        _check_output_leaves(self.b, self.roles[k], self.fns[k], out)
        metas = _subgraph.unflatten([_subgraph.leaf_meta(x) for x in _subgraph.flatten(out)[0]], spec)
        if self.first is None:
            self.first, self.spec = (k, metas), spec
            self.kind = validation.output_kind(out)
            return
        j, ref = self.first
        (a, out_a), (c, out_c) = sorted(((j, ref), (k, metas)), key=lambda pair: pair[0])
        # in the branches' order, whichever ran first (eager runs the taken one first)
        _subgraph.check_same_outputs(
            self.b.name, (self.roles[a], self.roles[c]), (out_a, out_c), fns=(self.fns[a], self.fns[c])
        )


def flat_branches(b: Branching, branches: Sequence[Fn], in_spec: Any) -> tuple[list[Fn], _Outputs]:
    """Branches taking and returning flat leaves; they record and check their outputs."""
    outputs = _Outputs(b, branches)

    def make(k: int, fn: Fn) -> Fn:
        def flat(*leaves: Any) -> Any:
            out = fn(*_subgraph.unflatten(leaves, in_spec))
            out_leaves, spec = _subgraph.flatten(out)
            outputs.record(k, out, spec)
            if len(out_leaves) != 1:
                return tuple(out_leaves)
            if isinstance(out_leaves[0], torch.Tensor):
                return out_leaves[0]
            # A lone int gets an empty tensor beside it: torch.export's serializer
            # reads a node returning a bare SymInt as a symbolic op, and a 1-tuple
            # does not survive a save/load round trip. call() drops it.
            return (out_leaves[0], torch.empty(0))

        flat.__qualname__ = getattr(fn, "__qualname__", type(fn).__qualname__)
        flat.__wrapped__ = fn  # type: ignore[attr-defined]
        return flat

    return [make(k, fn) for k, fn in enumerate(branches)], outputs


# --- the user-level call --------------------------------------------------------------------


def call(b: Branching, sel: Any, branches: Sequence[Fn], operands: Any) -> Any:
    """``branches[index(sel)](*operands)`` through the raw op, after checking the arguments."""
    roles = b.roles(len(branches))
    for role, fn in zip(roles, branches, strict=True):
        if not callable(fn):
            raise HopTypeError(
                format_message(b.name, f"{role} must be callable, got {type_name(fn)}"), op=b.name, role=role
            )
    check_operands(b.name, operands)
    leaves, in_spec = _subgraph.flatten(tuple(operands))
    if _transforms.is_concrete(sel) and _transforms.in_plain_eager() and all(map(_plain_leaf, leaves)):
        k = b.index(sel, len(branches))
        if _SINKS:
            _observe.note(b.name, inline=True)
        key = _validate(b, branches, operands, leaves, in_spec, k)
        out = branches[k](*operands)
        if key is not None and not validation.known_kind(key, out):
            check_new_kind(b, key, branches, operands, k, out)
        out = no_alias_tree(out, leaves)
        return zero_untaken(out, branches, leaves) if _grad_enabled() else out
    key = _validate_under_transform(b, sel, branches, operands, leaves, in_spec)
    flat, outputs = flat_branches(b, branches, in_spec)
    out = as_tuple(b.call(sel, flat, leaves))
    assert outputs.spec is not None  # a branch ran (traced or fake)
    result = _subgraph.unflatten(list(out[: outputs.spec.num_leaves]), outputs.spec)
    if key is not None and not validation.known_kind(key, result):
        check_new_kind(b, key, branches, operands, b.index(sel, len(branches)), result)
    return result


def _validate_under_transform(
    b: Branching, sel: Any, branches: Sequence[Fn], operands: Any, leaves: list[Any], spec: Any
) -> Any:
    """Note [validation under torch.func]: a concrete selector under functorch
    transforms (nothing tracing) is validated as in plain eager; the verdict's key,
    or None when nothing was validated."""
    if _transforms.functorch_level() is None or not _transforms.is_concrete(sel) or not _transforms.no_modes():
        return None
    if not all(map(_transforms.is_real, leaves)):
        return None
    key = validation.signature(b.name, branches, operands, leaves, spec)
    if validation.is_known(key):  # before reading sel: a read under a transform is slow
        return None if config.validate == "never" else key
    return _validate(b, branches, operands, leaves, spec, b.index(sel, len(branches)))


MISS = _inline.MISS
_SINKS = _observe.SINKS
_Tensor = torch.Tensor
_Function = FunctionType
_Builtin = BuiltinFunctionType
_VERDICTS = validation._VERDICTS
_grad_enabled = torch.is_grad_enabled


def eager_fast(name: str, k: int, branches: Sequence[Fn], operands: tuple[Any, ...]) -> Any:
    """``branches[k](*operands)`` for a plain eager call (the caller checked: no mode,
    no transform, a real one-element selector giving ``k``) with flat tensor
    operands whose signature is already validated; :data:`MISS` otherwise.

    Note [eager branches run inline]; this is the general path minus the pytree
    work and the checks a validated signature has already passed. Every
    microsecond here is paid by every call, so it is written out long-hand.
    """
    validate = config.validate
    if validate != _ONCE:  # an equal string not interned is "once" too
        if validate != "never":
            return MISS
        return _run_unchecked(k, branches, operands)
    key = validation.flat_signature(name, branches, operands)
    kinds = validation._VERDICTS.get(key)
    if kinds is None:
        return MISS
    out = branches[k](*operands)
    if (type(out) is not _Tensor or (out.dtype, out.ndim, out.get_device()) not in kinds) and not (
        validation.known_kind(key, out)
    ):
        check_new_kind(BY_NAME[name], key, branches, operands, k, out)
    return finish_eager(out, branches, operands)


def eager_one(b: Branching, k: int, branches: Sequence[Fn], x: torch.Tensor) -> Any:
    """``branches[k](x)`` for a plain eager call (as :func:`eager_fast`) with the one
    plain tensor operand ``x``, closure-free functions or builtins as branches and a
    validated signature; :data:`MISS` otherwise.

    The commonest call of cond and switch, long-hand: one walk over the branches
    builds the verdict's key (``validation.flat_signature``'s) and, with grad
    enabled, decides whether any of them can read a tensor that requires grad (Note
    [untaken branches get zero gradients]), which would otherwise be a walk each.
    """
    if config.validate != _ONCE:
        return MISS
    grad = _grad_enabled()
    plain = True  # no branch reads a tensor from outside its arguments
    key: list[Any] = [b.name]
    add = key.append
    for fn in branches:
        kind = type(fn)
        if kind is _Function:
            if fn.__closure__ is not None:
                return MISS
            add(fn.__code__)
        elif kind is _Builtin and _subgraph.is_inert(fn):
            add(id(fn))  # validation.callable_key's (torch.tanh lives as long as torch)
        else:
            return MISS
        if plain and grad:
            plain = reads_nothing(fn)
    add(x.dtype)
    add(x.ndim)
    add(x.get_device())
    signature = tuple(key)
    kinds = _VERDICTS.get(signature)
    if kinds is None:
        return MISS
    _inline.remember(b.name, branches, x, signature, kinds)  # later calls: Note [the eager inline cache]
    out = branches[k](x)
    # Note [outputs are checked on every call]
    if (type(out) is not _Tensor or (out.dtype, out.ndim, out.get_device()) not in kinds) and not (
        validation.known_kind(signature, out)
    ):
        check_new_kind(b, signature, branches, (x,), k, out)
    if grad and (x.requires_grad or not plain):
        return finish_eager(out, branches, (x,))
    if type(out) is _Tensor and out is not x and not out._is_view() and not _subgraph.same_memory(out, x):
        return out
    return no_alias_tree(out, (x,))


def finish_ran(b: Branching, branches: Sequence[Fn], operands: Sequence[Any], out: Any, k: int, entry: Any) -> Any:
    """Finish a call the inline cache found (Note [the eager inline cache]): branch
    ``k`` returned ``out``, which needs more than the cache checks (a new output
    kind, zero gradients, an alias of the operand)."""
    key = entry[-1]
    if not validation.known_kind(key, out):  # Note [outputs are checked on every call]
        check_new_kind(b, key, branches, operands, k, out)
    return finish_eager(out, branches, operands)


def _run_unchecked(k: int, branches: Sequence[Fn], operands: tuple[Any, ...]) -> Any:
    for x in operands:
        if type(x) is not _Tensor:
            return MISS
    return finish_eager(branches[k](*operands), branches, operands)


def finish_eager(out: Any, branches: Sequence[Fn], operands: Sequence[Any]) -> Any:
    """The chosen branch's ``out`` (from flat ``operands``) without aliases of them,
    and with Note [untaken branches get zero gradients] when grad is enabled."""
    if type(out) is _Tensor and not out._is_view():
        for x in operands:
            if out is x or _subgraph.same_memory(out, x):  # x itself, x.detach()
                out = out.clone()
                break
    else:
        out = no_alias_tree(out, operands)
    return zero_untaken(out, branches, operands) if _grad_enabled() else out


_ONCE = "once"


def _plain_leaf(x: Any) -> bool:
    return _transforms.is_plain_tensor(x) or type(x) is int


def check_operands(name: str, operands: Any) -> None:
    """``operands`` is a tuple or list of pytrees of tensors and ints (also on the
    paths that run a branch directly, so a bare tensor is never unpacked row by row)."""
    if not isinstance(operands, (tuple, list)):
        raise HopTypeError(
            format_message(
                name,
                f"operands must be a tuple or list, got {type_name(operands)}",
                fix="Pass operands=(x,) for a single operand.",
            ),
            op=name,
            role="operands",
        )
    for x in operands:
        if type(x) is not _Tensor and type(x) is not int:  # else flat and plain: nothing to walk
            _check_leaves(name, operands, _subgraph.flatten(tuple(operands))[0])
            return


def _check_leaves(name: str, operands: Any, leaves: Sequence[Any]) -> None:
    for path, leaf in zip(_subgraph.leaf_paths(tuple(operands), "operands"), leaves, strict=True):
        if not isinstance(leaf, (torch.Tensor, int, torch.SymInt)) or isinstance(leaf, bool):
            raise HopTypeError(
                format_message(
                    name,
                    f"{path} must be a tensor or an int, got {type_name(leaf)}",
                    fix="Close over other values in the branches instead of passing them as operands.",
                ),
                op=name,
                role="operands",
                path=path,
            )


def _output_leaf(x: Any) -> bool:
    return x is None or (isinstance(x, (torch.Tensor, int, torch.SymInt)) and not isinstance(x, bool))


def _check_output_leaves(b: Branching, role: str, fn: Fn, out: Any) -> None:
    """A branch returns tensors, ints and Nones: anything else (a str, a float, a bool)
    cannot be an output of a traced program (a number would be baked in as one branch's)."""
    leaves = _subgraph.flatten(out)[0]
    if all(map(_output_leaf, leaves)):
        return
    for path, leaf in zip(_subgraph.leaf_paths(out), leaves, strict=True):
        if not _output_leaf(leaf):
            raise HopTypeError(
                format_message(
                    b.name,
                    f"{role} ({_subgraph.describe_fn(fn)}) returns {type_name(leaf)} {repr(leaf)[:40]} at {path}; "
                    "branches return tensors and ints",
                    fix="Return torch.tensor(value) for a number; close over other values instead of returning them.",
                ),
                op=b.name,
                role=role,
                path=path,
            )


def no_alias_tree(out: Any, operands: Sequence[Any]) -> Any:
    leaves, spec = _subgraph.flatten(out)
    cloned = (
        _subgraph.clone_aliases(leaves, operands) if any(_subgraph.may_alias(o, operands) for o in leaves) else leaves
    )
    return out if cloned is leaves else _subgraph.unflatten(cloned, spec)


# --- validation once per signature ------------------------------------------------------------


def _validate(b: Branching, branches: Sequence[Fn], operands: Any, leaves: list[Any], spec: Any, taken: int) -> Any:
    """Run every branch once on fake tensors to check they agree (see ``hop.config.validate``);
    the verdict's key, None when validation is off."""
    key = validation.signature(b.name, branches, operands, leaves, spec)
    if validation.is_known(key):
        return None if config.validate == "never" else key
    flat, outputs = flat_branches(b, branches, spec)
    roles = b.roles(len(branches))
    unchecked: dict[int, str] = {}
    aliasing = False
    if not validation.fakeable(leaves):
        return None  # a quantized operand: the real call decides
    with validation.fake_inputs(leaves) as fake:
        for k in [taken] + [i for i in range(len(flat)) if i != taken]:
            try:
                validation.check_hooks(branches[k])
                aliasing = _subgraph.hidden_alias(as_tuple(flat[k](*fake)), fake) or aliasing
            except validation.CANNOT_FAKE as e:
                unchecked[k] = f"{type(e).__name__}: {e}"
                continue  # data-dependent, or hooked modules: checked by its real call
            except HopTypeError:
                raise
            except Exception as e:
                if k == taken:
                    return None  # the real call will raise the real error
                raise HopRuntimeError(
                    format_message(
                        b.name,
                        f"{roles[k]} ({_subgraph.describe_fn(branches[k])}) fails on the operands "
                        f"(checked with fake tensors, as torch.export would run it): {type(e).__name__}: {e}",
                    ),
                    op=b.name,
                    role=roles[k],
                ) from e
    validation.remember(key, outputs.kind, aliasing=aliasing)
    validation.remember_unchecked(key, unchecked)
    return key


def check_new_kind(b: Branching, key: Any, branches: Sequence[Fn], operands: Sequence[Any], k: int, out: Any) -> None:
    """The chosen branch returned a kind of output its verdict has not seen (Note
    [outputs are checked on every call]): validate again now; the output must be of
    the kind that finds, else it differs from what the branches were checked to return."""
    leaves, spec = _subgraph.flatten(tuple(operands))
    before = validation._VERDICTS.get(key)
    validation.forget(key)
    _validate(b, branches, operands, leaves, spec, k)
    if validation.known_kind(key, out):
        validation._VERDICTS[key] |= before or set()
        return
    role = b.roles(len(branches))[k]
    expected = next(iter(validation._VERDICTS.get(key) or {None}))
    why = validation._UNCHECKED.get(key, {}).get(k)
    if why is not None:
        raise _unchecked_mismatch(b, branches, k, out, expected, why)
    raise OutputMismatchError(
        format_message(
            b.name,
            f"{role} ({_subgraph.describe_fn(branches[k])}) returned {validation.describe_kind(out)}, but run on "
            f"fake tensors it returns {validation.describe_kind(expected, kind=True)}: its output depends on "
            "something that is neither its code, its closure nor its operands",
            fix=f"Make {role} return the same kind of value whatever it reads from outside (defaults, globals).",
        ),
        op=b.name,
        role=role,
    )


def _unchecked_mismatch(b: Branching, branches: Sequence[Fn], k: int, out: Any, expected: Any, why: str) -> Exception:
    """The error for a branch no fake run could check whose real output differs from
    what the other branches were checked to return."""
    role = b.roles(len(branches))[k]
    return OutputMismatchError(
        format_message(
            b.name,
            f"{role} ({_subgraph.describe_fn(branches[k])}) returned {validation.describe_kind(out)}, but the other "
            f"branches, checked on fake tensors, return {validation.describe_kind(expected, kind=True)} ({role} "
            f"itself could not be checked ahead of time: {why})",
            fix="Make every branch return the same structure, dtypes, devices and ranks.",
        ),
        op=b.name,
        role=role,
    )


# --- rules -----------------------------------------------------------------------------------


def dense(b: Branching, sel: Any, branches: Sequence[Fn], operands: Sequence[Any]) -> Any:
    """Run the chosen branch; a meta selector runs all and needs them to agree."""
    if isinstance(sel, torch.Tensor) and sel.is_meta:
        if any(isinstance(x, torch.Tensor) and not x.is_meta for x in operands):
            raise _meta_selector(b, operands)
        return _run_all_and_merge(b, branches, operands, None)
    if isinstance(sel, torch.Tensor):  # Note [the legacy ONNX exporter]
        refuse_legacy_onnx(b.name, f"which branch runs depends on {b.selector}, a tensor")
    k = b.index(sel, len(branches))
    if _SINKS:
        _observe.note(b.name, branch=k)
    return no_alias(branches[k](*operands), operands)


def _meta_selector(b: Branching, operands: Sequence[Any]) -> HopValueError:
    """A meta selector has no value: with real operands no branch can be chosen."""
    device = next(x.device for x in operands if isinstance(x, torch.Tensor) and not x.is_meta)
    role = b.selector
    return HopValueError(
        format_message(
            b.name,
            f"{role} is on the meta device (it has no value) but the operands are on {device}: no branch can be chosen",
            fix=f"Put {role} on the operands' device, or make every operand a meta tensor for metadata only.",
        ),
        op=b.name,
        role=role,
    )


def _run_all_and_merge(b: Branching, branches: Sequence[Fn], operands: Sequence[Any], shape_env: Any) -> Any:
    """Run every branch; one output whose differing sizes are unified (see hop._unbacked)."""
    ignore = shape_env.ignore_fresh_unbacked_symbols() if shape_env is not None else nullcontext()
    with ignore:  # symbols made inside the branches are bound in their subgraphs
        raw = [fn(*operands) for fn in branches]
    outs = [as_tuple(r) for r in raw]
    roles = b.roles(len(branches))
    _subgraph.check_same_outputs(b.name, roles, outs, fns=branches)
    merged = Unifier(b.name, roles, shape_env).outputs(outs)
    return like(raw[0], _subgraph.clone_aliases(list(merged), operands))


def inline(b: Branching, sel: Any, branches: Sequence[Fn], operands: Sequence[Any]) -> Any:
    """Note [eager branches run inline]: run the chosen branch at the current level."""
    if isinstance(sel, torch.Tensor):  # Note [the legacy ONNX exporter]
        refuse_legacy_onnx(b.name, f"which branch runs depends on {b.selector}, a tensor")
    k = b.index(sel, len(branches))
    if _SINKS:
        _observe.note(b.name, branch=k)
    return no_alias(branches[k](*operands), operands)


def autograd(b: Branching, sel: Any, branches: Sequence[Fn], operands: Sequence[Any]) -> Any:
    """Concrete selector: inline (Note [untaken branches get zero gradients] outside
    torch.func transforms, which give unused inputs zeros themselves). Otherwise one
    node whose backward / jvp are the op again."""
    if _transforms.is_concrete(sel):
        out = inline(b, sel, branches, operands)
        if _grad_enabled() and _transforms.functorch_level() is None:
            out = zero_untaken(out, branches, _subgraph.flatten(tuple(operands))[0])
        return out
    return _as_node(b, sel, branches, operands)


def _vjp_branch(fn: Fn, operands: Sequence[Any], n: int, name: str) -> Fn:
    """``(*operands, *cotangents) -> grads of the differentiable operands``."""
    diff = [i for i, x in enumerate(operands) if differentiable(x)]

    def vjp_branch(*args: Any) -> Any:
        primals, cts = list(args[:n]), args[n:]
        kept: list[int] = []  # the differentiable outputs: vjp refuses integer ones

        def on_diff(*d: Any) -> Any:
            out = as_tuple(fn(*_transforms.place(primals, diff, d)))
            kept[:] = [i for i, o in enumerate(out) if differentiable(o)]
            return tuple(out[i] for i in kept) or (torch.zeros(()),)

        with _transforms.torch_ops_without_rules(name, "a branch"):
            out, vjp_fn = torch.func.vjp(on_diff, *[primals[i] for i in diff])[:2]
            cts = tuple(cts[i] for i in kept) or (None,)
            grads = vjp_fn(tuple(ct if ct is not None else torch.zeros_like(o) for o, ct in zip(out, cts, strict=True)))
        return grads[0] if len(grads) == 1 else tuple(grads)

    vjp_branch.__qualname__ = f"vjp_{getattr(fn, '__qualname__', 'branch')}"
    return vjp_branch


def _jvp_branch(fn: Fn, operands: Sequence[Any], n: int) -> Fn:
    """``(*operands, *tangents of the differentiable operands) -> (*outputs, *output tangents)``."""
    diff = [i for i, x in enumerate(operands) if differentiable(x)]

    def jvp_branch(*args: Any) -> Any:
        primals, tangents = list(args[:n]), args[n:]

        def on_diff(*d: Any) -> Any:
            return as_tuple(fn(*_transforms.place(primals, diff, d)))

        out, tout = _transforms.jvp(on_diff, [primals[i] for i in diff], tangents)
        return (*out, *tout)

    jvp_branch.__qualname__ = f"jvp_{getattr(fn, '__qualname__', 'branch')}"
    return jvp_branch


class _BranchFunction(torch.autograd.Function):
    """cond/switch as one autograd node: backward and jvp are cond/switch of the branches' vjp/jvp."""

    generate_vmap_rule = True

    @staticmethod
    def forward(b: Branching, sel: Any, branches: tuple[Fn, ...], *operands: Any) -> Any:
        return b.call(sel, branches, operands)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        b, sel, branches, *operands = inputs
        ctx.b, ctx.branches, ctx.n = b, branches, len(operands)
        ctx.single = not isinstance(output, tuple)
        save_operands(ctx, (sel, *operands))

    @staticmethod
    def _inputs(ctx: Any) -> tuple[Any, list[Any]]:
        sel, *operands = saved_operands(ctx)
        return sel, operands

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        sel, operands = _BranchFunction._inputs(ctx)
        bw = [_vjp_branch(fn, operands, ctx.n, ctx.b.name) for fn in ctx.branches]
        out = as_tuple(ctx.b.call(sel, bw, (*operands, *grads)))
        it = iter(out)
        return (None, None, None, *[next(it) if differentiable(x) else None for x in operands])

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        sel, operands = _BranchFunction._inputs(ctx)
        diff_t = [
            torch.zeros_like(x) if t is None else t
            for x, t in zip(operands, tangents[3:], strict=True)
            if differentiable(x)
        ]
        fw = [_jvp_branch(fn, operands, ctx.n) for fn in ctx.branches]
        out = as_tuple(ctx.b.call(sel, fw, (*operands, *diff_t)))
        touts = out[len(out) // 2 :]
        return touts[0] if ctx.single else tuple(touts)


def _as_node(b: Branching, sel: Any, branches: Sequence[Fn], operands: Sequence[Any], level: int | None = None) -> Any:
    """One autograd node; tensors the branches read from their closures and that need
    grad become inputs too (Note [closure conversion] in hop._closures)."""
    branches, captured = _subgraph.convert_closures(branches, operands, level)
    operands = (*operands, *captured)
    return _BranchFunction.apply(b, sel, tuple(branches), *operands)  # type: ignore[no-untyped-call]


def grad_or_jvp(b: Branching, interpreter: Any, sel: Any, branches: Sequence[Fn], operands: Sequence[Any]) -> Any:
    """torch.func.grad / jvp: inline for a concrete selector, else the autograd node."""
    if _transforms.is_concrete(sel):
        return inline(b, sel, branches, operands)
    return _as_node(b, sel, branches, operands, interpreter.level())


def vmap(b: Branching, interpreter: Any, sel: Any, branches: Sequence[Fn], operands: Sequence[Any]) -> Any:
    """Batched selector: every branch runs on the batch, outputs selected by torch.where.
    Unbatched: inline when concrete, else the op one level down on vmapped branches."""
    level = interpreter.level()
    (sel_u,), (sel_dim,) = _transforms.unwrap_batched([sel], level)
    if sel_dim is not None:
        return _select_batched(b, sel, branches, operands)
    if _transforms.is_concrete(sel):
        out = inline(b, sel, branches, operands)
        if _grad_enabled() and only_vmap_levels():  # Note [untaken branches get zero gradients]
            out = zero_untaken(out, branches, _subgraph.flatten(tuple(operands))[0])
        return out
    unwrapped, dims = _transforms.unwrap_batched(operands, level)
    if all(d is None for d in dims):
        with interpreter.lower():
            return b.call(sel_u, branches, unwrapped)
    batched = [torch.vmap(fn, in_dims=tuple(dims), randomness=interpreter.randomness()) for fn in branches]
    with interpreter.lower():
        out = b.call(sel_u, batched, unwrapped)
    return like(out, _transforms.add_batch_dims(as_tuple(out), level))


def _select_batched(b: Branching, sel: Any, branches: Sequence[Fn], operands: Sequence[Any]) -> Any:
    """Every branch on the whole batch, each on its own copy of the operands; outputs
    and in-place updates of operands are selected per element by the masks."""
    n = len(branches)
    masks = [m.reshape(()) for m in b.masks(sel, n)]
    copies = [[x.clone() if isinstance(x, torch.Tensor) else x for x in operands] for _ in branches]
    versions = [[_version(x) for x in c] for c in copies]
    raw = [fn(*c) for fn, c in zip(branches, copies, strict=True)]
    for i, x in enumerate(operands):
        written = [k for k in range(n) if _version(copies[k][i]) != versions[k][i]]
        if written:
            x.copy_(_where_chain(masks, [copies[k][i] if k in written else x for k in range(n)]))
    outs = [as_tuple(r) for r in raw]
    roles = b.roles(n)
    selected = []
    for i, col in enumerate(zip(*outs, strict=True)):
        if not isinstance(col[0], torch.Tensor):
            if any(v != col[0] for v in col):
                raise _batched_mismatch(b, roles, i, col)
            selected.append(col[0])
        elif any(c.shape != col[0].shape for c in col):
            raise _batched_mismatch(b, roles, i, col)
        else:
            selected.append(_where_chain(masks, col))
    return like(raw[0], selected)


def _version(x: Any) -> int:
    """The version counter of the tensor under every functorch wrapper (wrappers keep 0)."""
    if not isinstance(x, torch.Tensor):
        return 0
    while torch._C._functorch.is_functorch_wrapped_tensor(x):
        x = torch._C._functorch.get_unwrapped(x)
    return int(x._version)


def _where_chain(masks: Sequence[Any], values: Sequence[Any]) -> Any:
    """``values[k]`` where ``masks[k]`` holds (the masks partition the batch)."""
    acc = values[-1]
    for k in range(len(values) - 2, -1, -1):
        acc = torch.where(masks[k], values[k], acc)
    return acc


def _batched_mismatch(b: Branching, roles: Sequence[str], i: int, col: Sequence[Any]) -> HopValueError:
    shapes = " vs ".join(str(tuple(c.shape)) if isinstance(c, torch.Tensor) else repr(c) for c in col)
    return HopValueError(
        format_message(
            b.name,
            f"under vmap with a batched selector every branch runs on the batch and the outputs are selected "
            f"element-wise, so {', '.join(roles)} must return equal sizes at output[{i}]: {shapes}",
            fix="Make the branches return the same sizes, or keep the selector unbatched.",
        ),
        op=b.name,
        path=f"output[{i}]",
    )


def functionalize(b: Branching, ctx: Any, sel: Any, branches: Sequence[Fn], operands: Sequence[Any]) -> Any:
    """Functionalize each branch and call the op on the unwrapped operands."""
    sel_u = ctx.unwrap_tensors(sel) if isinstance(sel, torch.Tensor) else sel
    unwrapped = ctx.unwrap_tensors(list(operands))
    with ctx.redispatch_to_next():
        bodies = [
            _subgraph.functionalize_body(ctx, fn, b.name, role)
            for fn, role in zip(branches, b.roles(len(branches)), strict=True)
        ]
        out = b.call(sel_u, bodies, unwrapped)
    return ctx.wrap_tensors(out)


def fake(b: Branching, mode: FakeTensorMode, sel: Any, branches: Sequence[Fn], operands: Sequence[Any]) -> Any:
    """Output metadata: run every branch on fake tensors and unify what differs."""
    with mode:
        if type(sel) in (bool, int):
            return dense(b, sel, branches, operands)
        return _run_all_and_merge(b, branches, operands, mode.shape_env)


def proxy(b: Branching, mode: Any, sel: Any, branches: Sequence[Fn], operands: Sequence[Any]) -> Any:
    """Trace every branch (lifting what it closes over) and record one node."""
    graphs, lifted = _subgraph.trace_branches(branches, operands)
    roles = b.roles(len(branches))
    for role, fn, gm in zip(roles, branches, graphs, strict=True):
        check_effects(
            b.name,
            role,
            fn,
            gm,
            what="operand",
            updates="operands",
            fix="Return the updated value from the branch instead of writing the operand.",
        )
    all_operands = (*operands, *lifted)
    with recording() as fresh:
        out = b.call(sel, graphs, all_operands)  # the proxy mode is popped: this reaches the fake rule
    for gm in graphs:
        _match_layout(gm, as_tuple(out))
    result = _subgraph.emit(mode, b.op, b.node_args(sel, graphs, all_operands), out)
    assert_ranges(mode, b.name, result, fresh)
    return result


def _match_layout(gm: torch.fx.GraphModule, merged: Sequence[Any]) -> None:
    """Make a branch graph return contiguous tensors where the unified output claims
    contiguity but the branch is laid out otherwise (hop._unbacked.Unifier): code
    traced after the op relies on the claimed strides (a reshape becomes a view)."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    flat = list(as_tuple(out_node.args[0]) if isinstance(out_node.args[0], (tuple, list)) else (out_node.args[0],))
    changed = False
    for i, (node, claim) in enumerate(zip(flat, merged, strict=True)):
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or not isinstance(claim, torch.Tensor):
            continue
        order = dense_order(claim)
        if order != tuple(range(claim.dim())) or dense_order(val) == order:
            continue
        with gm.graph.inserting_before(out_node):
            flat[i] = gm.graph.call_function(
                torch.ops.aten.clone.default, (node,), {"memory_format": torch.contiguous_format}
            )
        flat[i].meta["val"] = val.clone(memory_format=torch.contiguous_format)
        changed = True
    if changed:
        single = not isinstance(out_node.args[0], (tuple, list))
        out_node.args = (flat[0] if single else tuple(flat),)
        gm.recompile()
