"""Check a model across the compiled matrix against eager: torch.compile(fullgraph=True)
with aot_eager and Inductor, export (strict and non-strict, saved and loaded), and an
AOTInductor package run in a fresh process where hop cannot be imported.

Each check takes the model, one example to compile or export with, and several cases
that take other branches and trip counts; every case's result must equal eager's.
"""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.utils._pytree as pytree

Case = tuple[Any, ...]
M = TypeVar("M", bound=torch.nn.Module)


def sharing(twin: M, model: torch.nn.Module) -> M:
    """``twin`` (a model's twin: its plain-Python version, or a variant) with ``model``'s parameters."""
    twin.load_state_dict(model.state_dict())
    return twin


def assert_same(actual: Any, expected: Any, what: str) -> None:
    a, e = pytree.tree_leaves(actual), pytree.tree_leaves(expected)
    assert len(a) == len(e), f"{what}: {len(a)} outputs vs eager's {len(e)}"
    for k, (p, q) in enumerate(zip(a, e, strict=True)):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6, msg=lambda m, k=k: f"{what}, output {k}: {m}")


def _compile(model: Callable[..., Any], backend: str, dynamic: bool | None) -> Callable[..., Any]:
    """``model`` compiled with ``fullgraph=True``, each dynamic size its own symbol.

    Without duck sizing, an example's batch of 3 beside a model width of 3 no longer
    gets one symbol that the width then pins to 3: the compile stays dynamic instead
    of being specialized to the first case and compiled again for the next.
    """
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)

    def run(*args: Any) -> Any:
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            return compiled(*args)

    return run


def check_compile(model: Callable[..., Any], cases: Sequence[Case], backend: str, dynamic: bool = True) -> None:
    """Forward values of the compiled inference graph (as served, under ``no_grad``).

    Under grad mode a parameter would make AOTAutograd build and compile a backward
    that this check never runs; the compiled training graph is checked, outputs and
    gradients, by ``check_compile_grad`` and ``check_compile_training``.
    """
    compiled = _compile(model, backend, dynamic)
    with torch.no_grad():
        for k, case in enumerate(cases):
            assert_same(compiled(*case), model(*case), f"torch.compile({backend}) case {k}")


def check_compile_grad(model: Callable[..., Any], cases: Sequence[Case], backend: str) -> None:
    """The compiled training graph: ``model(*case)``'s outputs, and the gradients of
    their sum w.r.t. its floating inputs and parameters."""
    compiled = _compile(model, backend, None)

    def run(fn: Callable[..., Any], case: Case) -> tuple[Any, list[torch.Tensor]]:
        case = tuple(c.detach().requires_grad_() if _differentiable(c) else c for c in case)
        params = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
        wrt = [c for c in case if isinstance(c, torch.Tensor) and c.requires_grad] + params
        out = fn(*case)
        total = sum(o.sum() for o in pytree.tree_leaves(out) if _differentiable(o))
        grads = list(torch.autograd.grad(total, wrt, allow_unused=True, materialize_grads=True))
        return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out), grads

    for k, case in enumerate(cases):
        got, want = run(compiled, case), run(model, case)
        assert_same(got[0], want[0], f"torch.compile({backend}) training case {k}")
        assert_same(got[1], want[1], f"grad of torch.compile({backend}) case {k}")


def _differentiable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def export(model: torch.nn.Module, example: Case, strict: bool, dynamic_shapes: Any = None) -> Any:
    ep = torch.export.export(model, example, strict=strict, dynamic_shapes=dynamic_shapes)
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    return torch.export.load(buffer)


def check_export(
    model: torch.nn.Module,
    example: Case,
    cases: Sequence[Case],
    dynamic_shapes: Any = None,
    strict_modes: Sequence[bool] = (False, True),
) -> None:
    for strict in strict_modes:
        ep = export(model, example, strict, dynamic_shapes)
        decomposed = ep.run_decompositions()
        for k, case in enumerate(cases):
            assert_same(ep.module()(*case), model(*case), f"export(strict={strict}) case {k}")
            assert_same(decomposed.module()(*case), model(*case), f"run_decompositions(strict={strict}) case {k}")


# Runs in a fresh interpreter where hop cannot even be imported.
_LOAD = """
import sys
sys.modules["hop"] = None
import torch
package, inputs, outputs = sys.argv[1:]
model = torch._inductor.aoti_load_package(package)
torch.save([model(*case) for case in torch.load(inputs)], outputs)
"""


def check_aoti(
    model: torch.nn.Module, example: Case, cases: Sequence[Case], tmp: Path, dynamic_shapes: Any = None
) -> None:
    ep = torch.export.export(model, example, dynamic_shapes=dynamic_shapes)
    package = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp / "model.pt2"))
    torch.save(list(cases), tmp / "inputs.pt")
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD, package, str(tmp / "inputs.pt"), str(tmp / "outputs.pt")],
        capture_output=True,
        text=True,
        cwd=tmp,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for k, (got, case) in enumerate(zip(torch.load(tmp / "outputs.pt"), cases, strict=True)):
        assert_same(got, model(*case), f"AOTInductor case {k}")


def check_compile_training(
    model: torch.nn.Module,
    cases: Sequence[Case],
    backend: str,
    loss: Callable[[Any], torch.Tensor] | None = None,
    reference: torch.nn.Module | None = None,
) -> None:
    """One compiled training graph: its outputs and the gradients of ``loss(outputs)``
    (default: the outputs summed) w.r.t. the floating inputs and the parameters equal
    ``reference``'s (default: eager ``model``), case by case."""
    compiled = _compile(model, backend, True)
    reference = model if reference is None else reference

    def total(out: Any) -> torch.Tensor:
        if loss is not None:
            return loss(out)
        return sum((o.sum() for o in pytree.tree_leaves(out) if _differentiable(o)), torch.zeros(()))

    def run(fn: Callable[..., Any], params: list[torch.Tensor], case: Case) -> tuple[Any, list[torch.Tensor]]:
        case = tuple(c.detach().requires_grad_() if _differentiable(c) else c for c in case)
        wrt = [c for c in case if isinstance(c, torch.Tensor) and c.requires_grad] + params
        out = fn(*case)
        grads = torch.autograd.grad(total(out), wrt, allow_unused=True, materialize_grads=True)
        return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out), list(grads)

    for k, case in enumerate(cases):
        got = run(compiled, list(model.parameters()), case)
        want = run(reference, list(reference.parameters()), case)
        assert_same(got[0], want[0], f"torch.compile({backend}) training case {k}")
        assert_same(got[1], want[1], f"grad of torch.compile({backend}) case {k}")


def check_onnx(model: torch.nn.Module, example: Case, cases: Sequence[Case], dynamic_shapes: Any = None) -> None:
    """``torch.onnx.export(dynamo=True)`` of the model, loaded and run in onnxruntime."""
    import warnings

    import pytest

    ort = pytest.importorskip("onnxruntime", reason="the ONNX check runs the file in onnxruntime (a dev extra)")
    pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript (a dev extra)")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the exporter's own notes
        program = torch.onnx.export(model, example, dynamic_shapes=dynamic_shapes, dynamo=True, verbose=False)
    session = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    for k, case in enumerate(cases):
        got = session.run(None, dict(zip(names, [x.numpy() for x in pytree.tree_leaves(case)], strict=True)))
        with torch.no_grad():
            want = model(*case)
        assert_same([torch.from_numpy(g) for g in got], want, f"ONNX (onnxruntime) case {k}")


DEPLOYMENTS = ("export", "strict export refused", "aoti", "onnx")


def check_deployment(
    path: str,
    model: torch.nn.Module,
    example: Case,
    cases: Sequence[Case],
    tmp: Path,
    dynamic_shapes: Any = None,
    strict_refused: bool = True,
) -> None:
    """One of :data:`DEPLOYMENTS`: non-strict export (saved, loaded, decomposed); strict
    export of a ``torch.vmap`` whose callables read module parameters, which Dynamo
    cannot lift (the documented ``CompileUnsupported``, docs/compile.md); an AOTInductor
    package in a fresh process; an ONNX file in onnxruntime. ``strict_refused=False``: a
    model whose callables strict export captures, so that path checks it instead."""
    import pytest

    from hop.errors import CompileUnsupported

    if path == "strict export refused" and not strict_refused:  # a model whose strict export runs
        check_export(model, example, cases, dynamic_shapes=dynamic_shapes, strict_modes=(True,))
    elif path == "strict export refused":
        with pytest.raises(CompileUnsupported, match=r"reads a tensor that requires grad \(a module parameter\)"):
            torch.export.export(model, example, dynamic_shapes=dynamic_shapes, strict=True)
    elif path == "export":
        check_export(model, example, cases, dynamic_shapes=dynamic_shapes, strict_modes=(False,))
    elif path == "aoti":
        check_aoti(model, example, cases, tmp, dynamic_shapes=dynamic_shapes)
    else:
        check_onnx(model, example, cases, dynamic_shapes=dynamic_shapes)
