"""``hop.testing.check``: a program against its reference semantics, transform by transform.

The oracle is the program run under :func:`hop.testing.reference` (every hop
operator as plain Python), or a reference function the caller gives. Each
transform either runs and matches, raises :class:`CheckFailure` naming the
transform, the output path and the values, or is skipped with a reason that
the returned :class:`Report` records.
"""

from __future__ import annotations

import dataclasses
import io
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from hop import _reference
from hop._pytree import flatten, leaf_paths, unflatten
from hop.errors import CompileUnsupported, HopTypeError, HopValueError, format_message

__all__ = ["COMPILED", "TRANSFORMS", "CheckFailure", "Report", "bundle", "check", "reference"]

Fn = Callable[..., Any]

TRANSFORMS = ("eager", "autograd", "gradcheck", "jvp", "vmap", "fake", "make_fx_fake", "make_fx_symbolic", "export")
# The compiler bridge, opt-in (each compiles: seconds per program, an AOTInductor build tens of seconds).
COMPILED = ("compile_aot_eager", "compile_inductor", "export_strict", "aoti")
_NAME = "testing.check"


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


@dataclasses.dataclass
class Report:
    """What :func:`check` did: the transforms that ran and matched, and those skipped, with why."""

    ran: list[str] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"ran: {', '.join(self.ran) or '-'}"]
        lines += [f"skipped {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


class _Skip(Exception):
    """A transform that does not apply to the program; the message says why."""


# Documented limitations of hop (see the operator pages) and of torch: when the
# program raises one of these under a transform, the transform does not apply.
LIMITATIONS: list[tuple[str, type[BaseException], str, str]] = [
    ("vmap", HopValueError, r"must return equal sizes", "branches return different sizes under a batched selector"),
    ("vmap", HopValueError, r"int carries cannot change", "an int carry changes under a batched loop condition"),
    ("vmap", HopValueError, r"carries cannot change size", "a carry changes size under a batched loop condition"),
    ("vmap", HopValueError, r"traced loops carry tensors only", "an int carry in a traced loop under vmap"),
    ("vmap", RuntimeError, r"^vmap: .*(data-dependent|dynamic shape|item\(\))", "torch.vmap: a data-dependent op"),
    ("vmap", RuntimeError, r"Batching rule not implemented for aten::(nonzero|masked_select|_local_scalar)", "torch"),
    (
        "vmap",
        IndexError,
        r"^(The shape of the mask .* does not match|too many indices for tensor of dimension)",
        "torch.vmap: a boolean mask of a zero-size tensor",
    ),
]


# What the compiled paths refuse with a clear error, by design (docs/compile.md, "Limits"):
# a refusal is not a wrong result, so the transform does not apply.
LIMITATIONS += [
    (transform, CompileUnsupported, r".", "the compiled path refuses this program (hop's CompileUnsupported)")
    for transform in COMPILED
]


def _first_line(error: BaseException) -> str:
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"


def _limitation(transform: str, error: BaseException) -> str | None:
    for name, kind, pattern, why in LIMITATIONS:
        if name == transform and isinstance(error, kind) and re.search(pattern, str(error)):
            return f"{why} ({_first_line(error)})"
    return None


@dataclasses.dataclass
class _Case:
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


def check(
    fn: Fn,
    *args: Any,
    transforms: Sequence[str] = TRANSFORMS,
    reference: Fn | None = None,
    skip: Mapping[str, str] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    batch_size: int = 3,
    seed: int = 0,
) -> Report:
    """Check ``fn(*args)`` against its reference under each transform; raise on the first mismatch.

    Args:
        fn: the program, taking ``args`` (pytrees of tensors, ints, floats).
        transforms: which of ``TRANSFORMS`` to check, in that order: ``eager``;
            ``autograd`` (gradients w.r.t. every floating-point input equal the
            reference's); ``gradcheck`` (float64 inputs only); ``jvp``
            (``torch.func.jvp``); ``vmap`` (over ``batch_size`` perturbed copies
            of every tensor input, against a Python loop of the reference);
            ``fake`` (output metadata under ``FakeTensorMode``, unbacked sizes
            within their ranges); ``make_fx_fake`` / ``make_fx_symbolic`` (the
            graph runs and matches on ``args`` and on perturbed copies);
            ``export`` (``ep.module()`` and a ``torch.export.save``/``load``
            round trip match); and, opt-in (``COMPILED``), the compiler bridge,
            each on ``args`` and on perturbed copies that take other branches and
            trip counts, forward and (for float inputs) gradients:
            ``compile_aot_eager`` / ``compile_inductor`` (``torch.compile(fullgraph=True)``),
            ``export_strict`` (``torch.export.export(strict=True)``), ``aoti``
            (an AOTInductor package of the exported program, loaded and run; forward
            only). A documented refusal (``hop.errors.CompileUnsupported``) skips the
            transform; any other error, or a different value, is a failure.
        reference: the oracle; by default ``fn`` under :func:`reference`.
        skip: transforms known not to apply, each with the reason to record.
        rtol, atol: tolerances for ``torch.testing.assert_close`` (its dtype
            defaults when ``None``).
        batch_size: the vmap batch size.
        seed: seeds the perturbations, tangents and cotangents.

    Returns:
        A :class:`Report` of the transforms that ran and those skipped, with why.

    Raises:
        CheckFailure: the first mismatch: transform, output path and values.
    """
    _check_arguments(fn, transforms, reference, skip)
    _check_settings(skip, rtol, atol, batch_size)
    ref = reference if reference is not None else _under_reference(fn)
    case = _Case(fn, ref, args, rtol, atol, batch_size, seed)
    report = Report()
    _outputs(case)
    for name in _CHECKS:
        if name not in transforms:
            continue
        if skip and name in skip:
            report.skipped[name] = skip[name]
            continue
        try:
            _CHECKS[name](case)
        except _Skip as why:
            report.skipped[name] = str(why)
        else:
            report.ran.append(name)
    return report


def _check_arguments(fn: Any, transforms: Any, reference: Any, skip: Any) -> None:
    if isinstance(transforms, str):  # would be read letter by letter
        raise HopTypeError(
            format_message(
                _NAME, f"transforms must be a sequence of names, got {transforms!r}", fix=f"Pass ({transforms!r},)."
            ),
            op=_NAME,
        )
    for role, value in (("fn", fn), ("reference", reference)):
        if value is not None and not callable(value):
            raise HopTypeError(format_message(_NAME, f"{role} must be callable, got {type(value).__name__}"), op=_NAME)
    if fn is None:
        raise HopTypeError(format_message(_NAME, "fn must be callable, got NoneType"), op=_NAME)
    unknown = [t for t in (*transforms, *(skip or ())) if t not in _CHECKS]
    if unknown:
        raise HopValueError(
            format_message(_NAME, f"unknown transform {unknown[0]!r}", fix=f"Choose from {', '.join(_CHECKS)}."),
            op=_NAME,
        )


def _check_settings(skip: Any, rtol: Any, atol: Any, batch_size: Any) -> None:
    if skip is not None and not isinstance(skip, Mapping):
        raise HopTypeError(
            format_message(
                _NAME,
                f"skip must be a mapping from transform to the reason it does not apply, got {type(skip).__name__}",
                fix='Pass e.g. skip={"vmap": "why"}.',
            ),
            op=_NAME,
        )
    if (rtol is None) != (atol is None):
        raise HopValueError(
            format_message(_NAME, "rtol and atol go together (as in assert_close)", fix="Pass both or neither."),
            op=_NAME,
        )
    if type(batch_size) is not int or batch_size < 1:
        raise HopValueError(
            format_message(_NAME, f"batch_size must be a positive int, got {batch_size!r}"),
            op=_NAME,
        )


def _under_reference(fn: Fn) -> Fn:
    def ref(*args: Any) -> Any:
        with _reference.enabled():
            return fn(*args)

    return ref


# ---- comparing ------------------------------------------------------------------------


def _compare(case: _Case, transform: str, got: Any, want: Any, root: str = "output") -> None:
    g_leaves, g_spec = flatten(got)
    w_leaves, w_spec = flatten(want)
    if g_spec != w_spec:
        raise CheckFailure(transform, f"the output structure differs: {g_spec} vs the reference's {w_spec}")
    for path, g, w in zip(leaf_paths(want, root), g_leaves, w_leaves, strict=True):
        _compare_leaf(case, transform, path, g, w)


def _compare_leaf(case: _Case, transform: str, path: str, g: Any, w: Any) -> None:
    if isinstance(w, torch.Tensor) != isinstance(g, torch.Tensor):
        raise CheckFailure(transform, f"{type(g).__name__} vs the reference's {type(w).__name__}", path=path)
    if not isinstance(w, torch.Tensor):
        if g != w:
            raise CheckFailure(transform, f"{g!r} vs the reference's {w!r}", path=path)
        return
    try:
        torch.testing.assert_close(g, w, rtol=case.rtol, atol=case.atol, equal_nan=True)
    except AssertionError as e:
        raise CheckFailure(transform, f"{e}\ngot:      {g}\nexpected: {w}", path=path) from None


@contextmanager
def _running(transform: str, *, reference: bool = False) -> Iterator[None]:
    """An exception under ``transform``: from the reference, the transform does not apply (skip);
    from ``fn``, a documented limitation (skip) or a failure."""
    try:
        yield
    except (CheckFailure, _Skip):
        raise
    except Exception as e:
        why = f"the reference fails: {_first_line(e)}" if reference else _limitation(transform, e)
        if why is not None:
            raise _Skip(why) from None
        raise CheckFailure(transform, f"fn raised {type(e).__name__}: {e}") from e


# ---- inputs -----------------------------------------------------------------------------


def _leaves(case: _Case) -> tuple[list[Any], Any]:
    return flatten(case.args)


def _is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _perturbed(case: _Case, k: int) -> tuple[Any, ...]:
    """Copy ``k`` of the arguments: float tensors moved by noise, bool tensors flipped (odd ``k``)."""
    if k == 0:
        return case.args
    gen = case.generator(k)
    leaves, spec = _leaves(case)

    def move(x: Any) -> Any:
        if _is_float(x):
            return x + 0.5 * torch.randn(x.shape, generator=gen, dtype=x.dtype).to(x.device)
        if isinstance(x, torch.Tensor) and x.dtype == torch.bool and k % 2:
            return ~x
        return x

    return tuple(unflatten([move(x) for x in leaves], spec))


def _on_leaves(fn: Fn, case: _Case, keep: Callable[[Any], bool]) -> tuple[Fn, list[Any]]:
    """``fn`` as a function of the argument leaves that ``keep`` selects (the others are fixed)."""
    leaves, spec = _leaves(case)
    picked = [i for i, x in enumerate(leaves) if keep(x)]

    def on(*xs: Any) -> Any:
        full = list(leaves)
        for i, x in zip(picked, xs, strict=True):
            full[i] = x
        return fn(*unflatten(full, spec))

    return on, [leaves[i] for i in picked]


def _tensor_outputs(fn: Fn) -> Fn:
    """``fn`` returning only the tensor leaves of its output (what vmap and jvp can return)."""

    def g(*xs: Any) -> tuple[torch.Tensor, ...]:
        return tuple(o for o in flatten(fn(*xs))[0] if isinstance(o, torch.Tensor))

    return g


def _tensor_paths(tree: Any, root: str = "output") -> list[str]:
    leaves, _ = flatten(tree)
    return [p for p, x in zip(leaf_paths(tree, root), leaves, strict=True) if isinstance(x, torch.Tensor)]


def _compare_tensors(case: _Case, transform: str, got: Sequence[Any], want: Sequence[Any], paths: list[str]) -> None:
    for path, g, w in zip(paths, got, want, strict=True):
        _compare_leaf(case, transform, path, g, w)


# ---- the transforms ---------------------------------------------------------------------


def _outputs(case: _Case) -> None:
    """Both eager outputs, which every transform compares with (run even when eager is not checked)."""
    case.want = case.ref(*case.args)  # a reference that raises: the program is wrong, let it raise
    with _running("eager"):
        case.got = case.fn(*case.args)


def _check_eager(case: _Case) -> None:
    _compare(case, "eager", case.got, case.want)


def _float_outputs(out: Any) -> list[torch.Tensor]:
    return [o for o in flatten(out)[0] if _is_float(o) and o.requires_grad]


def _check_autograd(case: _Case) -> None:
    leaves, _ = _leaves(case)
    if not any(map(_is_float, leaves)):
        raise _Skip("no floating-point tensor inputs")
    paths = [p for p, x in zip(leaf_paths(case.args, "args"), leaves, strict=True) if _is_float(x)]
    with _running("autograd", reference=True):
        want = _grads(case, case.ref, case.args)
    with _running("autograd"):
        got = _grads(case, case.fn, case.args)
    _compare_tensors(case, "autograd", got, want, [f"grad of {p}" for p in paths])


def _grads(case: _Case, fn: Fn, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Gradients w.r.t. the float leaves of ``args`` of the float outputs weighted by seeded cotangents."""
    leaves, spec = flatten(args)
    inputs = [x.detach().clone().requires_grad_() if _is_float(x) else x for x in leaves]
    outs = _float_outputs(fn(*unflatten(inputs, spec)))
    if not outs:
        raise _Skip("no floating-point output depends on the inputs")
    gen = case.generator(-1)
    total = torch.stack([(o * torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device)).sum() for o in outs])
    diff = [x for x in inputs if _is_float(x)]
    got = torch.autograd.grad(total.sum(), diff, allow_unused=True)
    return tuple(torch.zeros_like(x) if g is None else g for x, g in zip(diff, got, strict=True))


def _gradcheck_error(fn: Fn, case: _Case) -> Exception | bool | None:
    """None when ``fn`` passes gradcheck; False when it fails; the exception when it raises."""
    try:
        return None if _gradcheck_passes(fn, case) else False
    except Exception as e:
        return e


def _gradcheck_passes(fn: Fn, case: _Case) -> bool:
    on, diff = _on_leaves(_tensor_outputs(fn), case, _is_float)

    def floats(*xs: Any) -> tuple[torch.Tensor, ...]:
        return tuple(o for o in on(*xs) if o.is_floating_point())

    inputs = tuple(x.detach().clone().requires_grad_() for x in diff)
    return bool(torch.autograd.gradcheck(floats, inputs, raise_exception=False, check_undefined_grad=False))


def _check_gradcheck(case: _Case) -> None:
    floats = [x for x in _leaves(case)[0] if _is_float(x)]
    if not floats:
        raise _Skip("no floating-point tensor inputs")
    if any(x.dtype != torch.float64 for x in floats):
        raise _Skip("the floating-point inputs are not all float64")
    error = _gradcheck_error(case.fn, case)
    if error is None:
        return
    if _gradcheck_error(case.ref, case) is not None:
        raise _Skip("the reference fails gradcheck too (not differentiable at these inputs)")
    if isinstance(error, Exception):
        raise CheckFailure("gradcheck", f"fn raised {type(error).__name__}: {error}") from error
    raise CheckFailure("gradcheck", "analytical and numerical gradients differ (the reference's agree)")


def _check_jvp(case: _Case) -> None:
    gen = case.generator(-2)
    paths = _tensor_paths(case.want)

    def jvp(fn: Fn) -> Any:
        on, primals = _on_leaves(_tensor_outputs(fn), case, _is_float)
        if not primals:
            raise _Skip("no floating-point tensor inputs")
        tangents = tuple(torch.randn(p.shape, generator=gen, dtype=p.dtype).to(p.device) for p in primals)
        gen.manual_seed(case.seed * 1000 - 2)
        out: Any = torch.func.jvp(on, tuple(primals), tangents)
        return out

    with _running("jvp", reference=True):
        want = jvp(case.ref)
    with _running("jvp"):
        got = jvp(case.fn)
    _compare_tensors(case, "jvp", got[0], want[0], paths)
    _compare_tensors(case, "jvp", got[1], want[1], [f"tangent of {p}" for p in paths])


def _check_vmap(case: _Case) -> None:
    leaves, _ = _leaves(case)
    if not any(isinstance(x, torch.Tensor) for x in leaves):
        raise _Skip("no tensor inputs to batch")
    rows = []
    with _running("vmap", reference=True):
        for k in range(case.batch_size):
            rows.append(case.ref(*_perturbed(case, k)))
    shapes = {tuple((type(x), getattr(x, "shape", None)) for x in flatten(r)[0]) for r in rows}
    if len(shapes) > 1 or len({flatten(r)[1] for r in rows}) > 1:
        raise _Skip("the outputs' shapes differ across the batch, so no batched output exists")
    tensor_rows = [_tensor_outputs(lambda r=r: r)() for r in rows]
    want = [torch.stack(col) for col in zip(*tensor_rows, strict=True)]
    on, _ = _on_leaves(_tensor_outputs(case.fn), case, lambda x: isinstance(x, torch.Tensor))
    batched = [
        torch.stack([flatten(_perturbed(case, k))[0][i] for k in range(case.batch_size)])
        for i, x in enumerate(leaves)
        if isinstance(x, torch.Tensor)
    ]
    try:
        got = torch.vmap(on)(*batched)
    except Exception as e:
        _vmap_fails_in_python_too(on, batched, e)
        with _running("vmap"):
            raise
    _compare_tensors(case, "vmap", got, want, _tensor_paths(rows[0]))


def _vmap_fails_in_python_too(on: Any, batched: Sequence[Any], error: Exception) -> None:
    """Skip when torch.vmap also fails on the program's plain-Python meaning (each hop
    operator as the Python it stands for): a limitation of torch.vmap, such as a
    boolean mask, which raises another error depending on where the batch dimension is."""
    if isinstance(error, (CheckFailure, _Skip)) or _limitation("vmap", error) is not None:
        return  # a documented limitation says why itself
    try:
        with reference():
            torch.vmap(on)(*batched)
    except Exception as e:
        raise _Skip(f"torch.vmap fails on the plain-Python program too: {_first_line(e)}") from None


def _within(case: _Case, env: ShapeEnv, path: str, fake: Any, real: Any, what: str) -> None:
    """A fake size (or int) matches the real one: equal, or the real value is within its symbol's range."""
    if isinstance(fake, torch.SymInt):
        if not fake.node.expr.free_symbols:
            fake = int(fake.node.expr)
        else:
            bound = env.bound_sympy(fake.node.expr)
            if not bound.lower <= real <= bound.upper:
                raise CheckFailure("fake", f"{what}: {real} is outside the range of {fake}: {bound}", path=path)
            return
    if fake != real:
        raise CheckFailure("fake", f"{what}: {fake} vs the real {real}", path=path)


def _check_fake(case: _Case) -> None:
    env = ShapeEnv()
    with FakeTensorMode(shape_env=env, allow_non_fake_inputs=True) as mode:  # parameters stay real
        fake_args = tuple(
            unflatten(
                [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in _leaves(case)[0]], _leaves(case)[1]
            )
        )
        with _running("fake"):
            out = case.fn(*fake_args)
    f_leaves, f_spec = flatten(out)
    r_leaves, r_spec = flatten(case.got)
    if f_spec != r_spec:
        raise CheckFailure("fake", f"the output structure differs: {f_spec} vs the real {r_spec}")
    for path, f, r in zip(leaf_paths(case.got), f_leaves, r_leaves, strict=True):
        if isinstance(r, torch.Tensor) != isinstance(f, torch.Tensor):
            raise CheckFailure("fake", f"{type(f).__name__} vs the real {type(r).__name__}", path=path)
        if not isinstance(r, torch.Tensor):
            _within(case, env, path, f, r, "value")
            continue
        for what, fv, rv in (("dtype", f.dtype, r.dtype), ("device", f.device, r.device), ("rank", f.dim(), r.dim())):
            if fv != rv:
                raise CheckFailure("fake", f"{what} {fv} vs the real {rv}", path=path)
        for d, (fs, rs) in enumerate(zip(f.shape, r.shape, strict=True)):
            _within(case, env, path, fs, rs, f"size {d}")


def _inputs(case: _Case) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """The arguments and one perturbed copy, each with the reference's output (when it has one)."""
    yield case.args, case.want
    args = _perturbed(case, 1)
    try:
        want = case.ref(*args)
    except Exception:
        return
    yield args, want


def _flat_program(case: _Case) -> tuple[Fn, Callable[[tuple[Any, ...]], list[Any]]]:
    """fn of the tensor leaves of the arguments (others fixed), and how to pick those leaves."""
    on, _ = _on_leaves(case.fn, case, lambda x: isinstance(x, torch.Tensor))
    return on, lambda args: [x for x in flatten(args)[0] if isinstance(x, torch.Tensor)]


def _check_make_fx(case: _Case, mode: Literal["fake", "symbolic"]) -> None:
    transform = f"make_fx_{mode}"
    on, pick = _flat_program(case)
    with _running(transform):
        gm = make_fx(on, tracing_mode=mode, _allow_non_fake_inputs=True)(*pick(case.args))  # parameters
    for args, want in _inputs(case):
        with _running(transform):
            got = gm(*pick(args))
        _compare(case, transform, got, want)


class _Program(torch.nn.Module):
    """``fn`` as a module to export; a model given to :func:`check` is registered, so that its
    parameters and buffers are the exported program's."""

    def __init__(self, fn: Fn, model: Any) -> None:
        super().__init__()
        self.fn = fn
        self.model = model if isinstance(model, torch.nn.Module) else None

    def forward(self, *xs: Any) -> Any:
        return self.fn(*xs)


def _roundtrip(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    return torch.export.load(buffer)


def _check_export(case: _Case) -> None:
    on, pick = _flat_program(case)
    with _running("export"):
        ep = torch.export.export(_Program(on, case.fn), tuple(pick(case.args)))
        programs = [ep.module(), _roundtrip(ep).module()]
    for args, want in _inputs(case):
        for program in programs:
            with _running("export"):
                got = program(*pick(args))
            _compare(case, "export", got, want)


# ---- the compiler bridge (COMPILED) ------------------------------------------------------


def _check_forward_and_grads(case: _Case, transform: str, program: Fn, grads: bool = True) -> None:
    """``program`` (a function of the tensor leaves) against the reference on every input, and its
    gradients against the reference's where the inputs have float leaves."""
    _, pick = _flat_program(case)
    leaves, _ = _leaves(case)
    float_paths = [f"grad of {p}" for p, x in zip(leaf_paths(case.args, "args"), leaves, strict=True) if _is_float(x)]
    for args, want in _inputs(case):
        with _running(transform):
            got = program(*pick(args))
        _compare(case, transform, got, want)
        if not grads or not float_paths:
            continue
        try:
            want_grads = _grads(case, case.ref, args)
        except Exception:
            continue  # no reference gradient here (checked by "autograd" when it has one)
        with _running(transform):
            got_grads = _grads(case, lambda *a: program(*pick(a)), args)
        _compare_tensors(case, transform, got_grads, want_grads, float_paths)


def _traceable_program(case: _Case) -> Fn:
    """fn of the tensor leaves of the arguments, rebuilt with torch's Python pytree (Dynamo
    traces it; hop's C++ pytree it cannot)."""
    import torch.utils._pytree as py_pytree

    leaves, spec = py_pytree.tree_flatten(case.args)
    picked = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def on(*xs: Any) -> Any:
        full = list(leaves)
        for i, x in zip(picked, xs, strict=True):
            full[i] = x
        return case.fn(*py_pytree.tree_unflatten(full, spec))

    return on


def _check_compile(case: _Case, backend: str) -> None:
    on = _traceable_program(case)
    torch._dynamo.reset()  # a fresh cache: each program compiles anew, guards and all
    compiled = torch.compile(on, backend=backend, fullgraph=True, dynamic=True)
    _check_forward_and_grads(case, f"compile_{backend}", compiled)


def _check_export_strict(case: _Case) -> None:
    on, pick = _traceable_program(case), _flat_program(case)[1]
    with _running("export_strict"):
        ep = torch.export.export(_Program(on, case.fn), tuple(pick(case.args)), strict=True)
        module = _roundtrip(ep).module()
    _check_forward_and_grads(case, "export_strict", module, grads=False)


def _check_aoti(case: _Case) -> None:
    import tempfile

    on, pick = _flat_program(case)
    with _running("aoti"), tempfile.TemporaryDirectory() as tmp:
        ep = torch.export.export(_Program(on, case.fn), tuple(pick(case.args)))
        path = torch._inductor.aoti_compile_and_package(ep, package_path=f"{tmp}/program.pt2")
        package = torch._inductor.aoti_load_package(path)
    _check_forward_and_grads(case, "aoti", lambda *xs: _as_reference(package(*xs), case.want), grads=False)


def _as_reference(out: Any, like: Any) -> Any:
    """An AOTInductor package returns ints as 0-dim tensors: read them back where the reference has ints."""
    o_leaves, _ = flatten(out)
    l_leaves, spec = flatten(like)
    if len(o_leaves) != len(l_leaves):
        return out
    pairs = zip(o_leaves, l_leaves, strict=True)
    fixed = [int(o) if isinstance(w, int) and isinstance(o, torch.Tensor) else o for o, w in pairs]
    return unflatten(fixed, spec)


def bundle(programs: Sequence[tuple[Fn, tuple[Any, ...]]]) -> tuple[Fn, tuple[Any, ...]]:
    """Many ``(fn, args)`` as one program and its arguments, so that one compilation (one
    AOTInductor build) checks them all: output ``k`` is program ``k``'s output.

    ``check(*bundle(pairs), transforms=COMPILED)``.
    """
    counts = [len(args) for _, args in programs]

    def bundled(*args: Any) -> tuple[Any, ...]:
        out, start = [], 0
        for (fn, _), n in zip(programs, counts, strict=True):
            out.append(fn(*args[start : start + n]))
            start += n
        return tuple(out)

    return bundled, tuple(a for _, args in programs for a in args)


_CHECKS: dict[str, Callable[[_Case], None]] = {
    "eager": _check_eager,
    "autograd": _check_autograd,
    "gradcheck": _check_gradcheck,
    "jvp": _check_jvp,
    "vmap": _check_vmap,
    "fake": _check_fake,
    "make_fx_fake": lambda case: _check_make_fx(case, "fake"),
    "make_fx_symbolic": lambda case: _check_make_fx(case, "symbolic"),
    "export": _check_export,
    "compile_aot_eager": lambda case: _check_compile(case, "aot_eager"),
    "compile_inductor": lambda case: _check_compile(case, "inductor"),
    "export_strict": _check_export_strict,
    "aoti": _check_aoti,
}
