"""optimize: every pass of hop.passes, repeated until the program stops changing."""

from __future__ import annotations

import torch.fx

from hop.errors import HopValueError, format_message
from hop.passes import _program
from hop.passes._program import Program
from hop.passes.fold_constant_selectors import fold_constant_selectors
from hop.passes.hoist_common_branch_prefix import hoist_common_branch_prefix
from hop.passes.hoist_loop_invariants import hoist_loop_invariants
from hop.passes.remove_dead_outputs import remove_dead_outputs
from hop.passes.unroll_trivial_loops import unroll_trivial_loops

# Unrolling and folding first: they remove whole operators, and what they inline can
# be hoisted out of an enclosing loop or branch by the passes after them.
PASSES = (
    unroll_trivial_loops,
    fold_constant_selectors,
    hoist_common_branch_prefix,
    hoist_loop_invariants,
    remove_dead_outputs,
)


def optimize(program: Program, *, max_rounds: int = 10) -> Program:
    """``program`` simplified by :data:`PASSES` run in turn until a round changes nothing
    (one pass can enable another: a folded selector leaves outputs dead, an unrolled loop
    leaves a constant selector), or ``max_rounds``."""
    _program.check_program(program)
    if type(max_rounds) is not int or max_rounds < 1:
        raise HopValueError(
            format_message("passes.optimize", f"max_rounds must be a positive int, got {max_rounds!r}"),
            op="passes.optimize",
        )
    for _ in range(max_rounds):
        before = _signature(program)
        for graph_pass in PASSES:
            program = graph_pass(program)
        if _signature(program) == before:
            break
    return program


def _signature(program: Program) -> str:
    # The code of every graph, nested ones included: equal code is an unchanged program.
    gm = program if isinstance(program, torch.fx.GraphModule) else program.graph_module
    return "\n".join(m.code for m in gm.modules() if isinstance(m, torch.fx.GraphModule))
