"""Graph passes over programs that hold hop operators.

Each pass is a pure function: it takes an ``fx.GraphModule`` or a
``torch.export.ExportedProgram`` and returns a new one of the same kind, leaving
its argument untouched, with the same results on every input. ``hop.ops`` never
imports this package.
"""

from hop.passes.fold_constant_selectors import fold_constant_selectors
from hop.passes.hoist_common_branch_prefix import hoist_common_branch_prefix
from hop.passes.hoist_loop_invariants import hoist_loop_invariants
from hop.passes.optimize import PASSES, optimize
from hop.passes.remove_dead_outputs import remove_dead_outputs
from hop.passes.unroll_trivial_loops import unroll_trivial_loops

__all__ = [
    "PASSES",
    "fold_constant_selectors",
    "hoist_common_branch_prefix",
    "hoist_loop_invariants",
    "optimize",
    "remove_dead_outputs",
    "unroll_trivial_loops",
]
