"""Graph passes over programs that hold hop operators.

Each pass is a pure function: it takes an ``fx.GraphModule`` or a
``torch.export.ExportedProgram`` and returns a new one of the same kind, leaving
its argument untouched, with the same results on every input. ``hop.ops`` never
imports this package.
"""

from hop.passes.fold_constant_selectors import fold_constant_selectors
from hop.passes.optimize import optimize
from hop.passes.remove_dead_outputs import remove_dead_outputs

__all__ = ["fold_constant_selectors", "optimize", "remove_dead_outputs"]
