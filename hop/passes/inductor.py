"""hop.passes in ``torch.compile``: :func:`hop.passes.optimize` as an Inductor post-grad pass.

Inductor runs ``torch._inductor.config.post_grad_custom_post_pass`` on the post-grad
graph of every compiled program, after its own pattern passes and before lowering.
There hop's ``cond`` and ``while_loop`` (``fori_loop``) are still ``torch.ops.hop.*``
nodes with GraphModule subgraphs, as in a traced program; ``switch``, ``map``, ``scan``
and ``associative_scan`` were already rewritten into torch's own control flow by
hop's ``post_grad_custom_pre_pass`` (:mod:`hop.compile.inductor`), which this pass
leaves alone. Turn it on with::

    import hop.passes.inductor
    hop.passes.inductor.enable()  # or: config.post_grad_custom_post_pass = hop.passes.inductor.chain(my_pass)

Private torch internals touched here (checked on torch 2.13):
``torch._inductor.config.post_grad_custom_post_pass`` and
``torch._inductor.custom_graph_pass.CustomGraphPass`` / ``get_hash_for_files``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch._inductor import config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from hop.passes import _program
from hop.passes.optimize import optimize

__all__ = ["OPTIMIZE_PASS", "OptimizePass", "chain", "enable"]


class OptimizePass(CustomGraphPass):
    """:func:`hop.passes.optimize` on the graph Inductor hands over, edited in place.

    Its :meth:`uuid` keys Inductor's FX graph cache: it changes whenever a file of
    ``hop.passes`` does, so a cached program never skips a changed pass.
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        gm = graph.owning_module
        if not isinstance(gm, torch.fx.GraphModule):
            return  # a graph without its module has no subgraphs to read: nothing to do
        hop_nodes = [n for n in graph.nodes if n.op == "call_function" and n.target in _OPS]
        if hop_nodes:
            with _program.in_place():
                optimize(gm)

    def __deepcopy__(self, memo: dict[int, Any]) -> OptimizePass:
        return self  # Inductor's config copies its values; one pass is enough

    def uuid(self) -> Any:
        return get_hash_for_files(tuple(sorted(str(p) for p in Path(__file__).parent.glob("*.py"))))


OPTIMIZE_PASS = OptimizePass()

# The hop operators a post-grad graph can still hold (the others are rewritten by then).
_OPS = (torch.ops.hop.cond, torch.ops.hop.switch, torch.ops.hop.while_loop, torch.ops.hop.map, torch.ops.hop.scan)


def chain(passes: Any) -> list[Any]:
    """``passes`` (a pass, a list of them or None) with :data:`OPTIMIZE_PASS` first, once:
    ``config.post_grad_custom_post_pass = hop.passes.inductor.chain(my_pass)``."""
    listed = [] if passes is None else list(passes) if isinstance(passes, (list, tuple)) else [passes]
    return [OPTIMIZE_PASS, *(p for p in listed if p is not OPTIMIZE_PASS)]


def enable() -> None:
    """Put :data:`OPTIMIZE_PASS` first in ``torch._inductor.config.post_grad_custom_post_pass``,
    keeping the passes already there. Inductor's config is per context: call it in the
    thread that compiles (or use ``config.patch(post_grad_custom_post_pass=chain(...))``)."""
    config.post_grad_custom_post_pass = chain(config.post_grad_custom_post_pass)
