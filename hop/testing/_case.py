"""What every check of ``hop.testing.check`` works on: the case, its inputs, and how results compare.

:class:`CheckCase` (the program, its reference, the arguments and settings),
:class:`CheckFailure` and ``Skip``, the documented limitations that skip a
transform (``LIMITATIONS``, read by ``running``), the comparison of outputs leaf by
leaf (``compare``), and the inputs each transform derives from the arguments
(perturbed copies, functions of the float leaves, gradients, the program as a
module to export). Below both the transform checks (``_transform_checks``,
``_compiled_checks``) and :func:`hop.testing.check` itself, which only orders them.
"""

from __future__ import annotations

import dataclasses
import io
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from hop import _reference
from hop._pytree import flatten, leaf_paths, unflatten
from hop.errors import CompileUnsupported, HopValueError

Fn = Callable[..., Any]

TRANSFORMS = (
    "eager",
    "autograd",
    "gradcheck",
    "jvp",
    "vmap",
    "vmap_grad",
    "grad_vmap",
    "vmap_jvp",
    "jvp_vmap",
    "fake",
    "make_fx_fake",
    "make_fx_symbolic",
    "export",
)
# The compiler bridge, opt-in (each compiles: seconds per program, an AOTInductor build tens of seconds).
COMPILED = (
    "compile_aot_eager",
    "compile_inductor",
    "compile_inductor_static",
    "compile_inductor_vmap",
    "compile_compositions",
    "export_strict",
    "export_vmap",
    "export_compositions",
    "aoti",
    "onnx",
    "deploy_vmap",
)


def reference() -> Any:
    """A context in which every hop operator runs as its plain-Python meaning.

    ``hop.cond`` is an ``if``, ``hop.switch`` an index into the branches,
    ``hop.while_loop`` and ``hop.fori_loop`` Python loops, ``hop.map``,
    ``hop.scan`` and ``hop.associative_scan`` loops over slices whose results are
    stacked with ``torch.stack``. It applies to the calling thread, nests, and is
    undone on exit, also by an exception.
    """
    return _reference.enabled()


class CheckFailure(AssertionError):
    """A program disagrees with its reference under a transform.

    Attributes:
        transform: the transform (one of ``TRANSFORMS``).
        path: the output (or gradient) path, e.g. ``output[1]["h"]``, or ``None``.
    """

    def __init__(self, transform: str, what: str, *, path: str | None = None) -> None:
        where = f" at {path}" if path else ""
        super().__init__(f"hop.testing.check: {transform}{where}: {what}")
        self.transform = transform
        self.path = path


class Skip(Exception):
    """A transform that does not apply to the program; the message says why."""


# The transforms that run the program under torch.vmap: vmap's limitations are theirs.
VMAPPED = (
    "vmap",
    "vmap_grad",
    "grad_vmap",
    "vmap_jvp",
    "jvp_vmap",
    "compile_inductor_vmap",
    "compile_compositions",
    "export_vmap",
    "deploy_vmap",
)

# A batched kernel sums in another order than a row's (a bmm for each row's mm), and
# Inductor's generated code fuses and vectorizes: a value through a few such ops
# differs from eager's in float32 by more than assert_close's defaults (found by the
# long profiles: 7e-6 relative for vmap_grad of a scan squaring a matmul, 1.6e-6 for
# Inductor's scan of squares growing to 1e6). float64 keeps the defaults, where such
# an order costs ~1e-15. A check given rtol/atol uses those. A gradient through any
# traced program is reordered too: where eager runs a concrete branch or loop as
# Python (autograd accumulating step by step), the traced node differentiates with
# hop's own rules (a scan's vjp is a reverse scan): 4e-6 relative in float32 under
# aot_eager, found by the long profile. onnxruntime's float32 kernels sum in their own
# order too: 2.7e-6 relative on a scan of a scan's running sums (the deployed profile).
REORDERED = (*VMAPPED, "compile_inductor", "compile_inductor_static", "aoti", "export_compositions", "onnx")
_REORDERED_TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1.6e-2, 1e-2)}

# Documented limitations of hop (see the operator pages) and of torch: when the
# program raises one of these under a transform, the transform does not apply.
LIMITATIONS: list[tuple[str, type[BaseException], str, str]] = [
    *(
        (name, HopValueError, r"must return equal sizes", "branches return different sizes under a batched selector")
        for name in VMAPPED
    ),
    *(
        limit
        for name in VMAPPED
        for limit in (
            (name, HopValueError, r"int carries cannot change", "an int carry changes under a batched loop condition"),
            (name, HopValueError, r"carries cannot change size", "a carry changes size under a batched loop condition"),
            (name, HopValueError, r"exported loops carry tensors only", "an int carry in an exported loop under vmap"),
            (
                name,
                RuntimeError,
                r"^vmap: .*(data-dependent|dynamic shape|item\(\))",
                "torch.vmap: a data-dependent op",
            ),
            (
                name,
                RuntimeError,
                r"Batching rule not implemented for aten::(nonzero|masked_select|_local_scalar)",
                "torch",
            ),
            (
                name,
                IndexError,
                r"^(The shape of the mask .* does not match|too many indices for tensor of dimension)",
                "torch.vmap: a boolean mask of a zero-size tensor",
            ),
        )
    ),
]

LIMITATIONS.append(
    (
        "export_compositions",
        HopValueError,
        r"under torch.func.jvp inside an exported function, loops carry tensors only",
        "an int carry in an exported loop under jvp",
    )
)
LIMITATIONS.append(  # a tensor read from outside the function, under strict export's jvp
    (
        "export_compositions",
        RuntimeError,
        r"^Cannot access data pointer of Tensor that doesn't have storage",
        "torch's strict export of a jvp cannot read a tensor the function closes over (a plain program neither)",
    )
)

# torch's non-strict export of torch.func.jvp(f) lifts a tensor f makes with a factory
# (torch.full((1, 1), 0.5)) as a constant that is still a fake tensor wrapped by the jvp's
# level: torch.export.save cannot store it and ep.module() returns fake values, in a
# plain program too (found by the compiled fuzzer's long profile; tests/test_testing.py
# keeps watch)
LIMITATIONS.append(
    (
        "export_compositions",
        NotImplementedError,
        r"^Cannot access storage of TensorWrapper",
        "torch's non-strict export of a jvp keeps a tensor the function makes as a fake constant "
        "(a plain program neither)",
    )
)

# a module-level tensor read inside torch.vmap: Dynamo's copy of it calls requires_grad_
# under the transform, in a plain program too (found by the compiled fuzzer's long profile)
LIMITATIONS += [
    (
        name,
        RuntimeError,
        r"^You are attempting to call Tensor.requires_grad_\(\)",
        "torch's strict export of a vmap cannot read a tensor from outside the function (a plain program neither)",
    )
    for name in ("export_vmap", "export_compositions")
]

# torch's Inductor cannot compile vmap of a 0-dim tensor plus a SymFloat (``a + 0.1 * k``
# with ``k`` read by ``.item()``: a fori_loop's int counter), in a plain program either
# (tests/compile/test_compiled_compositions.py keeps watch on it)
LIMITATIONS += [
    (
        name,
        Exception,
        r"x must be Tensor or scalar, got SymFloat",
        "torch's Inductor: vmap of a 0-dim tensor plus a SymFloat",
    )
    for name in ("compile_inductor_vmap", "compile_compositions")
]

# What the compiled paths refuse with a clear error, by design (docs/compile.md, "Limits"):
# a refusal is not a wrong result, so the transform does not apply.
LIMITATIONS += [
    (transform, CompileUnsupported, r".", "the compiled path refuses this program (hop's CompileUnsupported)")
    for transform in COMPILED
]


def first_line(error: BaseException) -> str:
    lines = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).splitlines()  # without terminal colours
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"


def limitation(transform: str, error: BaseException) -> str | None:
    for name, kind, pattern, why in LIMITATIONS:
        if name == transform and isinstance(error, kind) and re.search(pattern, str(error)):
            return f"{why} ({first_line(error)})"
    return None


@dataclasses.dataclass
class CheckCase:
    fn: Fn
    ref: Fn
    args: tuple[Any, ...]
    rtol: float | None
    atol: float | None
    batch_size: int
    seed: int
    want: Any = None  # the reference's eager output
    got: Any = None  # fn's eager output

    def generator(self, salt: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1000 + salt)


def compare(case: CheckCase, transform: str, got: Any, want: Any, root: str = "output") -> None:
    g_leaves, g_spec = flatten(got)
    w_leaves, w_spec = flatten(want)
    if g_spec != w_spec:
        raise CheckFailure(transform, f"the output structure differs: {g_spec} vs the reference's {w_spec}")
    for path, g, w in zip(leaf_paths(want, root), g_leaves, w_leaves, strict=True):
        compare_leaf(case, transform, path, g, w)


def compare_leaf(case: CheckCase, transform: str, path: str, g: Any, w: Any) -> None:
    if isinstance(w, torch.Tensor) != isinstance(g, torch.Tensor):
        raise CheckFailure(transform, f"{type(g).__name__} vs the reference's {type(w).__name__}", path=path)
    if not isinstance(w, torch.Tensor):
        if g != w:
            raise CheckFailure(transform, f"{g!r} vs the reference's {w!r}", path=path)
        return
    rtol, atol = case.rtol, case.atol
    reordered = transform in REORDERED or (transform in COMPILED and path.startswith("grad"))
    if rtol is None and reordered and w.dtype in _REORDERED_TOLERANCES:
        rtol, atol = _REORDERED_TOLERANCES[w.dtype]
    try:
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError as e:
        raise CheckFailure(transform, f"{e}\ngot:      {g}\nexpected: {w}", path=path) from None


@contextmanager
def running(transform: str, *, reference: bool = False) -> Iterator[None]:
    """An exception under ``transform``: from the reference, the transform does not apply (skip);
    from ``fn``, a documented limitation (skip) or a failure."""
    try:
        yield
    except (CheckFailure, Skip):
        raise
    except Exception as e:
        why = f"the reference fails: {first_line(e)}" if reference else limitation(transform, e)
        if why is not None:
            raise Skip(why) from None
        raise CheckFailure(transform, f"fn raised {type(e).__name__}: {e}") from e


def arg_leaves(case: CheckCase) -> tuple[list[Any], Any]:
    return flatten(case.args)


def is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def perturbed(case: CheckCase, k: int, *, laid_out: bool = False) -> tuple[Any, ...]:
    """Copy ``k`` of the arguments: float tensors moved by noise, bool tensors flipped (odd
    ``k``). With ``laid_out``, each is laid out as the argument is (strides, offset,
    overlaps): an AOTInductor package takes its inputs in the layout it was built for.
    Otherwise a copy is dense, so that a compiled program also meets another layout
    on its second call."""
    if k == 0:
        return case.args
    gen = case.generator(k)
    leaves, spec = arg_leaves(case)
    like = laid_out_like if laid_out else (lambda x, value: value)

    def move(x: Any) -> Any:
        if is_float(x):
            return like(x, x + 0.5 * torch.randn(x.shape, generator=gen, dtype=x.dtype).to(x.device))
        if isinstance(x, torch.Tensor) and x.dtype == torch.bool and k % 2:
            return like(x, ~x)
        return x

    return tuple(unflatten([move(x) for x in leaves], spec))


def laid_out_like(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` in ``x``'s layout: its strides and offset in a storage of its size.
    Where ``x`` overlaps (a stride 0), the overlapping elements take ``value``'s first."""
    if x.layout is not torch.strided or x.is_sparse or x.numel() == 0:
        return value
    first = value
    for d, (size, stride) in enumerate(zip(x.shape, x.stride(), strict=True)):
        if stride == 0 and size > 1:
            first = first.narrow(d, 0, 1)
    base = torch.zeros(x.untyped_storage().nbytes() // x.element_size(), dtype=x.dtype, device=x.device)
    base.as_strided(first.shape, x.stride(), x.storage_offset()).copy_(first)
    return base.as_strided(x.shape, x.stride(), x.storage_offset()).requires_grad_(value.requires_grad)


def on_leaves(fn: Fn, case: CheckCase, keep: Callable[[Any], bool]) -> tuple[Fn, list[Any]]:
    """``fn`` as a function of the argument leaves that ``keep`` selects (the others are fixed)."""
    leaves, spec = arg_leaves(case)
    picked = [i for i, x in enumerate(leaves) if keep(x)]

    def on(*xs: Any) -> Any:
        full = list(leaves)
        for i, x in zip(picked, xs, strict=True):
            full[i] = x
        return fn(*unflatten(full, spec))

    return on, [leaves[i] for i in picked]


def tensor_outputs(fn: Fn) -> Fn:
    """``fn`` returning only the tensor leaves of its output (what vmap and jvp can return)."""

    def g(*xs: Any) -> tuple[torch.Tensor, ...]:
        return tuple(o for o in flatten(fn(*xs))[0] if isinstance(o, torch.Tensor))

    return g


def tensor_paths(tree: Any, root: str = "output") -> list[str]:
    leaves, _ = flatten(tree)
    return [p for p, x in zip(leaf_paths(tree, root), leaves, strict=True) if isinstance(x, torch.Tensor)]


def compare_tensors(case: CheckCase, transform: str, got: Sequence[Any], want: Sequence[Any], paths: list[str]) -> None:
    for path, g, w in zip(paths, got, want, strict=True):
        compare_leaf(case, transform, path, g, w)


def float_outputs(out: Any) -> list[torch.Tensor]:
    return [o for o in flatten(out)[0] if is_float(o) and o.requires_grad]


def grads_of(case: CheckCase, fn: Fn, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Gradients w.r.t. the float leaves of ``args`` of the float outputs weighted by seeded cotangents."""
    leaves, spec = flatten(args)
    inputs = [x.detach().clone().requires_grad_() if is_float(x) else x for x in leaves]
    outs = float_outputs(fn(*unflatten(inputs, spec)))
    if not outs:
        raise Skip("no floating-point output depends on the inputs")
    gen = case.generator(-1)
    total = torch.stack([(o * torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device)).sum() for o in outs])
    diff = [x for x in inputs if is_float(x)]
    got = torch.autograd.grad(total.sum(), diff, allow_unused=True)
    return tuple(torch.zeros_like(x) if g is None else g for x, g in zip(diff, got, strict=True))


def gradcheck_passes(fn: Fn, case: CheckCase) -> bool:
    on, diff = on_leaves(tensor_outputs(fn), case, is_float)

    def floats(*xs: Any) -> tuple[torch.Tensor, ...]:
        return tuple(o for o in on(*xs) if o.is_floating_point())

    inputs = tuple(x.detach().clone().requires_grad_() for x in diff)
    return bool(torch.autograd.gradcheck(floats, inputs, raise_exception=False, check_undefined_grad=False))


def inputs_and_wants(case: CheckCase, *, laid_out: bool = False) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """The arguments and one perturbed copy (``laid_out``: see :func:`perturbed`), each
    with the reference's output (when it has one)."""
    yield case.args, case.want
    args = perturbed(case, 1, laid_out=laid_out)
    try:
        want = case.ref(*args)
    except Exception:
        return
    yield args, want


def flat_program(case: CheckCase) -> tuple[Fn, Callable[[tuple[Any, ...]], list[Any]]]:
    """fn of the tensor leaves of the arguments (others fixed), and how to pick those leaves."""
    on, _ = on_leaves(case.fn, case, lambda x: isinstance(x, torch.Tensor))
    return on, lambda args: [x for x in flatten(args)[0] if isinstance(x, torch.Tensor)]


class ProgramModule(torch.nn.Module):
    """``fn`` as a module to export; a model given to :func:`check` is registered, so that its
    parameters and buffers are the exported program's."""

    def __init__(self, fn: Fn, model: Any) -> None:
        super().__init__()
        self.fn = fn
        self.model = model if isinstance(model, torch.nn.Module) else None

    def forward(self, *xs: Any) -> Any:
        return self.fn(*xs)


def roundtrip(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    return torch.export.load(buffer)
