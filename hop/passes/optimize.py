"""optimize: every pass of hop.passes, repeated until the program stops changing."""

from __future__ import annotations

import torch.fx

from hop.passes._program import Program
from hop.passes.fold_constant_selectors import fold_constant_selectors
from hop.passes.remove_dead_outputs import remove_dead_outputs

PASSES = (fold_constant_selectors, remove_dead_outputs)


def optimize(program: Program, *, max_rounds: int = 10) -> Program:
    """``program`` simplified by :data:`PASSES` run in turn until a round changes nothing
    (one pass can enable another: a folded selector leaves outputs dead), or ``max_rounds``."""
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
