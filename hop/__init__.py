"""hop: higher-order operators for PyTorch, routed by hop's own dispatcher.

Public API only; docs/ is the user guide (docs/index.md) and the framework guide (docs/writing_a_hop.md).
"""

import importlib
from typing import Any

from hop import config, debug, errors, subgraph
from hop._operator import HigherOrderOperator, registered_ops
from hop.compile import dynamo as _dynamo  # noqa: F401  (Dynamo handlers, registered when torch loads Dynamo)
from hop.compile import inductor as _inductor  # noqa: F401  (Inductor lowerings, registered when torch loads Inductor)
from hop.compile import onnx as _onnx  # noqa: F401  (ONNX translations, registered when torch loads its exporter)
from hop.errors import HopError
from hop.ops.branching.cond import cond
from hop.ops.branching.switch import switch
from hop.ops.scanning.associative_scan import associative_scan
from hop.ops.scanning.map import map
from hop.ops.scanning.scan import scan
from hop.ops.while_loops.bounded_while import bounded_while
from hop.ops.while_loops.fori_loop import fori_loop
from hop.ops.while_loops.while_loop import while_loop

__all__ = [
    "HigherOrderOperator",
    "associative_scan",
    "bounded_while",
    "cond",
    "config",
    "fori_loop",
    "map",
    "scan",
    "switch",
    "while_loop",
    "HopError",
    "debug",
    "deploy",
    "errors",
    "registered_ops",
    "passes",
    "subgraph",
    "testing",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``hop.testing``, ``hop.passes`` and ``hop.deploy`` are imported on first use (for
    tests, optimizing traced programs and deploying them, not for running programs)."""
    if name in ("testing", "passes", "deploy"):
        return importlib.import_module(f"hop.{name}")
    raise AttributeError(f"module 'hop' has no attribute {name!r}")
