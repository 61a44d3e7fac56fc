"""hop: higher-order operators for PyTorch, routed by hop's own dispatcher.

Public API only; see DESIGN.md and docs/ for the contract.
"""

from hop import _subgraph as subgraph
from hop import config, debug, errors
from hop._operator import HigherOrderOperator, registered_ops
from hop.errors import HopError
from hop.ops.cond import cond
from hop.ops.switch import switch

__all__ = [
    "HigherOrderOperator",
    "cond",
    "config",
    "switch",
    "HopError",
    "debug",
    "errors",
    "registered_ops",
    "subgraph",
]

__version__ = "0.1.0"
