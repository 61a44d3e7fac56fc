"""hop's operators in torch's ONNX exporter: ``torch.onnx.export(..., dynamo=True)``.

After ``import hop`` every ``torch.ops.hop.*`` node exports, from a module or from an
``ExportedProgram``, with nothing to register: ``cond`` as ``If``, ``switch`` as a
chain of ``If``, ``while_loop`` / ``fori_loop`` as ``Loop``, ``scan`` / ``map`` as
``Loop`` and ``associative_scan`` as a parallel-prefix ``Loop`` (pointwise) or a sequential one (the translations are in
:mod:`hop.compile._onnx_ops`; docs/deploy.md has the table and the limits).

Registration is lazy, as for Dynamo and Inductor: ``import hop`` imports neither
``torch.onnx``'s exporter nor onnxscript. When the exporter first builds its
registry of translations it imports ``torch.onnx._internal.exporter._torchlib.ops``
(torch's own translations); right after that module has run, :func:`_register`
adds hop's to the same registry (``_torchlib_registry.onnx_impl``), which every
``ONNXRegistry.from_torchlib()`` reads. A translation a user passes in
``custom_translation_table`` still takes precedence over hop's.

What hop changes in the copy of a program the exporter translates (its ints and its
float64 constants) is in :mod:`hop.compile._onnx_prepare`.

:func:`translations` returns them, for a registry a user builds by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.fx

from hop._decomposed import inlined
from hop.compile._hooks import on_import
from hop.compile._onnx_prepare import constant_outputs_as_tensors, exact_float64_constants

__all__ = ["constant_outputs_as_tensors", "translations"]

# The first opset with every form the translations write (Squeeze and Slice taking axes as
# inputs; If, Loop, Gather are older). torch's exporter translates at 18, then converts.
OPSET_INTRODUCED = 13
_TORCH_TRANSLATIONS = "torch.onnx._internal.exporter._torchlib.ops"
_TORCH_CORE = "torch.onnx._internal.exporter._core"


def translations() -> dict[Any, Callable[..., Any]]:
    """hop's operators and their ONNX translations, as ``custom_translation_table`` takes them."""
    from hop.compile._onnx_ops import TRANSLATIONS  # imports onnx_ir, which import hop must not

    return dict(TRANSLATIONS)


def _register(ops: ModuleType) -> None:
    """Runs once torch has imported its own translations."""
    from torch.onnx._internal.exporter._torchlib._torchlib_registry import onnx_impl

    for op, translation in translations().items():
        onnx_impl(op, no_compile=True, opset_introduced=OPSET_INTRODUCED)(translation)


def _prepare(core: ModuleType) -> None:
    """Runs once torch's exporter core is imported: its preparation of a program then
    also runs :func:`constant_outputs_as_tensors` and keeps float64 constants exact
    (Note [float64 constants in ONNX subgraphs])."""
    name = "_prepare_exported_program_for_export"
    prepare = getattr(core, name, None)
    if prepare is None:  # another torch: the refusal of the exporter stands (tests/compile/test_onnx.py)
        return

    def prepare_for_onnx(*args: Any, **kwargs: Any) -> torch.export.ExportedProgram:
        with inlined():  # users' operators: their decompositions (Note [an operator from its decomposition])
            program: torch.export.ExportedProgram = prepare(*args, **kwargs)
        constant_outputs_as_tensors(program.graph_module)
        exact_float64_constants(program.graph_module)
        return program

    setattr(core, name, prepare_for_onnx)


on_import(_TORCH_TRANSLATIONS, _register)
on_import(_TORCH_CORE, _prepare)
