"""The checks of ``COMPILED`` that compile: torch.compile (aot_eager, Inductor with and without
dynamic shapes, the vmapped program) and strict export.

Each compiles or exports the program, then compares its forward (and, where the
inputs have float leaves, its gradients) with the reference on the arguments and on
perturbed copies that take other branches and trip counts. Apart from the eager
transform checks because each compiles (seconds per program) and they are opt-in.
"""

from __future__ import annotations

from typing import Any

import torch

from hop._pytree import leaf_paths
from hop.testing._case import (
    CheckCase,
    Fn,
    ProgramModule,
    arg_leaves,
    compare,
    compare_tensors,
    flat_program,
    grads_of,
    inputs_and_wants,
    is_float,
    roundtrip,
    running,
)
from hop.testing._composition_checks import compile_compositions, compile_vmap, export_compositions
from hop.testing._deployment_checks import check_deploy_vmap as deploy_vmap
from hop.testing._deployment_checks import check_export_vmap as export_vmap
from hop.testing._deployment_checks import in_fresh_process


def _check_forward_and_grads(case: CheckCase, transform: str, program: Fn, grads: bool = True) -> None:
    """``program`` (a function of the tensor leaves) against the reference on every input, and its
    gradients against the reference's where the inputs have float leaves."""
    _, pick = flat_program(case)
    leaves, _ = arg_leaves(case)
    float_paths = [f"grad of {p}" for p, x in zip(leaf_paths(case.args, "args"), leaves, strict=True) if is_float(x)]
    for args, want in inputs_and_wants(case):
        with running(transform):
            got = program(*pick(args))
        compare(case, transform, got, want)
        if not grads or not float_paths:
            continue
        try:
            want_grads = grads_of(case, case.ref, args)
        except Exception:
            continue  # no reference gradient here (checked by "autograd" when it has one)
        with running(transform):
            got_grads = grads_of(case, lambda *a: program(*pick(a)), args)
        compare_tensors(case, transform, got_grads, want_grads, float_paths)


def _traceable_program(case: CheckCase) -> Fn:
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


def check_compile(case: CheckCase, backend: str, dynamic: bool = True) -> None:
    on = _traceable_program(case)
    torch._dynamo.reset()  # a fresh cache: each program compiles anew, guards and all
    compiled = torch.compile(on, backend=backend, fullgraph=True, dynamic=dynamic)
    name = f"compile_{backend}" if dynamic else f"compile_{backend}_static"
    _check_forward_and_grads(case, name, compiled)


def check_export_strict(case: CheckCase) -> None:
    on, pick = _traceable_program(case), flat_program(case)[1]
    with running("export_strict"):
        ep = torch.export.export(ProgramModule(on, case.fn), tuple(pick(case.args)), strict=True)
        module = roundtrip(ep).module()
    _check_forward_and_grads(case, "export_strict", module, grads=False)


def check_compile_vmap(case: CheckCase) -> None:
    compile_vmap(case, _traceable_program(case))


def check_export_vmap(case: CheckCase) -> None:
    export_vmap(case, _traceable_program(case))


def check_deploy_vmap(case: CheckCase) -> None:
    deploy_vmap(case, _traceable_program(case))


def check_compile_compositions(case: CheckCase) -> None:
    compile_compositions(case, _traceable_program(case))


def check_export_compositions(case: CheckCase) -> None:
    export_compositions(case, _traceable_program(case), in_fresh_process)
