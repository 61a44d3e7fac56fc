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

Note [constant outputs of subgraphs]
torch's exporter translates each subgraph into an ONNX function whose outputs must
be values; a branch that returns a Python int (``lambda a: (a * 2, 3)``) leaves the
int itself in the subgraph's output node, which the exporter cannot translate. It
represents a program's ints as 0-dim INT64 tensors, so hop makes each such output a
0-dim INT64 constant, in the
decomposed copy of the program the exporter translates (after its own preparation:
the program the user passed is left alone). A cond whose branches return 3 and 4 then
gives the If an INT64 output that the rest of the graph reads as the int it is.

:func:`translations` returns them, for a registry a user builds by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.fx

from hop._operator import HigherOrderOperator
from hop.compile._hooks import on_import

__all__ = ["constant_outputs_as_tensors", "translations"]

# The first opset with every form the translations write (Squeeze and Slice taking axes as
# inputs; If, Loop, Gather are older). torch's exporter translates at 18, then converts.
OPSET_INTRODUCED = 13
_TORCH_TRANSLATIONS = "torch.onnx._internal.exporter._torchlib.ops"
_TORCH_CORE = "torch.onnx._internal.exporter._core"


def translations() -> dict[Any, Callable[..., Any]]:
    """hop's operators and their ONNX translations, as ``custom_translation_table`` takes them."""
    from hop.compile._onnx_ops import TRANSLATIONS

    return dict(TRANSLATIONS)


def _register(ops: ModuleType) -> None:
    """Runs once torch has imported its own translations."""
    from torch.onnx._internal.exporter._torchlib._torchlib_registry import onnx_impl

    for op, translation in translations().items():
        onnx_impl(op, no_compile=True, opset_introduced=OPSET_INTRODUCED)(translation)


def constant_outputs_as_tensors(gm: torch.fx.GraphModule) -> int:
    """Make each Python int a hop operator's subgraph returns a 0-dim int64 tensor, in
    ``gm`` and the subgraphs below it (Note [constant outputs of subgraphs]); the count."""
    changed = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, HigherOrderOperator):
            continue
        for arg in node.args:
            if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
                sub = getattr(gm, str(arg.target))
                if isinstance(sub, torch.fx.GraphModule):
                    changed += _tensor_outputs(sub) + constant_outputs_as_tensors(sub)
    return changed


def _tensor_outputs(sub: torch.fx.GraphModule) -> int:
    out = next(n for n in sub.graph.nodes if n.op == "output")
    changed = 0

    def as_tensor(a: Any) -> Any:
        nonlocal changed
        if type(a) is not int:  # branches return tensors and ints (hop.cond's contract)
            return a
        with sub.graph.inserting_before(out):
            node = sub.graph.call_function(torch.ops.aten.full.default, ([], a), {"dtype": torch.int64})
        node.meta["val"] = torch.full([], a, dtype=torch.int64)  # the exporter reads shape, dtype
        changed += 1
        return node

    out.args = (torch.fx.node.map_aggregate(out.args[0], as_tensor),)
    if changed:
        sub.recompile()
    return changed


def _prepare(core: ModuleType) -> None:
    """Runs once torch's exporter core is imported: its preparation of a program then
    also runs :func:`constant_outputs_as_tensors`."""
    name = "_prepare_exported_program_for_export"
    prepare = getattr(core, name, None)
    if prepare is None:  # another torch: the refusal of the exporter stands (tests/compile/test_onnx.py)
        return

    def prepare_for_onnx(*args: Any, **kwargs: Any) -> torch.export.ExportedProgram:
        program: torch.export.ExportedProgram = prepare(*args, **kwargs)
        constant_outputs_as_tensors(program.graph_module)
        return program

    setattr(core, name, prepare_for_onnx)


on_import(_TORCH_TRANSLATIONS, _register)
on_import(_TORCH_CORE, _prepare)
