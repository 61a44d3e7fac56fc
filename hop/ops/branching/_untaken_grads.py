"""Zero gradients for what the untaken branches of an eager cond/switch read.

Note [untaken branches get zero gradients]
In eager a cond or switch with a readable selector runs only the chosen branch
(Note [eager branches run inline]), so autograd sees only the tensors that branch
reads: the parameters of the other branches would get no gradient at all. DDP
(``find_unused_parameters=False``) waits for a gradient of every parameter and
otherwise leaves its bucket un-reduced, so ranks that took different branches
silently diverge. torch.cond and JAX give every differentiable input of either
branch a gradient, zeros where the taken branch did not use it; hop does too.

After the chosen branch ran with grad enabled, its differentiable outputs pass
through one :class:`_ZeroGrads` node whose other inputs are every operand and
every tensor the branches close over (``hop._closures.closure_tensors``: cells,
bound ``self``, globals, defaults, partials) that requires grad and that the
taken branch's autograd graph does not reach (a walk of a few nodes: an operand
the branch used gets its gradient from it, so the commonest call adds no node). Its backward
passes the output gradients through unchanged and gives those tensors zeros: a
stride-0 expanded scalar, which autograd adds to the real gradient where the
taken branch used the tensor, and which AccumulateGrad copies into a dense
``.grad`` laid out like the tensor where it did not. Only dense tensors (and
parameters) get zeros: not tensor subclasses, such as the sharded DTensor
parameters FSDP2 swaps back in after a sharded module's forward (they are not
what the branch read, and FSDP2's reduction breaks on a gradient given to them).

The node's outputs are detached aliases of the branch's outputs, not the outputs
themselves: a tensor a custom Function returns unchanged becomes a view created
in that Function, which forbids in-place updates. A detached alias shares the
version counter, so an in-place update that breaks a saved tensor is caught as in
plain Python. A leaf that requires grad (a parameter returned as is) is cloned.
Under ``torch.jit.trace`` no node is added (it would be recorded as a Python op).

The closure search is static: every parameter of a module a branch closes over
(e.g. ``self``) gets a zero, even one neither branch uses. It follows cells,
defaults, bound owners (``self``, the tensor of ``w.mul``), partials, containers
and objects' attributes, and every global that is not inert (``_closures.is_inert``:
numbers, strings, Python modules, classes). Of a module or a class a function
reads (not a library's: ``torch``, ``math``), and of the class of an object it
reads, the attributes its code names are searched (``config.W``, ``Shared.W``,
``config.sub.W``, ``holder.W`` kept on the class), with the functions and methods
found so and what they read (``config.helper``, ``Tools.scale``, ``self.scaled``).
A traced call (a
selector that cannot be read) needs none of this: its node's backward is the vjp
of each branch with respect to every operand and converted closure tensor, and
``torch.func.vjp`` fills zeros for the inputs a branch does not use. Inside
torch.func grad / jvp transforms the eager path adds no node either: grad, vjp and
jacrev give the inputs a function does not use zeros themselves. Inside vmap only
(autograd outside it, ``torch.vmap(model)(x).sum().backward()``) the node is
added and batched by its generated vmap rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import BuiltinFunctionType, FunctionType
from typing import Any

import torch
from torch._C._functorch import TransformType

from hop import _closures, _pytree
from hop.ops._common import differentiable

__all__ = ["ACCUMULATE_GRAD", "close_over_nothing", "reads_nothing", "zero_untaken"]

_Tensor = torch.Tensor
_Function = FunctionType
_Module = torch.nn.Module
_DENSE = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided
_Builtin = BuiltinFunctionType  # torch.tanh and the like: C functions
_is_inert = _closures.is_inert
_is_namespace = _closures.is_namespace
_held_attributes = _closures.held_attributes
_GLOBALS_READ = _closures.GLOBALS_READ
_tracing_state: Callable[[], Any] = torch._C._get_tracing_state
_interpreter_stack: Callable[[], Any] = torch._C._functorch.get_interpreter_stack
_transforms_active: Callable[[], bool] = torch._C._are_functorch_transforms_active


def zero_untaken(out: Any, branches: Sequence[Callable[..., Any]], operands: Sequence[Any]) -> Any:
    """``out``, the chosen branch's result, with its differentiable leaves passed
    through the zero-gradient node when the branches read tensors that require grad
    (Note [untaken branches get zero gradients]). ``operands`` are flat leaves;
    the caller checked that grad mode is enabled. Every eager call with grad
    enabled pays for the decision, so it is written out long-hand."""
    plain = close_over_nothing(branches)
    if plain:
        for x in operands:
            if type(x) in _DENSE and x.requires_grad:
                break
        else:
            return out
    return _attach(out, branches, operands, plain)


def close_over_nothing(branches: Sequence[Callable[..., Any]]) -> bool:
    """Builtins, and plain functions without closure cells or defaults whose globals
    are inert (``_closures.is_inert``; the commonest case): nothing to search."""
    for fn in branches:
        if type(fn) is _Function and fn.__closure__ is not None:
            return False
        if not reads_nothing(fn):
            return False
    return True


def reads_nothing(fn: Callable[..., Any]) -> bool:
    """For a builtin or a function without closure cells: whether it has no defaults
    and reads no global that could lead to a tensor (``_closures.is_inert``: a
    number, a string, a library's module or class, a module or class holding nothing
    under the attribute names its code loads), so no tensor it reads (but its
    arguments) can require grad. On every eager call with grad enabled."""
    if type(fn) is not _Function:
        return type(fn) is _Builtin and _is_inert(fn)
    if fn.__defaults__ or fn.__kwdefaults__:
        return False
    code = fn.__code__
    names = _GLOBALS_READ.get(code)
    if names is None:
        names = _closures.globals_read(code)
    if names:
        g = fn.__globals__
        for name in names:  # mostly `torch`
            v = g.get(name)
            if not _is_inert(v):
                return False
            if _is_namespace(v) and _held_attributes(v, _closures.attributes_read(code)):
                return False  # a parameter kept as a module's or a class's attribute
    return True


def _attach(out: Any, branches: Sequence[Callable[..., Any]], operands: Sequence[Any], plain: bool) -> Any:
    if type(out) is _Tensor:
        if not (out.is_floating_point() or out.is_complex()):
            return out
        leaves: list[Any] = [out]
        spec = None
    else:
        leaves, spec = _pytree.flatten(out)
        if not any(differentiable(o) for o in leaves):
            return out
    closure = () if plain else _closures.closure_tensors(branches)
    reads = list({id(x): x for x in (*operands, *closure) if _dense_requiring_grad(x)}.values())
    if reads and not _transforms_active():
        reads = _unreached(leaves, reads)  # the taken branch's graph gives the others a gradient
    if not reads or _tracing_state() is not None:  # torch.jit.trace would record a Python op
        return out
    at = [i for i, o in enumerate(leaves) if differentiable(o)]
    inputs = (len(at), *[leaves[i] for i in at], *reads)
    passed = _ZeroGradsBatched.apply(*inputs) if _transforms_active() else _apply(*inputs)  # type: ignore[no-untyped-call]
    for i, o in zip(at, passed, strict=True):
        leaves[i] = o
    return leaves[0] if spec is None else _pytree.unflatten(leaves, spec)


def _unreached(outputs: Sequence[Any], reads: Sequence[torch.Tensor], budget: int = 32) -> list[torch.Tensor]:
    """The tensors of ``reads`` that the outputs' autograd graph does not reach within
    ``budget`` nodes: only those need the zero-gradient node, the others get their
    gradient from the branch that ran (an operand it used: the commonest call).
    Loops, not comprehensions: on every eager call with an operand requiring grad."""
    wanted: dict[int, torch.Tensor] = {}
    nodes: dict[int, torch.Tensor] = {}  # a non-leaf's grad_fn -> the tensor
    for r in reads:
        wanted[id(r)] = r
        fn = r.grad_fn
        if fn is not None:
            nodes[id(fn)] = r
    stack = []
    for o in outputs:
        if type(o) is _Tensor or isinstance(o, torch.Tensor):
            fn = o.grad_fn
            if fn is not None:
                stack.append(fn)
    seen: set[int] = set()
    while stack and wanted and budget:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        budget -= 1
        if type(node) is _AccumulateGrad:  # a leaf's
            wanted.pop(id(node.variable), None)  # type: ignore[attr-defined]
            continue
        owner = nodes.get(id(node))
        if owner is not None:
            wanted.pop(id(owner), None)
            continue
        for n, _ in node.next_functions:
            if n is not None:
                stack.append(n)
    return list(wanted.values())


def _accumulate_grad_type() -> type:
    # hop may be imported lazily under no_grad or inference_mode (an inference server)
    with torch.inference_mode(False), torch.enable_grad():
        leaf = torch.zeros(1, requires_grad=True)
        return type(leaf.view(1).grad_fn.next_functions[0][0])  # type: ignore[union-attr]


_AccumulateGrad = ACCUMULATE_GRAD = _accumulate_grad_type()


def only_vmap_levels() -> bool:
    """Every active torch.func transform is a vmap: plain autograd outside them
    differentiates the node (through its generated vmap rule), none of them does."""
    return all(i.key() == TransformType.Vmap for i in _interpreter_stack() or ())


def _dense_requiring_grad(x: Any) -> bool:
    # Not a subclass: FSDP2 swaps a sharded module's parameters back to sharded
    # DTensors after its forward, and a gradient given to those breaks its reduction.
    return type(x) in _DENSE and x.requires_grad and x.layout is _STRIDED


def _passed(tensors: Sequence[_Tensor]) -> tuple[_Tensor, ...]:
    return tuple([t.detach() if t.grad_fn is not None or not t.requires_grad else t.clone() for t in tensors])


def _metas(tensors: Sequence[_Tensor]) -> list[tuple[torch.Size, torch.dtype, torch.device]]:
    return [(t.shape, t.dtype, t.device) for t in tensors]


def _backward(ctx: Any, *grads: Any) -> Any:
    zeros: dict[tuple[torch.dtype, torch.device], _Tensor] = {}
    out: list[Any] = [None, *grads]
    for shape, dtype, device in ctx.metas:
        z = zeros.get((dtype, device))
        if z is None:
            z = zeros[(dtype, device)] = torch.zeros((), dtype=dtype, device=device)
        out.append(z.expand(shape))  # stride 0: no memory per tensor
    return tuple(out)


def _jvp(ctx: Any, *tangents: Any) -> Any:
    return tuple(tangents[1 : 1 + ctx.n])


class _ZeroGrads(torch.autograd.Function):
    """Identity on the first ``n`` inputs; zero gradients for the others.

    The ctx-in-forward form: ``Function.apply`` binds a ``setup_context`` form's
    arguments with ``inspect.signature`` on every call (~6x the cost of the node
    itself), and outside torch.func transforms the base class's C++ ``apply``
    (:data:`_apply`) is all ``Function.apply`` would call."""

    @staticmethod
    def forward(ctx: Any, n: int, *tensors: _Tensor) -> tuple[_Tensor, ...]:
        ctx.n, ctx.metas = n, _metas(tensors[n:])
        return _passed(tensors[:n])

    backward = staticmethod(_backward)
    jvp = staticmethod(_jvp)


class _ZeroGradsBatched(torch.autograd.Function):
    """:class:`_ZeroGrads` inside vmap (autograd outside it): the setup_context form
    that a generated vmap rule needs."""

    generate_vmap_rule = True

    @staticmethod
    def forward(n: int, *tensors: _Tensor) -> tuple[_Tensor, ...]:
        return _passed(tensors[:n])

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.n, ctx.metas = inputs[0], _metas(inputs[1 + inputs[0] :])

    backward = staticmethod(_backward)
    jvp = staticmethod(_jvp)


_apply: Callable[..., Any] = super(torch.autograd.Function, _ZeroGrads).apply
