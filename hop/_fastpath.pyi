"""hop's C module (hop/_fastpath.c): Note [the eager inline cache] in hop.ops.branching._call_cache."""

from collections.abc import Callable
from typing import Any

def configure(
    *,
    entry_fields: tuple[str, ...],
    tensor: type,
    not_taken: object,
    config: dict[str, Any],
    reference: dict[str, Any],
    sinks: list[Any],
    index_dtypes: set[Any],
    inert_types: frozenset[type],
    cond_cache: dict[int, tuple[Any, ...]],
    switch_cache: dict[int, tuple[Any, ...]],
    mode_stack_len: Callable[[], int],
    functorch_level: Callable[[], int | None],
    tf_mode: Callable[[], bool],
    grad_enabled: Callable[[], bool],
    accumulate_grad: type,
    library_namespaces: set[Any],
) -> None: ...
def key(branches: list[Any] | tuple[Any, ...], x: Any, /) -> int | None: ...
def cond(pred: Any, true_fn: Callable[..., Any], false_fn: Callable[..., Any], operands: Any, /) -> Any: ...
def switch(index: Any, branches: Any, operands: Any, /) -> Any: ...
def nothing_active() -> bool: ...
