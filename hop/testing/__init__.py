"""hop.testing: property-based testing of control-flow programs and of HOPs.

- :func:`reference`: a context in which every hop operator runs as its plain
  Python meaning (the oracle);
- :func:`check`: a program against that oracle under eager, autograd,
  gradcheck, jvp, vmap, fake tensors, make_fx and torch.export, and, opt-in
  (``COMPILED``), torch.compile with aot_eager and Inductor, strict export, the
  vmapped program exported, AOTInductor in a fresh process and ONNX in
  onnxruntime, returning a :class:`Report` and raising :class:`CheckFailure` on
  the first mismatch; :func:`bundle` makes many programs one, to compile once;
- :mod:`hop.testing.programs`: random control-flow programs as data that print
  as Python source;
- :mod:`hop.testing.strategies`: hypothesis strategies for tensors and programs
  (imported on first use: hypothesis is needed only there).
"""

from __future__ import annotations

import importlib
from typing import Any

from hop.testing._case import COMPILED, TRANSFORMS, CheckFailure, reference
from hop.testing._check import Report, bundle, check

__all__ = ["COMPILED", "TRANSFORMS", "CheckFailure", "Report", "bundle", "check", "programs", "reference", "strategies"]


def __getattr__(name: str) -> Any:
    if name in ("strategies", "programs"):
        return importlib.import_module(f"hop.testing.{name}")
    raise AttributeError(f"module 'hop.testing' has no attribute {name!r}")
