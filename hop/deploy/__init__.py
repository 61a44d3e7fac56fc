"""Deployment of hop's programs beyond torch's own runtimes.

- :func:`for_executorch`: an exported program whose control flow is torch's ``cond``
  and ``scan``, for ExecuTorch's ``to_edge`` / ``to_executorch`` (docs/deploy.md).

AOTInductor and ONNX take hop's programs as they are (``hop.compile``).
"""

from __future__ import annotations

from torch.export import ExportedProgram

from hop.deploy import _executorch

__all__ = ["for_executorch"]


def for_executorch(ep: ExportedProgram, *, max_steps: int | None = None) -> ExportedProgram:
    """``ep`` with hop's operators written as torch's ``cond`` and ``scan``: the same
    signature and values, ready for ``executorch.exir.to_edge_transform_and_lower(...)
    .to_executorch()``.

    What each operator becomes: ``cond`` a ``cond``; ``switch`` nested ``cond``s;
    ``scan`` a ``scan``; ``map`` a ``scan`` with no carry; ``associative_scan`` the
    sequential ``scan`` it equals (one ``combine_fn`` per slice, no log-depth form);
    ``fori_loop`` with int bounds a ``scan`` over its counter; ``while_loop`` (and a
    ``fori_loop`` with tensor bounds) a ``scan`` of ``max_steps`` steps whose body runs
    while the condition holds.

    Checks stay loud in ExecuTorch, which removes asserts: a switch index out of range
    and a loop that would run past ``max_steps`` fail in the runtime.

    Args:
        ep: a program from ``torch.export.export`` (strict or not) holding hop's
            operators, or users' operators declared by a decomposition (inlined).
        max_steps: the most steps a ``while_loop`` whose trip count depends on data
            may run; without it such a loop raises ``CompileUnsupported``.

    Raises:
        hop.errors.CompileUnsupported: what ExecuTorch cannot run, naming the operator:
            a data-dependent loop without ``max_steps``, outputs of data-dependent size
            or Python numbers, carries that change shape, a scan over a length that
            may be 0.
    """
    return _executorch.rewrite(ep, max_steps=max_steps)
