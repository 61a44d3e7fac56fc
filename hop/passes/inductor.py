"""hop.passes in ``torch.compile``: :func:`hop.passes.optimize` as an Inductor post-grad pass.

Inductor runs ``torch._inductor.config.post_grad_custom_pre_pass`` on the post-grad
graph of every compiled program, before its own pattern passes and lowering. hop's
own pre-pass (:mod:`hop.compile.inductor`) is there already: it rewrites ``switch``,
``map``, ``scan`` and ``associative_scan`` into torch's control flow. The optimize
pass goes before it, where every hop operator is still a ``torch.ops.hop.*`` node
with GraphModule subgraphs, as in a traced program. Turn it on with::

    import hop.passes.inductor
    hop.passes.inductor.enable()  # or: config.post_grad_custom_pre_pass = hop.passes.inductor.chain(my_pass)

Private torch internals touched here (each listed, with the releases it was checked on, in
:mod:`hop.compile._torch_api`):
``torch._inductor.config.post_grad_custom_pre_pass`` and
``torch._inductor.custom_graph_pass.CustomGraphPass`` / ``get_hash_for_files``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch._inductor import config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from hop.compile import inductor as inductor_bridge
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
        hop_nodes = [n for n in graph.nodes if _program.is_branching(n) or _program.is_loop(n)]
        if hop_nodes:
            with _program.in_place():
                optimize(gm)

    def __deepcopy__(self, memo: dict[int, Any]) -> OptimizePass:
        return self  # Inductor's config copies its values; one pass is enough

    def uuid(self) -> Any:
        return get_hash_for_files(tuple(sorted(str(p) for p in Path(__file__).parent.glob("*.py"))))


OPTIMIZE_PASS = OptimizePass()


def chain(passes: Any) -> list[Any]:
    """The pre-pass list that runs :data:`OPTIMIZE_PASS`, then hop's own rewrite, then
    ``passes`` (a pass, a list of them or None), each once:
    ``config.post_grad_custom_pre_pass = hop.passes.inductor.chain(my_pass)``."""
    listed = [] if passes is None else list(passes) if isinstance(passes, (list, tuple)) else [passes]
    return [OPTIMIZE_PASS, *inductor_bridge.chain([p for p in listed if p is not OPTIMIZE_PASS])]


def enable() -> None:
    """Put :data:`OPTIMIZE_PASS` first in ``torch._inductor.config.post_grad_custom_pre_pass``,
    keeping hop's own rewrite and the passes already there. Inductor's config is per
    context: call it in the thread that compiles (or use
    ``config.patch(post_grad_custom_pre_pass=chain(...))``)."""
    config.post_grad_custom_pre_pass = chain(config.post_grad_custom_pre_pass)
