"""Subgraph helpers shared by every hop operator.

- pytrees: :func:`flatten` / :func:`unflatten` (torch's C++ pytree when optree is
  installed), :func:`leaf_paths` naming each leaf as ``output[1]["h"]``;
- validation: :func:`check_same_outputs` compares the outputs of branches or
  bodies leaf by leaf and raises a path-naming :class:`OutputMismatchError`;
- tracing: :func:`trace_subgraph` turns a callable into an ``fx.GraphModule`` at
  the current make_fx level (re-entering the active tracer, or under a fresh fake
  mode); :func:`emit` records a call of a hop operator in the active proxy
  tracer's graph with its subgraphs as get_attr submodules;
- effects: :func:`find_mutations_and_aliases` reports the inputs a traced
  subgraph writes and the outputs that alias its inputs;
  :func:`clone_aliases` clones outputs that share storage with inputs;
  :func:`functionalize_body` functionalizes a callable for a functionalize rule,
  keeping torch's effect tokens out of it (Note [effect tokens stay outside bodies]).
"""

from __future__ import annotations

import contextlib
import dataclasses
import dis
import functools
from collections.abc import Callable, Sequence
from types import BuiltinFunctionType, CodeType, FunctionType, MethodType, ModuleType
from typing import Any

import optree
import torch
import torch.fx
import torch.utils._cxx_pytree as _pytree  # optree-backed: ~5x faster than _pytree
import torch.utils._pytree as py_pytree

from hop import _observe
from hop.errors import CompileUnsupported, OutputMismatchError, format_message

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

TreeSpec = Any  # a py or cxx pytree spec; both support equality and unflatten


def flatten(tree: Any) -> tuple[list[Any], TreeSpec]:
    """Leaves and structure of a pytree."""
    return _pytree.tree_flatten(tree)


def unflatten(leaves: Sequence[Any], spec: TreeSpec) -> Any:
    """Inverse of :func:`flatten`."""
    return _pytree.tree_unflatten(list(leaves), spec)


def flatten_dropping_none(tree: Any) -> tuple[list[Any], Any]:
    """Leaves and structure, ``None`` an empty subtree (``return carry, None`` has no y),
    where :func:`flatten` (torch's convention) keeps ``None`` as a leaf; the
    structure unflattens with :func:`unflatten`."""
    return optree.tree_flatten(tree, none_is_leaf=False, namespace="torch")


def leaf_paths_dropping_none(tree: Any, root: str) -> list[str]:
    """``root[1]["h"]``-style names of the leaves of ``tree`` in :func:`flatten_dropping_none`'s order."""
    paths = []
    for accessor in optree.tree_accessors(tree, none_is_leaf=False, namespace="torch"):
        path = root
        for e in accessor:
            if isinstance(e, optree.NamedTupleEntry):
                path += f".{e.field}"
            elif isinstance(e, optree.GetAttrEntry):
                path += f".{e.name}"
            elif isinstance(e, optree.MappingEntry) and isinstance(e.entry, str):
                path += f'["{e.entry}"]'
            else:
                path += f"[{e.entry!r}]"
        paths.append(path)
    return paths


def _key_str(entry: Any) -> str:
    if isinstance(entry, py_pytree.SequenceKey):
        return f"[{entry.idx}]"
    if isinstance(entry, py_pytree.MappingKey):
        key = entry.key
        return f'["{key}"]' if isinstance(key, str) else f"[{key!r}]"
    if isinstance(entry, py_pytree.GetAttrKey):
        return f".{entry.name}"
    return str(entry)


def leaf_paths(tree: Any, root: str = "output") -> list[str]:
    """``root[1]["h"]``-style names for the leaves of ``tree``, in flatten order."""
    pairs, _ = py_pytree.tree_flatten_with_path(tree)
    return [root + "".join(_key_str(k) for k in path) for path, _ in pairs]


def describe(value: Any) -> str:
    """Short description of a leaf for error messages."""
    if isinstance(value, torch.Tensor):
        shape = "x".join(str(s) for s in value.shape) or "scalar"
        return f"Tensor({shape}, {str(value.dtype).removeprefix('torch.')}, {value.device})"
    return f"{type(value).__name__}({value!r})"


@dataclasses.dataclass(frozen=True)
class LeafMeta:
    """What output checks compare of a leaf: its kind, dtype, device and shape."""

    kind: str
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    shape: tuple[Any, ...] = ()

    @property
    def ndim(self) -> int:
        return len(self.shape)


def leaf_meta(leaf: Any) -> LeafMeta:
    """The :class:`LeafMeta` of a leaf (a LeafMeta is returned unchanged)."""
    if isinstance(leaf, LeafMeta):
        return leaf
    if isinstance(leaf, torch.Tensor):
        return LeafMeta("Tensor", leaf.dtype, leaf.device, tuple(leaf.shape))
    if isinstance(leaf, (int, torch.SymInt)) and not isinstance(leaf, bool):
        return LeafMeta("int")
    return LeafMeta(type(leaf).__name__)


def describe_fn(fn: Any) -> str:
    """``name (file.py:12)`` for a callable, for error messages."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__func__", None), "__code__", None)
    if code is None:
        return name
    return f"{name} ({code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno})"


def _fmt_dtype(d: torch.dtype | None) -> str:
    return str(d).removeprefix("torch.")


def check_same_outputs(
    op: str,
    roles: Sequence[str],
    outputs: Sequence[Any],
    *,
    root: str = "output",
    check_rank: bool = True,
    fns: Sequence[Any] | None = None,
) -> None:
    """Raise :class:`OutputMismatchError` unless every output has the structure,
    leaf kinds, dtypes, devices (and ranks) of ``outputs[0]``.

    Args:
        op: operator name for the message (``"cond"``).
        roles: a name per output, e.g. ``("true_fn", "false_fn")``.
        outputs: what each callable returned (leaves may be :class:`LeafMeta`).
        root: the name of the output in paths (``output[1]["h"]``).
        check_rank: sizes may always differ; ranks too when False.
        fns: the callables, to name them and their source in the message.
    """
    ref_leaves, ref_spec = flatten(outputs[0])
    for k in range(1, len(outputs)):
        role, out = roles[k], outputs[k]
        pair = f"{roles[0]} and {role}"
        named = (
            []
            if fns is None
            else [f"{r} is {describe_fn(f)}" for r, f in ((roles[0], fns[0]), (role, fns[k])) if f is not None]
        )
        where = f" ({', '.join(named)})" if named else ""
        leaves, spec = flatten(out)
        if spec != ref_spec:
            raise OutputMismatchError(
                format_message(
                    op,
                    f"{pair} return different structures: {_spec_str(outputs[0])} vs {_spec_str(out)}{where}",
                    fix=f"Make {pair} return the same pytree structure.",
                ),
                op=op,
                role=role,
                path=root,
            )
        paths = leaf_paths(outputs[0], root)
        for path, a, b in zip(paths, ref_leaves, leaves, strict=True):
            ma, mb = leaf_meta(a), leaf_meta(b)
            diff = None
            if ma.kind != mb.kind:
                diff = f"{ma.kind} vs {mb.kind}"
            elif ma.dtype != mb.dtype:
                diff = f"dtype {_fmt_dtype(ma.dtype)} vs {_fmt_dtype(mb.dtype)}"
            elif ma.device != mb.device:
                diff = f"device {ma.device} vs {mb.device}"
            elif check_rank and ma.ndim != mb.ndim:
                diff = f"rank {ma.ndim} vs {mb.ndim} (shapes {tuple(ma.shape)} vs {tuple(mb.shape)})"
            if diff is not None:
                raise OutputMismatchError(
                    format_message(
                        op,
                        f"{pair} disagree at {path}: {diff}{where}",
                        fix=f"Make both return the same kind of value at {path}.",
                    ),
                    op=op,
                    role=role,
                    path=path,
                )


def _spec_str(tree: Any) -> str:
    return str(py_pytree.tree_map(lambda leaf: "*", tree)).replace("'*'", "*")


# --- tracing ------------------------------------------------------------------


def trace_subgraph(fn: Callable[..., Any], args: Sequence[Any]) -> torch.fx.GraphModule:
    """Trace ``fn(*args)`` into a GraphModule at the current level.

    Under make_fx (and so torch.export), the active tracer's sub-tracer is
    re-entered: it shares the fake mode, the ShapeEnv and the decomposition
    table. Otherwise ``fn`` is traced by a fresh make_fx under the inputs' fake
    mode (or a new one).
    """
    from torch.fx.experimental import proxy_tensor

    fn = keeping_node_meta(fn)
    tracer = proxy_tensor._CURRENT_MAKE_FX_TRACER
    if tracer is not None:
        return tracer.trace_subgraph(fn, *args)
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode(list(args))
    if fake_mode is None:
        return proxy_tensor.make_fx(fn, tracing_mode="fake")(*args)
    with fake_mode:
        return proxy_tensor.make_fx(fn, tracing_mode="real")(*args)


# Note [re-traced subgraphs keep their node meta]
# Re-tracing a captured program under torch.fx.traceback.preserve_node_meta() (as
# AOTAutograd does, and users who re-run make_fx) copies each node's stack_trace,
# source_fn_stack and nn_module_stack from the node being run to the nodes it
# produces; that needs the graph run node by node by an fx.Interpreter. A body that
# is already a GraphModule (an operator's argument in the program) is run that way,
# or its nodes would point at hop's rule instead of the user's line.


def keeping_node_meta(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, run by an fx.Interpreter if it is a GraphModule and node meta is preserved."""
    if not isinstance(fn, torch.fx.GraphModule) or not torch.fx.traceback.has_preserved_node_meta():
        return fn
    graph_module = fn

    def interpreted(*args: Any) -> Any:
        with torch.fx.traceback.preserve_node_meta():
            return torch.fx.Interpreter(graph_module).run(*args)

    interpreted.__wrapped__ = graph_module  # type: ignore[attr-defined]  # names it in errors
    return interpreted


# Note [bodies are traced on values they can see]
# A loop body is traced on fresh tensors, never on the carries themselves (a body
# may also read the loop's initial tensor through a closure, and two carries must
# not alias). Fake and meta values carry no data: an empty tensor serves. Under
# make_fx(tracing_mode="real") the body's ops run for real while it is traced, and
# so does a loop nested in it: on uninitialized memory its trip count would be
# arbitrary (tracing could hang). A real value is therefore copied: the carry the
# loop starts from (the first slice, for a scan) is what the first iteration sees.


def trace_example(value: Any) -> Any:
    """A fresh contiguous tensor standing for ``value`` while a loop body is traced
    (Note [bodies are traced on values they can see]); non-tensors are returned as is."""
    if not isinstance(value, torch.Tensor):
        return value
    from hop._transforms import is_plain_tensor

    if is_plain_tensor(value):  # real data
        return value.detach().clone(memory_format=torch.contiguous_format)
    return unknown_value(value.new_empty(value.shape))


def unknown_value(value: Any) -> Any:
    """``value``, or for a fake tensor whose value FakeTensorMode knows (a one-element
    literal's, such as a counter's ``torch.tensor(0)``, or what such a value propagated
    to) a fresh one of its metadata that knows none.

    A loop's carries change between iterations: a body run or traced on a known value
    would bake that value in (``w[i]`` with the counter read as 0 every step), and
    FakeTensorMode propagates a known value through ``new_empty``/``empty_like`` as
    uninitialized memory, an arbitrary number."""
    from torch._subclasses.fake_tensor import FakeTensor

    if not isinstance(value, FakeTensor) or value.constant is None:
        return value
    fresh = value.new_empty(value.shape)
    assert isinstance(fresh, FakeTensor)  # made in value's fake mode
    fresh.constant = None
    return fresh


# The global names each code object loads, the code nested in it included (lambdas,
# inner functions, comprehensions): read once per code object, which stays alive as
# the key (a bounded set: the code of a program, not one entry per call).
GLOBALS_READ: dict[CodeType, tuple[str, ...]] = {}


def globals_read(code: CodeType) -> tuple[str, ...]:
    """The names of the globals ``code`` and the code nested in it may read."""
    names = GLOBALS_READ.get(code)
    if names is None:
        found = dict.fromkeys(i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME"))
        for const in code.co_consts:
            if type(const) is CodeType:
                found.update(dict.fromkeys(globals_read(const)))
        names = GLOBALS_READ[code] = tuple(found)
    return names


# Values that can lead to no tensor (Note [untaken branches get zero gradients]): a
# global or a bound builtin's owner of one of these types is not searched. Python
# modules count as inert (``torch``, ``math``): a parameter kept as a module
# attribute is missed, and so is one kept as a class attribute.
INERT_TYPES: frozenset[type] = frozenset(
    {type(None), bool, int, float, complex, str, bytes, ModuleType, torch.dtype, torch.device, torch.Size}
)


def is_inert(value: Any) -> bool:
    """Whether ``value`` can lead to no tensor: an inert type's value, a class, or a
    builtin function (``torch.tanh``, ``len``) whose owner is one."""
    kind = type(value)
    if kind in INERT_TYPES or isinstance(value, type):
        return True
    if kind is BuiltinFunctionType:
        owner = value.__self__
        return type(owner) in INERT_TYPES or isinstance(owner, type)
    return False


def closure_tensors(fns: Sequence[Any], *, depth: int = 4) -> list[torch.Tensor]:
    """Tensors the callables may read without receiving them: in closure cells, bound
    ``self``, referenced globals, default arguments and partial arguments, including
    the parameters and buffers of modules found there (searched ``depth`` levels deep).

    A static over-approximation, for eager paths that must differentiate with respect
    to what a function closes over (traced paths lift exactly, Note [closure lifting]).
    """
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()

    def visit(obj: Any, level: int) -> None:
        if level > depth or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.setdefault(id(obj), obj)
        elif isinstance(obj, torch.nn.Module):
            for t in (*obj.parameters(), *obj.buffers()):
                found.setdefault(id(t), t)
        elif isinstance(obj, FunctionType) and hasattr(obj, "__hop_closure_map__"):
            inner, mapping = obj.__hop_closure_map__  # a converted callable: what it reads instead
            for t in closure_tensors([inner], depth=depth - level):
                v = mapping.get(id(t), t)
                if v is not None:
                    found.setdefault(id(v), v)
        elif isinstance(obj, FunctionType):
            for cell in obj.__closure__ or ():
                with contextlib.suppress(ValueError):  # an empty cell
                    visit(cell.cell_contents, level + 1)
            for name in globals_read(obj.__code__):
                value = obj.__globals__.get(name)
                if not is_inert(value):
                    visit(value, level + 1)
            for value in (*(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()):
                visit(value, level + 1)  # captured as a default: lambda a, w=w: a @ w
        elif isinstance(obj, MethodType):
            visit(obj.__func__, level)
            visit(obj.__self__, level + 1)
        elif isinstance(obj, functools.partial):
            for v in (obj.func, *obj.args, *obj.keywords.values()):
                visit(v, level + 1)
        elif isinstance(obj, (list, tuple)):
            for v in obj[:64]:
                visit(v, level + 1)
        elif isinstance(obj, dict):
            for v in list(obj.values())[:64]:
                visit(v, level + 1)
        elif type(obj) is BuiltinFunctionType:
            visit(obj.__self__, level + 1)  # W.mul: the tensor it is bound to
        elif not is_inert(obj) and isinstance(getattr(obj, "__dict__", None), dict):
            for v in list(vars(obj).values())[:64]:  # a namespace or config object holding parameters
                visit(v, level + 1)

    for fn in fns:
        visit(fn, 0)
    return list(found.values())


class _Rebind(torch.overrides.TorchFunctionMode):
    """Swaps tensors (by identity) for others in every torch call: Note [closure conversion]."""

    def __init__(self, subs: dict[int, Any]) -> None:
        super().__init__()
        self.subs = subs

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        subs = self.subs

        def swap(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return subs.get(id(x), x)
            if callable(x) and isinstance(func, torch._ops.HigherOrderOperator):
                return _rebound_callable(x, subs)  # a nested operator's branches read the closure too
            return x

        args, kwargs = py_pytree.tree_map(swap, (tuple(args), kwargs or {}))
        return func(*args, **kwargs)


def _rebound_callable(fn: Callable[..., Any], subs: dict[int, Any]) -> Callable[..., Any]:
    def rebound(*args: Any) -> Any:
        with _Rebind(subs):
            out = fn(*args)
        return py_pytree.tree_map(lambda x: subs.get(id(x), x) if isinstance(x, torch.Tensor) else x, out)

    rebound.__wrapped__ = fn  # type: ignore[attr-defined]
    rebound.__qualname__ = getattr(fn, "__qualname__", "branch")
    rebound.__hop_closure_map__ = (fn, subs)  # type: ignore[attr-defined]
    return rebound


def convert_closures(
    fns: Sequence[Callable[..., Any]], operands: Sequence[Any], level: int | None = None
) -> tuple[list[Callable[..., Any]], list[torch.Tensor]]:
    """The tensors ``fns`` read from their closures that a derivative must reach (they
    require grad, or a torch.func grad / jvp transform at ``level`` tracks them) and
    that are not operands already, and ``fns`` taking them as extra trailing inputs
    (Note [closure conversion]); ``fns`` unchanged when there are none."""
    from torch._C._functorch import is_gradtrackingtensor, maybe_get_level

    def tracked(t: torch.Tensor) -> bool:
        if level is not None and is_gradtrackingtensor(t) and maybe_get_level(t) == level:
            return True
        return t.requires_grad and (t.is_floating_point() or t.is_complex())

    captured = [t for t in closure_tensors(fns) if tracked(t) and not any(t is x for x in operands)]
    if not captured:
        return list(fns), []
    _observe.closures(captured)
    return [with_closure_as_inputs(fn, captured) for fn in fns], captured


def with_closure_as_inputs(fn: Callable[..., Any], captured: Sequence[torch.Tensor]) -> Callable[..., Any]:
    """``fn`` taking ``captured`` as extra trailing inputs: ``converted(*args, *values)``
    runs ``fn(*args)`` in which every use of ``captured[i]`` reads ``values[i]``.

    Note [closure conversion]: an autograd node can only differentiate with respect
    to its inputs, so tensors a branch or body reads from its closure (a module's
    parameters, a tensor a torch.func transform tracks) become extra inputs. Every
    torch call made while ``fn`` runs sees them swapped by identity (a
    torch-function mode), whatever the closure's form (cells, bound ``self``,
    globals); so do the callables of hop operators nested in it.
    """
    keep = list(captured)  # keeps the ids valid
    n = len(keep)

    def converted(*args: Any) -> Any:
        subs = {id(t): a for t, a in zip(keep, args[len(args) - n :], strict=True)}
        return _rebound_callable(fn, subs)(*args[: len(args) - n])

    converted.__wrapped__ = fn  # type: ignore[attr-defined]
    converted.__qualname__ = getattr(fn, "__qualname__", "branch")
    converted.__hop_closure_map__ = (fn, {id(t): None for t in keep})  # type: ignore[attr-defined]
    return converted


# Note [closure lifting]
# A branch may use tensors and SymInts it closes over (a module's parameters, a
# size read from another input). Traced by a sub-tracer they are unknown there:
# torch would bake a tensor into the subgraph as a get_attr constant (holding a
# FakeTensor under export, which breaks save/load) and fail on a SymInt. While a
# branch is traced, hop swaps the sub-tracer's tensor and SymInt trackers for
# ones that, on a miss, ask the parent tracer: if the parent knows the value, a
# new placeholder is added to the subgraph and the value becomes an extra operand
# of the operator. Only what the branch uses is lifted; nested operators lift
# through every level on the way up.


class _LiftingTracker:
    """A tracker that lifts values known to ``parent`` into new placeholders."""

    def __init__(self, inner: Any, parent: Any, lift: Callable[[Any], Any]) -> None:
        self._inner = inner
        self._parent = parent
        self._lift = lift

    def get(self, key: Any, default: Any = None) -> Any:
        value = self._inner.get(key)
        if value is None and self._parent.get(key) is not None:
            value = self._lift(key)
            self._inner[key] = value
        return default if value is None else value

    def __getitem__(self, key: Any) -> Any:
        return self._inner[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._inner[key] = value

    def __contains__(self, key: Any) -> bool:
        return key in self._inner

    def __len__(self) -> int:
        return len(self._inner)

    def __iter__(self) -> Any:
        return iter(self._inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _install_lifting(sub: Any, parent: Any, lifted: list[Any], nodes: list[torch.fx.Node]) -> None:
    from torch.fx.experimental import proxy_tensor

    def placeholder(value: Any) -> torch.fx.Proxy:
        graph = sub.graph
        anchor = next((n for n in graph.nodes if n.op != "placeholder"), None)
        with graph.inserting_before(anchor):
            node = graph.placeholder(f"lifted_{len(lifted)}")
        lifted.append(value)
        nodes.append(node)
        return torch.fx.Proxy(node, sub)

    def lift_tensor(t: torch.Tensor) -> Any:
        proxy = placeholder(t)
        proxy_tensor.set_meta(proxy, t)
        return proxy_tensor._ProxyTensor(proxy, None)

    def lift_sym(s: Any) -> Any:
        proxy = placeholder(s)
        proxy.node.meta["val"] = s
        return proxy_tensor.thunkify(sub, lambda: proxy)

    sub.tensor_tracker = _LiftingTracker(sub.tensor_tracker, parent.tensor_tracker, lift_tensor)
    sub.symnode_tracker = _LiftingTracker(sub.symnode_tracker, parent.symnode_tracker, lift_sym)


def trace_branches(
    fns: Sequence[Callable[..., Any]], args: Sequence[Any]
) -> tuple[list[torch.fx.GraphModule], list[Any]]:
    """Trace each of ``fns`` on ``args``, lifting what they close over.

    Returns the graphs and the lifted values (tensors, SymInts of the parent
    trace, in first-use order). Every graph takes ``(*args, *lifted)``: a graph
    that does not use a lifted value has an unused placeholder for it. See
    Note [closure lifting]. Outside make_fx nothing is lifted.
    """
    from torch.fx.experimental import proxy_tensor

    outer = proxy_tensor._CURRENT_MAKE_FX_TRACER
    parent = outer.fx_tracer if outer is not None else None
    traced: list[tuple[torch.fx.GraphModule, list[Any], list[torch.fx.Node]]] = []
    for fn in fns:
        fn = keeping_node_meta(fn)
        lifted: list[Any] = []
        nodes: list[torch.fx.Node] = []

        def lifting(*a: Any, fn: Callable[..., Any] = fn, lifted: list[Any] = lifted, nodes: list[Any] = nodes) -> Any:
            current = proxy_tensor._CURRENT_MAKE_FX_TRACER
            if parent is not None and current is not None and current.fx_tracer is not parent:
                _install_lifting(current.fx_tracer, parent, lifted, nodes)
            return fn(*a)

        gm = trace_subgraph(lifting, args)
        if outer is not None:
            _lift_constants(gm, outer, lifted, nodes)
        traced.append((gm, lifted, nodes))
    union: list[Any] = []
    for _, lifted, _ in traced:
        union.extend(v for v in lifted if not any(_same_value(v, u) for u in union))
    for gm, lifted, nodes in traced:
        _align_placeholders(gm, lifted, nodes, union)
    _observe.closures(union)
    return [gm for gm, _, _ in traced], union


def _lift_constants(gm: torch.fx.GraphModule, outer: Any, lifted: list[Any], nodes: list[torch.fx.Node]) -> None:
    """Tensor constants a branch made (``torch.tensor(2.0)``) become constants of the
    parent graph, passed in as lifted values: torch.export lifts and saves a
    top-level constant, not one inside a subgraph.

    The placeholder's example is a fake of a *copy* of the constant: ``from_tensor``
    memoizes, and the branch's own ``lift_fresh_copy`` of the constant already holds
    the fake of the constant itself; sharing its storage would make the in-place
    ``detach_`` that ``torch.tensor`` records read as a write to this input. The
    attribute is deleted from the subgraph: torch.export turns every tensor
    attribute of a submodule into a buffer of the program."""
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import track_tensor_tree

    parent, fake_mode = outer.fx_tracer, outer.fake_tensor_mode
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        value = _attr(gm, str(node.target))
        if not isinstance(value, torch.Tensor):
            continue
        name = parent.get_fresh_qualname("_tensor_constant")
        setattr(parent.root, name, value)
        example = value
        if fake_mode is not None and not isinstance(value, FakeTensor):
            with unset_fake_temporarily():
                copy = value.clone()
            example = fake_mode.from_tensor(copy, static_shapes=True)
        track_tensor_tree(example, parent.create_proxy("get_attr", name, (), {}), constant=value, tracer=parent)
        anchor = next(n for n in gm.graph.nodes if n.op != "placeholder")
        with gm.graph.inserting_before(anchor):
            placeholder = gm.graph.placeholder(f"lifted_const_{len(lifted)}")
        placeholder.meta = dict(node.meta)
        placeholder.meta["val"] = example
        node.replace_all_uses_with(placeholder)
        gm.graph.erase_node(node)
        if not any(n.op == "get_attr" and n.target == node.target for n in gm.graph.nodes):
            _delete_attr(gm, str(node.target))
        lifted.append(example)
        nodes.append(placeholder)
    gm.recompile()


def _attr(root: torch.nn.Module, target: str) -> Any:
    obj: Any = root
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


def _delete_attr(root: torch.nn.Module, target: str) -> None:
    *path, last = target.split(".")
    owner = _attr(root, ".".join(path)) if path else root
    delattr(owner, last)


def _same_value(a: Any, b: Any) -> bool:
    """Lifted values that stand for the same thing: one tensor, or one symbolic expression."""
    if a is b:
        return True
    sym = (torch.SymInt, torch.SymBool, torch.SymFloat)
    return isinstance(a, sym) and isinstance(b, sym) and a.node.expr == b.node.expr


def _align_placeholders(
    gm: torch.fx.GraphModule, lifted: list[Any], nodes: list[torch.fx.Node], union: list[Any]
) -> None:
    """Make ``gm``'s lifted placeholders follow ``union``'s order, adding unused ones."""
    if not union:
        return
    graph = gm.graph
    anchor = next(n for n in graph.nodes if n.op != "placeholder")
    for i, value in enumerate(union):
        with graph.inserting_before(anchor):
            new = graph.placeholder(f"lifted_arg_{i}")
        # one branch may have lifted the same value twice (two SymInts of one expression)
        olds = [n for v, n in zip(lifted, nodes, strict=True) if _same_value(v, value)]
        new.meta = dict(olds[0].meta) if olds else {"val": value}
        for old in olds:
            old.replace_all_uses_with(new)
            graph.erase_node(old)
    gm.recompile()


def emit(mode: Any, op: Any, args: Sequence[Any], out: Any) -> Any:
    """Record ``op(*args)`` in ``mode``'s graph and bind ``out`` to the new node.

    GraphModules in ``args`` (also inside lists and tuples) are registered as
    submodules of the tracer's root, so they appear as get_attr arguments.
    ``out`` is the value the call produces (from the fake rule).
    """
    tracer = mode.tracer

    def to_arg(a: Any) -> Any:
        if isinstance(a, torch.fx.GraphModule):
            name = tracer.get_fresh_qualname(f"{op.name()}_graph_")
            tracer.root.register_module(name, a)
            return a
        return tracer.unwrap_proxy(a)

    from torch.fx.experimental.proxy_tensor import track_tensor_tree

    proxy_args = py_pytree.tree_map(to_arg, tuple(args))
    out_proxy = tracer.create_proxy("call_function", op, proxy_args, {})
    if _observe.SINKS or _observe.structured_on():
        from hop._observe_traced import traced_node

        traced_node(op.name(), tuple(args))
    return track_tensor_tree(out, out_proxy, constant=None, tracer=tracer)


# --- effects ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Effects:
    """What a traced subgraph does to its inputs.

    Attributes:
        mutated: indices of placeholders written in place.
        aliased: (output index, input index) pairs sharing storage.
    """

    mutated: tuple[int, ...]
    aliased: tuple[tuple[int, int], ...]


def same_memory(o: torch.Tensor, x: Any) -> bool:
    """Whether tensor ``o`` starts where tensor ``x`` does in memory: an alias that is
    not a view (``x.detach()``, ``x.data``) shows only so. Cheap; False where there
    is no memory to compare (empty, meta, fake, functional or batched tensors)."""
    if not isinstance(x, torch.Tensor) or o.layout is not torch.strided or x.layout is not torch.strided:
        return False
    try:
        p = o.data_ptr()
        return p != 0 and p == x.data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage to point at
        return False


def may_alias(o: Any, operands: Sequence[Any]) -> bool:
    """A cheap test that a leaf of an output may share memory with an operand (then
    :func:`clone_aliases` decides exactly): one of them, a view, or :func:`same_memory`."""
    if not isinstance(o, torch.Tensor):
        return False
    if o._is_view():
        return True
    return any(o is x or same_memory(o, x) for x in operands)


def hidden_alias(outputs: Sequence[Any], inputs: Sequence[Any]) -> bool:
    """Whether a tensor of ``outputs`` shares storage with one of ``inputs`` (fake
    included) while being neither an input nor a view: ``x.detach()``, ``x.data``,
    aliases that the cheap checks (identity, ``_is_view``) do not see."""
    seen = {s for s in map(_storage, inputs) if s is not None}
    for o in outputs:
        s = _storage(o)
        if s is not None and s in seen and not o._is_view() and not any(o is x for x in inputs):
            return True
    return False


def _storage(v: Any) -> int | None:
    """An id of ``v``'s storage, equal for tensors sharing memory (compared while alive)."""
    if isinstance(v, torch.Tensor) and v.layout == torch.strided:
        try:
            return int(v.untyped_storage()._cdata)
        except (NotImplementedError, RuntimeError):
            return None
    return None


def find_mutations_and_aliases(gm: torch.fx.GraphModule) -> Effects:
    """Inputs written in place and outputs aliasing inputs, from ``meta["val"]``.

    Writes are found on aten ops whose schema marks the argument as written
    (``add_``, ``copy_``, ``out=``); the graph must come from make_fx, so every
    placeholder and output carries ``meta["val"]``.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {n: i for i, n in enumerate(placeholders)}
    storages = [_storage(n.meta.get("val")) for n in placeholders]
    mutated: set[int] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for arg_schema, arg in zip(node.target._schema.arguments, node.args, strict=False):
            if arg_schema.is_write and isinstance(arg, torch.fx.Node):
                written = _storage(arg.meta.get("val"))
                for i, s in enumerate(storages):
                    if s is not None and s == written:
                        mutated.add(i)
        for name, arg in node.kwargs.items():
            if isinstance(arg, torch.fx.Node) and arg in index and _is_written_kwarg(node.target, name):
                mutated.add(index[arg])
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = py_pytree.tree_leaves(out_node.args[0])
    aliased = []
    for j, o in enumerate(outs):
        so = _storage(o.meta.get("val")) if isinstance(o, torch.fx.Node) else None
        for i, s in enumerate(storages):
            if so is not None and s == so:
                aliased.append((j, i))
    return Effects(tuple(sorted(mutated)), tuple(aliased))


def _is_written_kwarg(target: torch._ops.OpOverload, name: str) -> bool:
    return any(a.name == name and a.is_write for a in target._schema.arguments)


def clone_aliased_outputs(gm: torch.fx.GraphModule, effects: Effects) -> None:
    """Clone, inside ``gm``, the outputs that alias its inputs (``effects.aliased``)."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    flat, spec = py_pytree.tree_flatten(out_node.args[0])
    for j in {j for j, _ in effects.aliased}:
        with gm.graph.inserting_before(out_node):
            clone = gm.graph.call_function(torch.ops.aten.clone.default, (flat[j],))
        clone.meta["val"] = flat[j].meta["val"].clone()
        flat[j] = clone
    out_node.args = (py_pytree.tree_unflatten(flat, spec),)
    gm.recompile()


def clone_aliases(outputs: Sequence[Any], inputs: Sequence[Any]) -> list[Any]:
    """``outputs`` with every tensor that shares storage with an input (or an
    earlier output) cloned, so a HOP never returns an alias of its operands."""
    seen = {s for s in (_storage(i) for i in inputs) if s is not None}
    result = []
    for o in outputs:
        s = _storage(o)
        if s is not None and s in seen:
            o = o.clone()
            s = _storage(o)
        if s is not None:
            seen.add(s)
        result.append(o)
    return result


# Note [effect tokens stay outside bodies]
# torch registers some ops as having an ordered side effect (``aten::_print``,
# ``aten::_linalg_check_errors``, which ``torch.linalg.solve``/``inv``/``cholesky``
# call). Once functionalized (AOTAutograd, ``run_decompositions``), torch threads
# them on an effect token held by the FunctionalTensorMode: the op becomes
# ``with_effects(token, op, ...)``, and the new token replaces the mode's. Run in a
# hop body, that token belongs to no graph: the outer token is read inside the
# subgraph (lifted as an operand), the body's new token is read outside it (a
# constant made in the subgraph: "lifted_tensor_0 is not in the constants
# dictionary"), and a token first met in a backward body becomes a
# ``tangents_token`` placeholder of the subgraph, which hop never passes.
#
# hop's nodes take no token, so inside a body an effectful op is recorded as the
# plain op, past the FunctionalTensorMode. That is right only for an effect that
# is a check: ``_linalg_check_errors`` returns nothing, writes nothing and raises
# on a failed factorization; the graph keeps it (fx and Inductor treat an op with
# a registered effect as impure) after the op whose ``info`` it reads, so it
# raises as in eager. Without the token, only its order relative to effects
# outside the body is free: at most, which of two failing checks reports first, or
# whether a print placed after the operator runs before the check raises. Any
# other effect (a print, a call on a script object) would lose its order
# silently: it is refused with a message instead, by Dynamo's capture of a body
# (hop.compile._dynamo_capture.speculate) and by functionalization.
#
# An op reaches this mode as the caller wrote it (``linalg_inv``); the check is
# called by its composite kernel. The mode decomposes what the FunctionalTensorMode
# would (asking that mode's ``_can_decompose``), so the check meets it too.

CHECK_EFFECTS: frozenset[str] = frozenset({"aten::_linalg_check_errors"})
"""Ops whose registered effect only raises on bad input: inside a body, they need no token."""


def effect_name(func: Any) -> str | None:
    """``"aten::_print"`` for an op with a registered effect (an overload, a packet
    one of whose overloads has it, or a higher-order operator), else None."""
    from torch._higher_order_ops.effects import has_effects

    if isinstance(func, torch._ops.OpOverloadPacket):
        overloads = (getattr(func, name) for name in func.overloads())  # type: ignore[no-untyped-call]
        return next((n for n in map(effect_name, overloads) if n is not None), None)
    if not has_effects(func):
        return None
    if isinstance(func, torch._ops.OpOverload):
        return str(func._schema.name)
    return f"{func.namespace}::{func.name()}"


def untokened_effect(graph: torch.fx.Graph) -> str | None:
    """The first effectful op of ``graph`` that a body cannot run without its token
    (Note [effect tokens stay outside bodies]), or None."""
    for node in graph.nodes:
        if node.op == "call_function":
            name = effect_name(node.target)
            if name is not None and name not in CHECK_EFFECTS:
                return name
    return None


class _UntokenedChecks(torch.utils._python_dispatch.TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Runs above a body's FunctionalTensorMode: Note [effect tokens stay outside bodies]."""

    supports_higher_order_operators = True  # nested operators pass through, to their own rules

    def __init__(self, ctx: Any, op: str, role: str, fn: Callable[..., Any]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._ctx, self._op, self._role, self._fn = ctx, op, role, fn

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = effect_name(func)
        if name is None:
            out = self._decomposed(func, args, kwargs)
            return func(*args, **kwargs) if out is NotImplemented else out
        if name not in CHECK_EFFECTS:
            raise self._refused(name)
        from torch.utils._python_dispatch import _pop_mode_temporarily

        plain_args, plain_kwargs = self._ctx.unwrap_tensors((args, kwargs))
        with _pop_mode_temporarily(torch._C._TorchDispatchModeKey.FUNCTIONAL):  # type: ignore[arg-type]
            out = func(*plain_args, **plain_kwargs)
        return self._ctx.wrap_tensors(out)

    def _decomposed(self, func: Any, args: Any, kwargs: Any) -> Any:
        """``func`` decomposed here where the FunctionalTensorMode would decompose it:
        a composite's own effectful calls (``linalg_inv`` checks ``linalg_inv_ex``'s
        ``info``) then pass this mode too, not only the FunctionalTensorMode."""
        from torch._subclasses.functional_tensor import FunctionalTensor

        if (
            not isinstance(func, torch._ops.OpOverload)
            or func in FunctionalTensor.metadata_fns
            or not torch._C._dispatch_has_kernel(func.name())  # type: ignore[no-untyped-call]
            or not self._ctx.mode._can_decompose(func, args, kwargs)
        ):
            return NotImplemented
        with self:
            return func.decompose(*args, **kwargs)

    def _where(self) -> str:
        """`` (file.py:12)`` of the user's callable; nothing for one Dynamo traced, whose source is lost."""
        fn = self._fn
        while hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        return "" if isinstance(fn, torch.fx.GraphModule) else f" ({describe_fn(fn)})"

    def _refused(self, name: str) -> Exception:
        return CompileUnsupported(
            format_message(
                self._op,
                f"{self._role}{self._where()} calls {name}, an op with an ordered side effect; "
                "hop's subgraphs carry no effect token, so its order could not be kept once functionalized "
                "(torch.compile, run_decompositions)",
                fix="Call it outside the operator, or run the program eagerly.",
            ),
            op=self._op,
            role=self._role,
        )


def functionalize_body(ctx: Any, fn: Callable[..., Any], op: str, role: str) -> Callable[..., Any]:
    """``ctx.functionalize(fn)`` for the functionalize rule of ``op``, whose callable
    ``role`` is ``fn``: under torch's Python functionalization (the one that threads
    effect tokens), effectful ops inside ``fn`` take no token (Note [effect tokens
    stay outside bodies]); C++ functionalization threads none."""
    from torch._subclasses.functional_tensor import PythonFunctionalizeAPI

    fn = keeping_node_meta(fn)
    body = fn
    if isinstance(ctx, PythonFunctionalizeAPI):

        def body(*args: Any, **kwargs: Any) -> Any:
            with _UntokenedChecks(ctx, op, role, fn):
                return fn(*args, **kwargs)

        body.__wrapped__ = fn  # type: ignore[attr-defined]
    functionalized: Callable[..., Any] = ctx.functionalize(body)
    return functionalized
