"""hop's operators inside ``torch.compile`` and ``torch.export(strict=True)`` (Dynamo).

Dynamo turns a call of a ``HigherOrderOperator`` into a graph node through a
handler (a ``VariableTracker``) that it looks up by the operator's ``__name__``
in ``torch._dynamo.variables.higher_order_ops._hop_name_to_variable_class``.
hop's ops share names with torch's (``cond``, ``while_loop``, ``scan``, ...), and
some of torch's handlers write the hard-coded ``torch.ops.higher_order.<name>``
into the graph. So every entry of that table becomes one that dispatches on the
operator *object*: hop's ops get hop's handlers (``_dynamo_branching``,
``_dynamo_while``, ``_dynamo_scans`` beside this module), torch's keep torch's, and
any other hop operator (a user's; every name a hop operator has gets an entry)
makes Dynamo break the graph, the call then running eagerly through hop's dispatcher.

A handler traces every callable with Dynamo's ``speculate_subgraph`` (what it closes
over, module parameters and buffers, other tensors, sizes, becomes extra inputs),
checks the call with hop's own eager checks run on the example values (a mistake
gives eager's message), and emits a ``torch.ops.hop.<name>`` node in the raw op's
argument layout, whose output metadata is hop's fake rule's (unified unbacked
sizes, growing carries, cloned aliases). ``aot_eager``, Inductor and
``torch.export`` then retrace the node as they do one made by make_fx.

The public functions (``hop.cond``, ...) check arguments, flatten pytrees and move
dimensions in Python that Dynamo would trace piece by piece, and their eager fast
paths read real tensor values. Under Dynamo they skip all that: their
``is_dynamo_compiling()`` line passes their own arguments to the raw op behind the
marker ``hop._transforms.DYNAMO_CALL``, and the raw op's handler does the
function's work at trace time, on variables (Note [public functions under Dynamo]).
That line serves when Dynamo compiles a public function's own frame
(``torch.compile(hop.cond)``, or the frame Dynamo meets after a graph break at its
call), and its fallback, the raw op run eagerly with the marker, runs the public
function itself. Where Dynamo inlines a call of a public function, it does not trace
the body down to that line: ``_dynamo_public`` makes the same raw op call straight
away, so that the compiled code's guards do not check what the body reads (Note
[public functions, inlined]).

What the compiled path cannot capture (a function writing its inputs in place,
``while_loop(checkpoint=True)``, an operator with no handler) raises
:class:`hop.errors.CompileUnsupported` under ``fullgraph=True``; without it Dynamo
breaks the graph with that message as the reason and the call runs eagerly, with
Dynamo off for everything under the raw op's ``__call__``. A user mistake raises
the HopError eager raises (a graph break without fullgraph, so that eager raises it).

Registration waits until torch imports ``torch._dynamo`` (``import hop`` does not).
Private torch API used here and in the handler modules (each listed, with the releases it was checked on, in
:mod:`hop.compile._torch_api`):
``_hop_name_to_variable_class``, ``TorchHigherOrderOperatorVariable``,
``BaseHOPVariable``, ``speculate_subgraph``, ``discard_graph_changes``,
``make_attr``, ``_make_inlined``, ``wrap_fx_proxy``, ``SourcelessBuilder``,
``LazyVariableTracker``, ``get_fake_value``, ``torch._dynamo.exc.Unsupported``,
``OutputGraph.install_subgraph``, ``SubgraphTracer.create_graph_input`` and
``bound_symbols``, ``set_code_exec_strategy`` / ``FrameExecStrategy``,
``VariableBuilder._id_dispatch``, ``UserFunctionVariable``, ``install_guard``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from hop import _validation
from hop._operator import _REGISTRY, HigherOrderOperator
from hop.compile._hooks import on_import
from hop.ops.branching.switch import SwitchOp

__all__: list[str] = []

_installed = False


def _install(dynamo: ModuleType) -> None:
    """Runs once torch has imported ``torch._dynamo`` (hooking its submodule
    ``variables.higher_order_ops`` instead would run in the middle of Dynamo's own
    imports, before the handlers' base classes can be imported)."""
    global _installed
    if _installed:
        return
    _installed = True
    from torch._dynamo.variables import higher_order_ops

    # they import torch._dynamo, which import hop must not: loaded once Dynamo is
    from hop.compile import _dynamo_branching, _dynamo_public, _dynamo_scans, _dynamo_while

    handlers = {**_dynamo_branching.HANDLERS, **_dynamo_while.HANDLERS, **_dynamo_scans.HANDLERS}
    table: dict[str, Any] = higher_order_ops._hop_name_to_variable_class
    for name in {*table, *(op.name() for op in handlers)}:
        table[name] = _Entry(table.get(name), handlers)
    higher_order_ops._hop_name_to_variable_class = _Table(table, handlers)
    _run_ops_outside_dynamo()
    _dynamo_public.install()  # Note [public functions, inlined]
    _torch_control_flow_is_not_fakeable()


def _torch_control_flow_is_not_fakeable() -> None:
    """torch's own cond / while_loop / scan / map run eagerly by compiling themselves with
    Dynamo, which cannot trace hop's validation (a fake run under a torch-function mode)
    and raises ``UncapturedHigherOrderOpError``. A callable that calls them is then
    checked by its first real call, as one that cannot run on fake tensors."""
    from torch._dynamo.exc import UncapturedHigherOrderOpError

    if UncapturedHigherOrderOpError not in _validation.CANNOT_FAKE:
        _validation.CANNOT_FAKE = (*_validation.CANNOT_FAKE, UncapturedHigherOrderOpError)


def _run_ops_outside_dynamo() -> None:
    """Code Dynamo never compiles as a frame of its own, nor anything it calls: a raw
    op's ``__call__`` (it runs eagerly while Dynamo is active after a graph break at its
    call). hop's dispatcher, rules and eager paths then run as plain Python, instead of
    being compiled piece by piece.

    A public function's own frame may be compiled (``torch.compile(hop.cond)``; or the
    frame Dynamo meets after a graph break at its call): its ``is_dynamo_compiling()``
    line makes that one graph of the raw op. What such a frame calls while running
    eagerly is never compiled (the eager paths, when a capture fell back). Where Dynamo
    inlines a call of a public function, it calls the raw op without tracing the body
    (Note [public functions, inlined])."""
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

    from hop.compile._dynamo_public import public_functions  # imports torch._dynamo (loaded by now)

    calls = (HigherOrderOperator.__call__, HigherOrderOperator.dispatch, SwitchOp.__call__)
    for call in calls:
        set_code_exec_strategy(call.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
    for fn, _ in public_functions():
        set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.DEFAULT, _FrameAction.SKIP))


class _Entry:
    """One entry of Dynamo's name -> handler table: hop's op -> hop's handler, a user's op
    -> its decomposition inlined (a graph break if it has none), any other op -> the
    entry torch had."""

    def __init__(self, torch_handler: Any, handlers: dict[Any, Any]) -> None:
        self.torch_handler = torch_handler
        self.handlers = handlers

    def __call__(self, value: Any, source: Any = None, **kwargs: Any) -> Any:
        from hop.compile._dynamo_capture import DecomposedVariable, UnhandledVariable  # imports torch._dynamo

        handler = self.handlers.get(value)
        if handler is None and isinstance(value, HigherOrderOperator):
            handler = UnhandledVariable if value._hop_decomposition is None else DecomposedVariable
        if handler is None:
            handler = self.torch_handler or _torch_default
        return handler(value, source, **kwargs)


def _torch_default(value: Any, source: Any = None, **kwargs: Any) -> Any:
    """What Dynamo does for a HOP of a name it has no entry for (torch's op, named like a
    user's hop op)."""
    from torch._dynamo.exc import unimplemented
    from torch._dynamo.variables.higher_order_ops import BaseHOPVariable
    from torch._higher_order_ops import BaseHOP

    if isinstance(value, BaseHOP):
        return BaseHOPVariable(value, source, **kwargs)
    unimplemented(
        gb_type="unsupported HigherOrderOperator",
        context=str(value),
        explanation=f"Unable to create higher order operator variable for {value.__name__}.",
        hints=[],
    )


class _Table(dict[str, Any]):
    """Dynamo's name -> handler table, with an entry for every name one of hop's
    operators has, also those a user creates later."""

    def __init__(self, table: dict[str, Any], handlers: dict[Any, Any]) -> None:
        super().__init__(table)
        self.handlers = handlers

    def get(self, name: str, default: Any = None) -> Any:

        entry = super().get(name)
        if entry is None and name in _REGISTRY:
            return _Entry(None, self.handlers)
        return default if entry is None else entry


on_import("torch._dynamo", _install)
