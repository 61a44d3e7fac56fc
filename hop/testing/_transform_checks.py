"""The checks of ``TRANSFORMS``: eager, autograd, gradcheck, jvp, vmap, fake, make_fx and export.

Each ``_check_<transform>`` runs the program and its reference under one transform
of torch's and compares them (``hop.testing._case``), raising ``CheckFailure`` on a
mismatch or ``Skip`` where the transform does not apply; :func:`eager_outputs` runs both
eagerly first, for every check to compare with. A module of their own: one
function per transform, none knowing of the others or of the order
:func:`hop.testing.check` runs them in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from hop._pytree import flatten, leaf_paths, unflatten
from hop.testing._case import (
    CheckCase,
    CheckFailure,
    Fn,
    ProgramModule,
    Skip,
    arg_leaves,
    compare,
    compare_tensors,
    first_line,
    flat_program,
    gradcheck_passes,
    grads_of,
    inputs_and_wants,
    is_float,
    limitation,
    on_leaves,
    perturbed,
    reference,
    roundtrip,
    running,
    tensor_outputs,
    tensor_paths,
)


def eager_outputs(case: CheckCase) -> None:
    """Both eager outputs, which every transform compares with (run even when eager is not checked)."""
    case.want = case.ref(*case.args)  # a reference that raises: the program is wrong, let it raise
    with running("eager"):
        case.got = case.fn(*case.args)


def check_eager(case: CheckCase) -> None:
    compare(case, "eager", case.got, case.want)


def check_autograd(case: CheckCase) -> None:
    leaves, _ = arg_leaves(case)
    if not any(map(is_float, leaves)):
        raise Skip("no floating-point tensor inputs")
    paths = [p for p, x in zip(leaf_paths(case.args, "args"), leaves, strict=True) if is_float(x)]
    with running("autograd", reference=True):
        want = grads_of(case, case.ref, case.args)
    with running("autograd"):
        got = grads_of(case, case.fn, case.args)
    compare_tensors(case, "autograd", got, want, [f"grad of {p}" for p in paths])


def _gradcheck_error(fn: Fn, case: CheckCase) -> Exception | bool | None:
    """None when ``fn`` passes gradcheck; False when it fails; the exception when it raises."""
    try:
        return None if gradcheck_passes(fn, case) else False
    except Exception as e:
        return e


def check_gradcheck(case: CheckCase) -> None:
    floats = [x for x in arg_leaves(case)[0] if is_float(x)]
    if not floats:
        raise Skip("no floating-point tensor inputs")
    if any(x.dtype != torch.float64 for x in floats):
        raise Skip("the floating-point inputs are not all float64")
    error = _gradcheck_error(case.fn, case)
    if error is None:
        return
    if _gradcheck_error(case.ref, case) is not None:
        raise Skip("the reference fails gradcheck too (not differentiable at these inputs)")
    if isinstance(error, Exception):
        raise CheckFailure("gradcheck", f"fn raised {type(error).__name__}: {error}") from error
    raise CheckFailure("gradcheck", "analytical and numerical gradients differ (the reference's agree)")


def check_jvp(case: CheckCase) -> None:
    gen = case.generator(-2)
    paths = tensor_paths(case.want)

    def jvp(fn: Fn) -> Any:
        on, primals = on_leaves(tensor_outputs(fn), case, is_float)
        if not primals:
            raise Skip("no floating-point tensor inputs")
        tangents = tuple(torch.randn(p.shape, generator=gen, dtype=p.dtype).to(p.device) for p in primals)
        gen.manual_seed(case.seed * 1000 - 2)
        out: Any = torch.func.jvp(on, tuple(primals), tangents)
        return out

    with running("jvp", reference=True):
        want = jvp(case.ref)
    with running("jvp"):
        got = jvp(case.fn)
    compare_tensors(case, "jvp", got[0], want[0], paths)
    compare_tensors(case, "jvp", got[1], want[1], [f"tangent of {p}" for p in paths])


def check_vmap(case: CheckCase) -> None:
    leaves, _ = arg_leaves(case)
    if not any(isinstance(x, torch.Tensor) for x in leaves):
        raise Skip("no tensor inputs to batch")
    rows = []
    with running("vmap", reference=True):
        for k in range(case.batch_size):
            rows.append(case.ref(*perturbed(case, k)))
    shapes = {tuple((type(x), getattr(x, "shape", None)) for x in flatten(r)[0]) for r in rows}
    if len(shapes) > 1 or len({flatten(r)[1] for r in rows}) > 1:
        raise Skip("the outputs' shapes differ across the batch, so no batched output exists")
    tensor_rows = [tensor_outputs(lambda r=r: r)() for r in rows]
    want = [torch.stack(col) for col in zip(*tensor_rows, strict=True)]
    on, _ = on_leaves(tensor_outputs(case.fn), case, lambda x: isinstance(x, torch.Tensor))
    batched = [
        torch.stack([flatten(perturbed(case, k))[0][i] for k in range(case.batch_size)])
        for i, x in enumerate(leaves)
        if isinstance(x, torch.Tensor)
    ]
    try:
        got = torch.vmap(on)(*batched)
    except Exception as e:
        _vmap_fails_in_python_too(on, batched, e)
        with running("vmap"):
            raise
    compare_tensors(case, "vmap", got, want, tensor_paths(rows[0]))


def _vmap_fails_in_python_too(on: Any, batched: Sequence[Any], error: Exception) -> None:
    """Skip when torch.vmap also fails on the program's plain-Python meaning (each hop
    operator as the Python it stands for): a limitation of torch.vmap, such as a
    boolean mask, which raises another error depending on where the batch dimension is."""
    if isinstance(error, (CheckFailure, Skip)) or limitation("vmap", error) is not None:
        return  # a documented limitation says why itself
    try:
        with reference():
            torch.vmap(on)(*batched)
    except Exception as e:
        raise Skip(f"torch.vmap fails on the plain-Python program too: {first_line(e)}") from None


def _within(case: CheckCase, env: ShapeEnv, path: str, fake: Any, real: Any, what: str) -> None:
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


def check_fake(case: CheckCase) -> None:
    env = ShapeEnv()
    with FakeTensorMode(shape_env=env, allow_non_fake_inputs=True) as mode:  # parameters stay real
        fake_args = tuple(
            unflatten(
                [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in arg_leaves(case)[0]],
                arg_leaves(case)[1],
            )
        )
        with running("fake"):
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


def check_make_fx(case: CheckCase, mode: Literal["fake", "symbolic"]) -> None:
    transform = f"make_fx_{mode}"
    on, pick = flat_program(case)
    with running(transform):
        gm = make_fx(on, tracing_mode=mode, _allow_non_fake_inputs=True)(*pick(case.args))  # parameters
    for args, want in inputs_and_wants(case):
        with running(transform):
            got = gm(*pick(args))
        compare(case, transform, got, want)


def check_export(case: CheckCase) -> None:
    on, pick = flat_program(case)
    with running("export"):
        ep = torch.export.export(ProgramModule(on, case.fn), tuple(pick(case.args)))
        programs = [ep.module(), roundtrip(ep).module()]
    for args, want in inputs_and_wants(case):
        for program in programs:
            with running("export"):
                got = program(*pick(args))
            compare(case, "export", got, want)
