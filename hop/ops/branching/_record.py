"""What cond and switch share: their record, the checked user-level call, validation.

cond is a two-branch switch: ``cond(pred, t, f)`` takes branch 0 when ``pred``
holds. A :class:`Branching` says how a selector picks a branch and how the raw op
is called; the rules (``branching._rules``) are written once against it and
registered on both raw ops by ``cond.py`` and ``switch.py``, and the eager fast
paths of a validated call live in ``branching._eager``.

Note [eager branches run inline]
When the selector is concrete (a Python value, or a real tensor under every
functorch wrapper, while nothing traces), the rules run the chosen branch as
plain Python at the current level: autograd, grad, jvp and vmap (with an
unbatched selector) then see the branch's own ops, which gives exact derivatives
of every order and covers tensors the branch closes over. Only a selector that
cannot be read (SymBool/SymInt, fake, functional, batched) keeps the operator as
one node, with the rule that builds its derivative or batched version as new
branches. What the untaken branches read still gets a zero gradient: Note
[untaken branches get zero gradients] in ``branching._untaken_grads``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hop import _effects, _observe, _output_checks, _pytree, _spec, _transforms, config
from hop import _validation as validation
from hop._operator import HigherOrderOperator
from hop.errors import (
    HopRuntimeError,
    HopTypeError,
    OutputMismatchError,
    format_message,
    not_a_sequence,
    type_name,
)
from hop.ops._common import as_tuple
from hop.ops.branching._untaken_grads import zero_untaken

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
    selector: str = "index"  # the selector's parameter name, for messages

    def __post_init__(self) -> None:
        BY_NAME[self.name] = self

    def node_args(self, selector: Any, graphs: Sequence[Any], operands: tuple[Any, ...]) -> tuple[Any, ...]:
        """A node's arguments, placed by the operator's spec."""
        spec = _spec.spec_of(self.name)
        assert spec is not None, self.name
        return spec.node_args(selector=selector, subgraphs=graphs, inputs=operands)


BY_NAME: dict[str, Branching] = {}


class _Outputs:
    """What the branches of one call returned so far, to check them against each other."""

    def __init__(self, branching: Branching, branches: Sequence[Fn]) -> None:
        self.branching = branching
        self.fns = branches
        self.roles = branching.roles(len(branches))
        self.first: tuple[int, Any] | None = None
        self.spec: _pytree.TreeSpec | None = None
        self.kind: Any = None  # Note [outputs are checked on every call] in hop._validation

    def record(self, k: int, out: Any, spec: _pytree.TreeSpec) -> None:
        _check_output_leaves(self.branching, self.roles[k], self.fns[k], out)
        metas = _pytree.unflatten([_output_checks.leaf_meta(x) for x in _pytree.flatten(out)[0]], spec)
        if self.first is None:
            self.first, self.spec = (k, metas), spec
            self.kind = validation.output_kind(out)
            return
        j, ref = self.first
        (a, out_a), (c, out_c) = sorted(((j, ref), (k, metas)), key=lambda pair: pair[0])
        # in the branches' order, whichever ran first (eager runs the taken one first)
        _output_checks.check_same_outputs(
            self.branching.name, (self.roles[a], self.roles[c]), (out_a, out_c), fns=(self.fns[a], self.fns[c])
        )


def flat_branches(branching: Branching, branches: Sequence[Fn], in_spec: Any) -> tuple[list[Fn], _Outputs]:
    """Branches taking and returning flat leaves; they record and check their outputs."""
    outputs = _Outputs(branching, branches)

    def make(k: int, fn: Fn) -> Fn:
        def flat(*leaves: Any) -> Any:
            out = fn(*_pytree.unflatten(leaves, in_spec))
            out_leaves, spec = _pytree.flatten(out)
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


def call(branching: Branching, sel: Any, branches: Sequence[Fn], operands: Any, taken: int | None = None) -> Any:
    """``branches[index(sel)](*operands)`` through the raw op, after checking the arguments;
    ``taken``: the index the caller already read from ``sel`` in plain eager."""
    roles = branching.roles(len(branches))
    for role, fn in zip(roles, branches, strict=True):
        if not callable(fn):
            raise HopTypeError(
                format_message(branching.name, f"{role} must be callable, got {type_name(fn)}"),
                op=branching.name,
                role=role,
            )
    check_operands(branching.name, operands)
    leaves, in_spec = _pytree.flatten(tuple(operands))
    if _transforms.is_concrete(sel) and _transforms.in_plain_eager() and all(map(_transforms.is_plain_leaf, leaves)):
        k = branching.index(sel, len(branches)) if taken is None else taken
        if _SINKS:
            _observe.note(branching.name, inline=True)
        key = _validate(branching, branches, operands, leaves, in_spec, k)
        out = branches[k](*operands)
        if key is not None and not validation.known_kind(key, out):
            check_new_kind(branching, key, branches, operands, k, out)
        out = no_alias_tree(out, leaves)
        return zero_untaken(out, branches, leaves) if _grad_enabled() else out
    key = _validate_under_transform(branching, sel, branches, operands, leaves, in_spec)
    flat, outputs = flat_branches(branching, branches, in_spec)
    out = as_tuple(branching.call(sel, flat, leaves))
    assert outputs.spec is not None  # a branch ran (traced or fake)
    result = _pytree.unflatten(list(out[: outputs.spec.num_leaves]), outputs.spec)
    if key is not None and not validation.known_kind(key, result):
        check_new_kind(branching, key, branches, operands, branching.index(sel, len(branches)), result)
    return result


def _validate_under_transform(
    branching: Branching, sel: Any, branches: Sequence[Fn], operands: Any, leaves: list[Any], spec: Any
) -> Any:
    """Note [validation under torch.func]: a concrete selector under functorch
    transforms (nothing tracing) is validated as in plain eager; the verdict's key,
    or None when nothing was validated."""
    if _transforms.functorch_level() is None or not _transforms.is_concrete(sel) or not _transforms.no_modes():
        return None
    if not all(map(_transforms.is_real, leaves)):
        return None
    key = validation.signature(branching.name, branches, operands, leaves, spec)
    if validation.is_known(key):  # before reading sel: a read under a transform is slow
        return None if config.validate == "never" else key
    return _validate(branching, branches, operands, leaves, spec, branching.index(sel, len(branches)))


_SINKS = _observe.SINKS
_Tensor = torch.Tensor
_grad_enabled = torch.is_grad_enabled


def check_operands(name: str, operands: Any) -> None:
    """``operands`` is a tuple or list of pytrees of tensors and ints (also on the
    paths that run a branch directly, so a bare tensor is never unpacked row by row)."""
    if not isinstance(operands, (tuple, list)):
        raise not_a_sequence(name, "operands", type_name(operands))
    for x in operands:
        if type(x) is not _Tensor and type(x) is not int:  # else flat and plain: nothing to walk
            _check_leaves(name, operands, _pytree.flatten(tuple(operands))[0])
            return


def _check_leaves(name: str, operands: Any, leaves: Sequence[Any]) -> None:
    for path, leaf in zip(_pytree.leaf_paths(tuple(operands), "operands"), leaves, strict=True):
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


def _check_output_leaves(branching: Branching, role: str, fn: Fn, out: Any) -> None:
    """A branch returns tensors, ints and Nones: anything else (a str, a float, a bool)
    cannot be an output of a traced program (a number would be baked in as one branch's)."""
    leaves = _pytree.flatten(out)[0]
    if all(map(_output_leaf, leaves)):
        return
    for path, leaf in zip(_pytree.leaf_paths(out), leaves, strict=True):
        if not _output_leaf(leaf):
            raise HopTypeError(
                format_message(
                    branching.name,
                    f"{role} ({_output_checks.describe_fn(fn)}) returns {type_name(leaf)} {repr(leaf)[:40]} at {path}; "
                    "branches return tensors and ints",
                    fix="Return torch.tensor(value) for a number; close over other values instead of returning them.",
                ),
                op=branching.name,
                role=role,
                path=path,
            )


def no_alias_tree(out: Any, operands: Sequence[Any]) -> Any:
    leaves, spec = _pytree.flatten(out)
    cloned = (
        _effects.clone_aliases(leaves, operands) if any(_effects.may_alias(o, operands) for o in leaves) else leaves
    )
    return out if cloned is leaves else _pytree.unflatten(cloned, spec)


# --- validation once per signature ------------------------------------------------------------


def _validate(
    branching: Branching, branches: Sequence[Fn], operands: Any, leaves: list[Any], spec: Any, taken: int
) -> Any:
    """Run every branch once on fake tensors to check they agree (see ``hop.config.validate``);
    the verdict's key, None when validation is off."""
    key = validation.signature(branching.name, branches, operands, leaves, spec)
    if validation.is_known(key):
        return None if config.validate == "never" else key
    flat, outputs = flat_branches(branching, branches, spec)
    roles = branching.roles(len(branches))
    unchecked: dict[int, str] = {}
    aliasing = False
    if not validation.fakeable(leaves):
        return None  # a quantized operand: the real call decides
    with validation.fake_inputs(leaves) as fake:
        for k in [taken] + [i for i in range(len(flat)) if i != taken]:
            try:
                validation.check_hooks(branches[k])
                aliasing = _effects.hidden_alias(as_tuple(flat[k](*fake)), fake) or aliasing
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
                        branching.name,
                        f"{roles[k]} ({_output_checks.describe_fn(branches[k])}) fails on the operands "
                        f"(checked with fake tensors, as torch.export would run it): {type(e).__name__}: {e}",
                    ),
                    op=branching.name,
                    role=roles[k],
                ) from e
    validation.remember(key, outputs.kind, aliasing=aliasing)
    validation.remember_unchecked(key, unchecked)
    return key


def check_new_kind(
    branching: Branching, key: Any, branches: Sequence[Fn], operands: Sequence[Any], k: int, out: Any
) -> None:
    """The chosen branch returned a kind of output its verdict has not seen (Note
    [outputs are checked on every call]): validate again now; the output must be of
    the kind that finds, else it differs from what the branches were checked to return."""
    leaves, spec = _pytree.flatten(tuple(operands))
    before = validation._VERDICTS.get(key)
    validation.forget(key)
    _validate(branching, branches, operands, leaves, spec, k)
    if validation.known_kind(key, out):
        validation._VERDICTS[key] |= before or set()
        return
    role = branching.roles(len(branches))[k]
    expected = next(iter(validation._VERDICTS.get(key) or {None}))
    why = validation._UNCHECKED.get(key, {}).get(k)
    if why is not None:
        raise _unchecked_mismatch(branching, branches, k, out, expected, why)
    raise OutputMismatchError(
        format_message(
            branching.name,
            f"{role} ({_output_checks.describe_fn(branches[k])}) returned {validation.describe_kind(out)}, but run on "
            f"fake tensors it returns {validation.describe_kind(expected, kind=True)}: its output depends on "
            "something that is neither its code, its closure nor its operands",
            fix=f"Make {role} return the same kind of value whatever it reads from outside (defaults, globals).",
        ),
        op=branching.name,
        role=role,
    )


def _unchecked_mismatch(
    branching: Branching, branches: Sequence[Fn], k: int, out: Any, expected: Any, why: str
) -> Exception:
    """The error for a branch no fake run could check whose real output differs from
    what the other branches were checked to return."""
    role = branching.roles(len(branches))[k]
    return OutputMismatchError(
        format_message(
            branching.name,
            f"{role} ({_output_checks.describe_fn(branches[k])}) returned {validation.describe_kind(out)}, "
            f"but the other branches, checked on fake tensors, return {validation.describe_kind(expected, kind=True)} "
            f"({role} itself could not be checked ahead of time: {why})",
            fix="Make every branch return the same structure, dtypes, devices and ranks.",
        ),
        op=branching.name,
        role=role,
    )
