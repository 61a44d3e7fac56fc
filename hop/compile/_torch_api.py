"""What hop's compiler bridge needs of torch's private API, and what differs between torch versions.

The bridge (:mod:`hop.compile`, :mod:`hop.passes.inductor` and :mod:`hop.deploy`) talks to Dynamo,
AOTAutograd, Inductor and the ONNX exporter through names torch does not promise to keep. This module
is the one list of them: :data:`PRIVATE` names every private symbol the bridge
imports or reads (a test resolves each on the installed torch, and another checks
that every ``from torch._... import`` of the bridge is listed), and the functions
below are the one place where the bridge's code depends on the torch version.

Supported torch releases: :data:`CHECKED_ON`. Between them, nothing hop uses moved or
was renamed; what changed is behaviour behind the same names (:data:`CHANGES`), which
only running the tests on each version shows.

Importing this module imports neither Dynamo nor Inductor: the symbols are strings,
resolved on demand.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import torch

__all__ = [
    "CHANGES",
    "CHECKED_ON",
    "PRIVATE",
    "VERSION",
    "Change",
    "Private",
    "at_least",
    "fake_propagation_errors",
    "ordering_deps",
    "resolve",
]

CHECKED_ON = ("2.13.0", "2.14.1", "2.15.0")
"""The torch releases the test suite passes on (``pyproject.toml`` admits ``>=2.13,<2.16``)."""


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


VERSION = _release(torch.__version__)
"""The installed torch's (major, minor)."""


def at_least(major: int, minor: int) -> bool:
    return (major, minor) <= VERSION


@dataclasses.dataclass(frozen=True)
class Private:
    """A private torch symbol the bridge uses: ``path`` is a module followed by attributes.
    Instance attributes (``SubgraphTracer.bound_symbols``, ``TracingContext.fw_metadata``,
    ``V.graph.current_node``) have no class-level name to check: the tests that compile
    through them are their check."""

    path: str
    used_by: str
    since: tuple[int, int] = (2, 13)  # the first release that has it


@dataclasses.dataclass(frozen=True)
class Change:
    """A behaviour that differs between supported releases, and where hop handles it."""

    since: tuple[int, int]
    what: str
    handled_by: str


def _listed(used_by: str, *paths: str, since: tuple[int, int] = (2, 13)) -> list[Private]:
    return [Private(p, used_by, since) for p in paths]


_DYNAMO_VARIABLES = "torch._dynamo.variables"
PRIVATE: tuple[Private, ...] = (
    *_listed(
        "hop.compile.dynamo",
        "torch._C._dynamo.eval_frame._FrameAction",
        "torch._C._dynamo.eval_frame._FrameExecStrategy",
        "torch._C._dynamo.eval_frame.set_code_exec_strategy",
        "torch._dynamo.exc.unimplemented",
        "torch._dynamo.exc.UncapturedHigherOrderOpError",
        f"{_DYNAMO_VARIABLES}.higher_order_ops",
        f"{_DYNAMO_VARIABLES}.higher_order_ops._hop_name_to_variable_class",
        f"{_DYNAMO_VARIABLES}.higher_order_ops.BaseHOPVariable",
        "torch._higher_order_ops.BaseHOP",
    ),
    *_listed(
        "hop.compile._dynamo_public",
        "torch._dynamo.guards.GuardBuilder.CLOSURE_MATCH",
        "torch._dynamo.guards.GuardBuilder.EQUALS_MATCH",
        "torch._dynamo.guards.install_guard",
        "torch._dynamo.source.AttrSource",
        "torch._dynamo.symbolic_convert.InstructionTranslatorBase.import_source",
        f"{_DYNAMO_VARIABLES}.builder.VariableBuilder._id_dispatch",
        f"{_DYNAMO_VARIABLES}.builder.VariableBuilder.install_guards",
        f"{_DYNAMO_VARIABLES}.functions.UserFunctionVariable",
    ),
    *_listed(
        "hop.compile._dynamo_capture, _dynamo_values, _dynamo_errors and the handler modules",
        "torch._dynamo.exc.TorchRuntimeError",
        "torch._dynamo.exc.Unsupported",
        "torch._dynamo.utils._make_inlined",
        "torch._dynamo.utils.get_fake_value",
        f"{_DYNAMO_VARIABLES}.ConstantVariable",
        f"{_DYNAMO_VARIABLES}.ListVariable",
        f"{_DYNAMO_VARIABLES}.TupleVariable",
        f"{_DYNAMO_VARIABLES}.VariableTracker",
        f"{_DYNAMO_VARIABLES}.builder.SourcelessBuilder",
        f"{_DYNAMO_VARIABLES}.builder.wrap_fx_proxy",
        f"{_DYNAMO_VARIABLES}.builtin.BuiltinVariable",
        f"{_DYNAMO_VARIABLES}.higher_order_ops.TorchHigherOrderOperatorVariable",
        f"{_DYNAMO_VARIABLES}.higher_order_ops.discard_graph_changes",
        f"{_DYNAMO_VARIABLES}.higher_order_ops.make_attr",
        f"{_DYNAMO_VARIABLES}.higher_order_ops.speculate_subgraph",
        f"{_DYNAMO_VARIABLES}.lazy.LazyVariableTracker",
        f"{_DYNAMO_VARIABLES}.lazy.LazyVariableTracker.is_realized",
        f"{_DYNAMO_VARIABLES}.lists.BaseListVariable",
        f"{_DYNAMO_VARIABLES}.tensor.SymNodeVariable",
        "torch._dynamo.output_graph.OutputGraph.install_subgraph",
        "torch._dynamo.output_graph.SubgraphTracer.create_graph_input",
        "torch.fx.experimental.symbolic_shapes._constrain_range_for_size",
        "torch.fx.experimental.symbolic_shapes.free_unbacked_symbols",
        "torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode",
    ),
    *_listed(
        "hop.compile._functorch_levels (the transform calls Dynamo records)",
        *(
            f"torch._C._functorch.{name}"
            for name in (
                "_grad_increment_nesting",
                "_grad_decrement_nesting",
                "_vmap_increment_nesting",
                "_vmap_decrement_nesting",
                "_jvp_increment_nesting",
                "_jvp_decrement_nesting",
                "_wrap_for_grad",
                "_unwrap_for_grad",
                "_add_batch_dim",
                "_remove_batch_dim",
                "maybe_current_level",
            )
        ),
        *(
            f"torch._functorch.predispatch.{name}"
            for name in (
                "_vmap_increment_nesting",
                "_vmap_decrement_nesting",
                "_jvp_increment_nesting",
                "_jvp_decrement_nesting",
                "_unwrap_for_grad",
                "_add_batch_dim",
                "_remove_batch_dim",
            )
        ),
    ),
    *_listed(
        "hop.compile._dynamo_errors (fake propagation errors, see fake_propagation_errors)",
        "torch._dynamo.exc.FakeTensorObservedException",
        since=(2, 14),
    ),
    *_listed(
        "hop.compile.inductor and hop.compile._inductor_rewrites",
        "torch._inductor.lowering.lowerings",
        "torch._inductor.lowering.register_lowering",
        "torch._inductor.lowering.clone",
        "torch._inductor.config.post_grad_custom_pre_pass",
        "torch._inductor.config.use_post_grad_passes",
        "torch._inductor.config._config",
        "torch._inductor.custom_graph_pass.CustomGraphPass",
        "torch._inductor.custom_graph_pass.get_hash_for_files",
        "torch._inductor.pattern_matcher.CallFunctionVarArgs",
        "torch._inductor.pattern_matcher.Match.replace_by_example",
        "torch._inductor.virtualized.V",
        "torch._inductor.ir.Subgraph",
        "torch._inductor.ir.IRNode",
        "torch._inductor.ir.ExternKernel.require_exact_strides",
        "torch._inductor.ir.DynamicScalar",
        "torch._guards.TracingContext.try_get",
        "torch._dispatch.python.enable_python_dispatcher",
        "torch._prims_common.make_contiguous_strides_for",
        "torch._subclasses.fake_tensor.FakeTensor",
        "torch.fx.experimental.proxy_tensor.make_fx",
        "torch.fx.experimental.proxy_tensor.disable_proxy_modes_tracing",
        "torch.fx.experimental.symbolic_shapes.statically_known_true",
        "torch.fx.experimental.symbolic_shapes.sym_eq",
        "torch.utils._sympy.interp.sympy_interp",
        "torch.utils._sympy.reference.PythonReferenceAnalysis",
        "torch.ops.higher_order.cond",
        "torch.ops.higher_order.while_loop",
        "torch._higher_order_ops.utils.check_input_alias_and_mutation",
    ),
    *_listed(
        "hop.compile._aoti_refusals (wraps the AOTInductor entry points)",
        "torch._inductor.aoti_compile_and_package",
        "torch._inductor.aot_compile",
        "torch._inductor.exc.InductorError",
    ),
    # The module itself: translations read its current_tracer, the recorder of the node
    # being translated (None between exports; the export tests are its check).
    *_listed(
        "hop.compile.onnx and hop.compile._onnx_ops",
        "torch.onnx._internal.exporter._torchlib.ops",
        "torch.onnx._internal.exporter._torchlib._torchlib_registry.onnx_impl",
        "torch.onnx._internal.exporter._core",
    ),
    *_listed(
        "hop.deploy._executorch and _executorch_ops (the translations for ExecuTorch)",
        "torch._higher_order_ops.scan.scan",
        "torch.fx.experimental.symbolic_shapes.guard_int",
        "torch.fx.experimental.symbolic_shapes.statically_known_true",
        "torch.utils._pytree.tree_leaves",
        "torch.utils._pytree.tree_unflatten",
    ),
)

CHANGES: tuple[Change, ...] = (
    Change(
        (2, 14),
        "Inductor's lowering of torch.ops.higher_order.cond builds ir.Switch, which reads each branch "
        "subgraph's output as a sequence (2.13's ir.Conditional also took one bare output).",
        "hop.compile.inductor._lower_cond: a single-output cond's branch subgraphs return a 1-tuple",
    ),
    Change(
        (2, 14),
        "Dynamo's get_fake_value raises FakeTensorObservedException (from None) for an error in a fake "
        "kernel, where 2.13 raised TorchRuntimeError.",
        "fake_propagation_errors(): hop finds its own HopError inside either",
    ),
    Change(
        (2, 15),
        "Inductor's GraphLowering.additional_star_deps (op name -> names it must follow, a StarDep) is "
        "renamed additional_buffer_deps (a fake WeakDep: ordering only).",
        "ordering_deps(): hop.compile._inductor_subgraphs.reads_first orders a subgraph's .item() reads first",
    ),
    Change(
        (2, 14),
        "make_fx with fake or symbolic tracing traces w[i] on an unbacked int i (with _assert_scalar "
        "bounds checks); 2.13 raised a data-dependent guard error.",
        "nothing to handle: hop's traced loops give the right value on both",
    ),
    Change(
        (2, 15),
        "Inductor's WhileLoop.create takes the output of a carry the body writes in place as that carry's "
        "input; before, it paired the body's writes, in the order the body makes them, with the carries "
        "in index order (a scan writing a buffer it closes over, then its stacked outputs, swapped them).",
        "hop.compile._inductor_subgraphs.writes_in_carry_order: the writes are reported in carry order",
    ),
)


def resolve(path: str) -> Any:
    """The object a dotted ``path`` names: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def ordering_deps(graph: Any) -> Any:
    """An Inductor graph's map from an operation's name to the names it must be scheduled
    after: ``additional_star_deps`` up to 2.14, ``additional_buffer_deps`` from 2.15
    (see :data:`CHANGES`)."""
    deps = getattr(graph, "additional_star_deps", None)
    return deps if deps is not None else graph.additional_buffer_deps


def fake_propagation_errors() -> tuple[type[BaseException], ...]:
    """What Dynamo raises when a node's fake propagation fails (hop's fake rules raise
    HopErrors there): ``TorchRuntimeError`` on 2.13, ``FakeTensorObservedException``
    from 2.14 (see :data:`CHANGES`). Imports Dynamo: call it only from the bridge."""
    from torch._dynamo import exc

    errors: tuple[type[BaseException], ...] = (exc.TorchRuntimeError,)
    observed = getattr(exc, "FakeTensorObservedException", None)
    if observed is not None:
        errors = (*errors, observed)
    return errors
