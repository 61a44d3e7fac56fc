"""The checks of ``COMPILED`` that deploy the program: ``export_vmap``, ``aoti``, ``onnx``, ``deploy_vmap``.

``export_vmap`` exports the batched program (strict and non-strict, saved and
loaded) and compares it with the reference row by row. ``aoti`` builds an
AOTInductor package and runs it in a fresh interpreter in which hop cannot be
imported, as a server would. ``onnx`` exports with ``torch.onnx.export(dynamo=True)``
and runs the file in onnxruntime (skipped when onnxruntime or onnxscript is not
installed). ``deploy_vmap`` does both to the exported batched program. Each
compares with the reference on the arguments (and, but for the batched ones, on a
perturbed copy).
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

from hop._pytree import flatten, unflatten
from hop.testing._case import (
    CheckCase,
    ProgramModule,
    Skip,
    compare,
    compare_tensors,
    flat_program,
    inputs_and_wants,
    roundtrip,
    running,
)
from hop.testing._composition_checks import batched_reference


def check_export_vmap(case: CheckCase, traceable: Any) -> None:
    """``torch.export`` of ``torch.vmap(fn)`` (non-strict and strict), each saved and loaded."""
    import torch.utils._pytree as py_pytree  # Dynamo traces torch's Python pytree, not hop's

    stacked, want = batched_reference(case, "export_vmap")

    def floats(*xs: Any) -> tuple[torch.Tensor, ...]:
        leaves = py_pytree.tree_leaves(traceable(*xs))
        return tuple(o for o in leaves if isinstance(o, torch.Tensor) and o.is_floating_point())

    paths = [f"output {k}" for k in range(len(want))]
    for strict in (False, True):
        with running("export_vmap"):
            ep = torch.export.export(ProgramModule(torch.vmap(floats), case.fn), tuple(stacked), strict=strict)
            got = list(roundtrip(ep).module()(*stacked))
        compare_tensors(case, "export_vmap", got, want, paths)


def check_deploy_vmap(case: CheckCase, traceable: Any) -> None:
    """``torch.vmap(fn)`` exported, then as an AOTInductor package run in a fresh process
    and (where onnxruntime is installed) as an ONNX file run in onnxruntime."""
    import torch.utils._pytree as py_pytree  # Dynamo traces torch's Python pytree, not hop's

    stacked, want = batched_reference(case, "deploy_vmap")

    def floats(*xs: Any) -> tuple[torch.Tensor, ...]:
        leaves = py_pytree.tree_leaves(traceable(*xs))
        return tuple(o for o in leaves if isinstance(o, torch.Tensor) and o.is_floating_point())

    module = ProgramModule(torch.vmap(floats), case.fn)
    paths = [f"output {k}" for k in range(len(want))]
    with running("deploy_vmap"):
        ep = torch.export.export(module, tuple(stacked))
        (got,) = in_fresh_process(ep, [list(stacked)])
    compare_tensors(case, "deploy_vmap", list(got), want, paths)
    session = _onnx_session(module, list(stacked), "deploy_vmap")
    if session is not None:
        with running("deploy_vmap"):
            got = _onnx_run(session, list(stacked))
        compare_tensors(case, "deploy_vmap", got, want, paths)


# Runs in a fresh interpreter in which hop (and the modules named after the paths)
# cannot be imported: what a deployed package has.
_LOAD = """
import sys
package, inputs, outputs, *hidden = sys.argv[1:]
for name in hidden:
    sys.modules[name] = None
import torch
program = torch._inductor.aoti_load_package(package)
torch.save([program(*xs) for xs in torch.load(inputs)], outputs)
"""


def check_aoti(case: CheckCase) -> None:
    on, pick = flat_program(case)
    pairs = list(inputs_and_wants(case, laid_out=True))  # the package's layout
    with running("aoti"):
        ep = torch.export.export(ProgramModule(on, case.fn), tuple(pick(case.args)))
        outputs = in_fresh_process(ep, [pick(args) for args, _ in pairs])
    for got, (_, want) in zip(outputs, pairs, strict=True):
        compare(case, "aoti", as_reference(got, want), want)


def in_fresh_process(
    ep: torch.export.ExportedProgram, inputs: list[list[torch.Tensor]], hide: tuple[str, ...] = ("hop",)
) -> list[Any]:
    """``ep`` as an AOTInductor package, run on each of ``inputs`` in a fresh interpreter
    in which the modules ``hide`` names cannot be imported."""
    with tempfile.TemporaryDirectory() as tmp:
        package = torch._inductor.aoti_compile_and_package(ep, package_path=f"{tmp}/program.pt2")
        torch.save(inputs, f"{tmp}/inputs.pt")
        run = subprocess.run(
            [sys.executable, "-c", _LOAD, package, f"{tmp}/inputs.pt", f"{tmp}/outputs.pt", *hide],
            capture_output=True,
            text=True,
            cwd=tmp,
        )
        if run.returncode != 0:
            raise RuntimeError(f"the package failed in a fresh process:\n{run.stderr[-3000:]}")
        outputs: list[Any] = torch.load(Path(tmp) / "outputs.pt")
    return outputs


def as_reference(out: Any, reference: Any) -> Any:
    """A deployed program returns ints as 0-dim tensors: read them back where the reference has ints."""
    o_leaves, _ = flatten(out)
    l_leaves, spec = flatten(reference)
    if len(o_leaves) != len(l_leaves):
        return out
    pairs = zip(o_leaves, l_leaves, strict=True)
    fixed = [int(o) if isinstance(w, int) and isinstance(o, torch.Tensor) else o for o, w in pairs]
    return unflatten(fixed, spec)


def check_onnx(case: CheckCase) -> None:
    on, pick = flat_program(case)
    if any(not isinstance(o, torch.Tensor) for o in flatten(case.want)[0]):
        raise Skip("an ONNX graph returns tensors only; the program returns a Python number")
    session = _onnx_session(ProgramModule(on, case.fn), pick(case.args), "onnx")
    if session is None:
        raise Skip("onnxruntime and onnxscript are not installed")
    for args, want in inputs_and_wants(case):
        with running("onnx"):
            got = _onnx_run(session, pick(args))
        _, spec = flatten(want)
        compare(case, "onnx", unflatten(got, spec), want)


def _onnx_session(module: torch.nn.Module, args: list[torch.Tensor], transform: str) -> Any:
    """``torch.onnx.export(dynamo=True)`` of ``module``, loaded in onnxruntime; None when
    onnxruntime or onnxscript is not installed."""
    try:  # optional: imported by name, so that hop's type check needs neither
        ort = importlib.import_module("onnxruntime")
        importlib.import_module("onnxscript")  # torch.onnx.export(dynamo=True) needs it
    except ImportError:
        return None
    with running(transform), warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the exporter's own notes
        try:
            program = torch.onnx.export(module, tuple(args), dynamo=True, verbose=False)
        except Exception as e:
            _exporter_limits(e)
            raise
        assert program is not None
        return ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])


# onnxscript's optimizer, which torch.onnx.export runs, crashes on a matrix product of
# a 0-dim value reshaped to a matrix (``t.reshape(1, -1) @ t.reshape(-1, 1)``), in a
# plain program too: the rewrite rule indexes the last dim of a 0-dim shape.
_OPTIMIZER_BUGS = {"_broadcast_to_matmul.py": "onnxscript's optimizer: a matmul of a 0-dim value reshaped"}
# onnxscript has no translation of some aten ops (``amax`` over every dim): the node
# the exporter names is torch's op, not hop's (hop's own are torch.ops.hop.*)
_UNTRANSLATED = re.compile(r"Error when translating node %\S+ : .*target=torch\.ops\.(aten\.\w+\.\w+)")


def _exporter_limits(error: BaseException) -> None:
    """Skip when ``error`` (or what it was raised from) is a limit of the exporter that
    a plain program meets too, not one of the program."""
    seen: BaseException | None = error
    while seen is not None:
        frames = traceback.extract_tb(seen.__traceback__)
        for file, why in _OPTIMIZER_BUGS.items():
            if frames and Path(frames[-1].filename).name == file:
                raise Skip(f"{why} (a plain program too)") from None
        untranslated = _UNTRANSLATED.search(str(seen))
        if untranslated:
            raise Skip(f"onnxscript cannot translate {untranslated.group(1)} here (a plain program neither)") from None
        seen = seen.__cause__ or seen.__context__


def _onnx_run(session: Any, args: list[torch.Tensor]) -> list[torch.Tensor]:
    names = [i.name for i in session.get_inputs()]
    feeds = [x.detach().contiguous().numpy() for x in args]
    return [torch.from_numpy(g) for g in session.run(None, dict(zip(names, feeds, strict=True)))]
