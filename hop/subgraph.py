"""``hop.subgraph``: the helpers an operator's rules use, public for writing your own HOP.

- pytrees: :func:`flatten` / :func:`unflatten` (torch's C++ pytree when optree is
  installed), :func:`leaf_paths` naming each leaf as ``output[1]["h"]``;
- validation: :func:`check_same_outputs` compares the outputs of branches or
  bodies leaf by leaf and raises a path-naming :class:`~hop.errors.OutputMismatchError`;
- tracing: :func:`trace_subgraph` turns a callable into an ``fx.GraphModule`` at
  the current make_fx level (re-entering the active tracer, or under a fresh fake
  mode); :func:`trace_branches` also lifts what the callables close over;
  :func:`emit` records a call of a hop operator in the active proxy tracer's graph
  with its subgraphs as get_attr submodules;
- closures: :func:`closure_tensors` and :func:`with_closure_as_inputs`, for eager
  derivatives with respect to what a callable closes over;
- effects: :func:`find_mutations_and_aliases` reports the inputs a traced
  subgraph writes and the outputs that alias its inputs;
  :func:`clone_aliases` clones outputs that share storage with inputs;
  :func:`functionalize_body` functionalizes a callable for a functionalize rule,
  keeping torch's effect tokens out of it.

This module only gathers them: each lives in the module of its concern
(``hop._pytree``, ``hop._output_checks``, ``hop._tracing``, ``hop._closures``,
``hop._lifting``, ``hop._effects``), which hop's own modules import directly.
"""

from __future__ import annotations

# The names imported ``as`` themselves are reachable here as when these helpers were one
# module, outside __all__.
from hop._closures import GLOBALS_READ as GLOBALS_READ
from hop._closures import INERT_TYPES as INERT_TYPES
from hop._closures import closure_tensors
from hop._closures import convert_closures as convert_closures
from hop._closures import globals_read as globals_read
from hop._closures import is_inert as is_inert
from hop._closures import with_closure_as_inputs as with_closure_as_inputs
from hop._effects import (
    CHECK_EFFECTS,
    Effects,
    clone_aliased_outputs,
    clone_aliases,
    effect_name,
    find_mutations_and_aliases,
    functionalize_body,
    untokened_effect,
)
from hop._effects import hidden_alias as hidden_alias
from hop._effects import may_alias as may_alias
from hop._effects import same_memory as same_memory
from hop._lifting import trace_branches
from hop._output_checks import LeafMeta, check_same_outputs, describe, describe_fn, leaf_meta
from hop._pytree import TreeSpec, flatten, leaf_paths, unflatten
from hop._pytree import flatten_dropping_none as flatten_dropping_none
from hop._pytree import leaf_paths_dropping_none as leaf_paths_dropping_none
from hop._tracing import emit, trace_example, trace_subgraph, unknown_value
from hop._tracing import keeping_node_meta as keeping_node_meta

__all__ = [
    "TreeSpec",
    "flatten",
    "unflatten",
    "leaf_paths",
    "describe",
    "describe_fn",
    "LeafMeta",
    "leaf_meta",
    "check_same_outputs",
    "trace_subgraph",
    "trace_example",
    "unknown_value",
    "trace_branches",
    "closure_tensors",
    "emit",
    "Effects",
    "find_mutations_and_aliases",
    "clone_aliases",
    "clone_aliased_outputs",
    "functionalize_body",
    "effect_name",
    "untokened_effect",
    "CHECK_EFFECTS",
]
