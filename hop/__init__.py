"""hop: higher-order operators for PyTorch, routed by hop's own dispatcher.

Public API only; see DESIGN.md and docs/ for the contract.
"""

from hop import _subgraph as subgraph
from hop import debug, errors
from hop._operator import HigherOrderOperator, registered_ops
from hop.errors import HopError

__all__ = [
    "HigherOrderOperator",
    "HopError",
    "debug",
    "errors",
    "registered_ops",
    "subgraph",
]

__version__ = "0.1.0"
