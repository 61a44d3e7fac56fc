"""The misuse catalog: what every operator and the framework say to a user mistake.

Each row of ``CASES`` is one mistake: a small call of ``x`` (a float tensor of
shape (3,)), the ``HopError`` subclass it must raise and a regex on the key parts
of the message (the operator, the argument or output at fault, what is wrong).
A row runs in the modes it lists, since an error raised inside a tracer or a
transform is where state leaks:

- ``e``: eager, ``call(x)``;
- ``f``: ``make_fx(call, tracing_mode="fake")``;
- ``v``: ``torch.vmap(call)`` over a batch of two;
- ``g``: ``torch.func.grad`` of the sum of the float outputs.

Rows whose expected class is not a HopError are the correct behaviour for that
call (a user function's own exception passes through unchanged). After every
test, ``no_leaked_state`` checks that torch's and hop's thread-local state is as
it was.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch._C import DispatchKey
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental import proxy_tensor
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

import hop
from hop import _fake_run, _operator, _reference, _spec, _unbacked, debug
from hop.errors import (
    HopError,
    HopRuntimeError,
    HopTypeError,
    HopValueError,
    MissingRuleError,
    MutationError,
    OutputMismatchError,
    UnknownOperatorError,
    UnsupportedModeError,
)

X = torch.tensor([0.5, -0.25, 1.0])  # sums to > 0: POS(X) takes true_fn
BATCH = torch.stack([X, -X])  # a batched POS or x[0] > 0 is [True, False]
I = lambda x: x  # noqa: E731, E741 (the identity branch, in almost every row)
POS = lambda x: x.sum() > 0  # noqa: E731 (a real, one-element bool pred)
ZERO = lambda x: (x.sum() * 0).long()  # noqa: E731 (an integer tensor index that is 0)
NP_TRUE = np.bool_(True)


def _with_config(name: str, value: Any, fn: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        previous = getattr(hop.config, name)
        setattr(hop.config, name, value)
        try:
            return fn()
        finally:
            setattr(hop.config, name, previous)

    return run


def _under_fake_mode(x: torch.Tensor) -> Any:
    # a tracing mode (other operators have rules for it) is never stepped over as a user mode is
    with FakeTensorMode() as mode:
        return _REGISTERING(I, mode.from_tensor(x))


_BARE = hop.HigherOrderOperator("misuse_bare")  # no rules at all
_REGISTERING = hop.HigherOrderOperator("misuse_registering")
_REGISTERING.py_impl(DispatchKey.CompositeExplicitAutograd)(lambda fn, x: fn(x))


def _unpickle_unknown() -> Any:
    op = hop.HigherOrderOperator("misuse_pickled")
    data = pickle.dumps(op)
    del _operator._REGISTRY["misuse_pickled"]  # as in a process that never defined it
    return pickle.loads(data)


def _check(*args: Any, **kwargs: Any) -> Any:
    return hop.testing.check(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    modes: str
    error: type[BaseException]
    match: str
    call: Callable[[torch.Tensor], Any]


C = Case
TE, VE, RE, OM = HopTypeError, HopValueError, HopRuntimeError, OutputMismatchError

CASES: list[Case] = [
    # --- cond: arguments
    C("cond-pred-str", "efvg", TE, r"^hop\.cond: pred must be .*got str",
      lambda x: hop.cond("yes", I, I, (x,))),
    C("cond-pred-none", "ef", TE, r"^hop\.cond: pred must be .*got NoneType",
      lambda x: hop.cond(None, I, I, (x,))),
    C("cond-pred-2-elements", "efg", VE, r"^hop\.cond: pred must have exactly one element, got shape \(3,\)",
      lambda x: hop.cond(x > 0, I, I, (x,))),
    C("cond-true_fn-int", "efvg", TE, r"^hop\.cond: true_fn must be callable, got int",
      lambda x: hop.cond(POS(x), 1, I, (x,))),
    C("cond-false_fn-none", "efvg", TE, r"^hop\.cond: false_fn must be callable, got NoneType",
      lambda x: hop.cond(POS(x), I, None, (x,))),
    C("cond-python-pred-fn-not-callable", "e", TE, r"^hop\.cond: true_fn must be callable, got str",
      lambda x: hop.cond(True, "f", I, (x,))),
    C("cond-operands-bare-tensor", "efvg", TE,
      r"^hop\.cond: operands must be a tuple or list, got Tensor\. Pass operands=\(x,\)",
      lambda x: hop.cond(POS(x), I, I, x)),
    C("cond-python-pred-bare-tensor", "efvg", TE, r"^hop\.cond: operands must be a tuple or list, got Tensor",
      lambda x: hop.cond(True, I, I, x)),
    C("cond-python-false-bare-tensor", "e", TE, r"^hop\.cond: operands must be a tuple or list, got Tensor",
      lambda x: hop.cond(False, I, I, x)),
    C("cond-numpy-pred-bare-tensor", "e", TE, r"^hop\.cond: operands must be a tuple or list, got Tensor",
      lambda x: hop.cond(NP_TRUE, I, I, x)),
    C("cond-operands-dict", "ef", TE, r"^hop\.cond: operands must be a tuple or list, got dict",
      lambda x: hop.cond(POS(x), I, I, {"a": x})),
    C("cond-operands-none", "e", TE, r"^hop\.cond: operands must be a tuple or list, got NoneType",
      lambda x: hop.cond(POS(x), I, I, None)),
    C("cond-operand-float", "efvg", TE, r"^hop\.cond: operands\[1\] must be a tensor or an int, got float",
      lambda x: hop.cond(POS(x), I, I, (x, 1.5))),
    C("cond-operand-bool", "ef", TE, r"^hop\.cond: operands\[1\] must be a tensor or an int, got bool",
      lambda x: hop.cond(POS(x), I, I, (x, True))),
    C("cond-operand-nested-str", "efg", TE, r"^hop\.cond: operands\[0\]\[1\] must be a tensor or an int, got str",
      lambda x: hop.cond(POS(x), I, I, ([x, "s"],))),
    C("cond-python-pred-operand-str", "e", TE, r"^hop\.cond: operands\[0\] must be a tensor or an int, got str",
      lambda x: hop.cond(True, I, I, ("s",))),
    # --- cond: what the branches return
    C("cond-dtype", "ef", OM, r"^hop\.cond: true_fn and false_fn disagree at output: dtype float32 vs float64",
      lambda x: hop.cond(POS(x), I, lambda a: a.double(), (x,))),
    C("cond-rank", "ef", OM, r"^hop\.cond: true_fn and false_fn disagree at output: rank 1 vs 2",
      lambda x: hop.cond(POS(x), I, lambda a: a[None], (x,))),
    C("cond-structure", "ef", OM, r"^hop\.cond: true_fn and false_fn return different structures: \(\*, \*\) vs \*",
      lambda x: hop.cond(POS(x), lambda a: (a, a), I, (x,))),
    C("cond-dict-keys", "ef", OM, r"^hop\.cond: .*different structures: \{'a': \*\} vs \{'b': \*\}",
      lambda x: hop.cond(POS(x), lambda a: {"a": a}, lambda a: {"b": a}, (x,))),
    C("cond-int-vs-tensor", "ef", OM, r"^hop\.cond: .*disagree at output: int vs Tensor",
      lambda x: hop.cond(POS(x), lambda a: 1, I, (x,))),
    C("cond-device", "e", OM, r"^hop\.cond: .*disagree at output: device cpu vs meta",
      lambda x: hop.cond(POS(x), I, lambda a: a.to("meta"), (x,))),
    C("cond-nested-path", "ef", OM, r'^hop\.cond: .*disagree at output\[1\]\["h"\]: dtype float32 vs int32',
      lambda x: hop.cond(POS(x), lambda a: (a, {"h": a}), lambda a: (a, {"h": a.int()}), (x,))),
    C("cond-returns-str", "ef", TE,
      r"^hop\.cond: true_fn \(.*\) returns str 's' at output\[1\]; branches return tensors and ints",
      lambda x: hop.cond(POS(x), lambda a: (a, "s"), lambda a: (a, "s"), (x,))),
    C("cond-returns-float", "ef", TE, r"^hop\.cond: true_fn \(.*\) returns float 1\.5 at output\[1\]",
      lambda x: hop.cond(POS(x), lambda a: (a, 1.5), lambda a: (a, 2.5), (x,))),
    C("cond-returns-bool", "ef", TE, r"^hop\.cond: true_fn \(.*\) returns bool True at output\[1\]",
      lambda x: hop.cond(POS(x), lambda a: (a, True), lambda a: (a, False), (x,))),
    C("cond-returns-dtype-object", "ef", TE, r"^hop\.cond: true_fn \(.*\) returns dtype torch\.float32 at output\[1\]",
      lambda x: hop.cond(POS(x), lambda a: (a, a.dtype), lambda a: (a, a.dtype), (x,))),
    C("cond-untaken-branch-fails", "e", RE,
      r"^hop\.cond: false_fn \(.*\) fails on the operands \(checked with fake tensors",
      lambda x: hop.cond(x.sum() < 100, I, lambda a: a @ torch.ones(5), (x,))),
    C("cond-batched-pred-sizes", "v", VE,
      r"^hop\.cond: under vmap with a batched selector .*must return equal sizes at output\[0\]: \(3,\) vs \(2,\)",
      lambda x: hop.cond(x[0] > 0, lambda a: a, lambda a: a[:2], (x,))),
    C("map-traced-writes-shared", "f", MutationError, r"^hop\.map: f \(.*\) writes x in place.*no fixed order",
      lambda x: hop.map(lambda r: x.add_(0).sum() + r, x)),
    C("cond-branch-arity", "efvg", TypeError, r"takes 0 positional arguments but 1 was given",
      lambda x: hop.cond(POS(x), lambda: x, lambda: x, (x,))),
    # --- switch
    C("switch-index-str", "efvg", TE,
      r"^hop\.switch: index must be an int, a SymInt or a one-element integer tensor, got str",
      lambda x: hop.switch("0", [I, I], (x,))),
    C("switch-index-float", "ef", TE, r"^hop\.switch: index must be .*got float",
      lambda x: hop.switch(0.0, [I, I], (x,))),
    C("switch-index-bool", "ef", TE, r"^hop\.switch: index must be .*got bool",
      lambda x: hop.switch(True, [I, I], (x,))),
    C("switch-index-numpy-bool", "efvg", TE, r"^hop\.switch: index must be .*got numpy\.bool",
      lambda x: hop.switch(NP_TRUE, [I, I], (x,))),
    C("switch-index-numpy-int", "e", TE, r"^hop\.switch: index must be .*got numpy\.int64",
      lambda x: hop.switch(np.int64(0), [I, I], (x,))),
    C("switch-index-float-tensor", "efvg", TE, r"^hop\.switch: index must be an integer tensor, got dtype float32",
      lambda x: hop.switch(x.sum(), [I, I], (x,))),
    C("switch-index-bool-tensor", "efvg", TE, r"^hop\.switch: index must be an integer tensor, got dtype bool",
      lambda x: hop.switch(POS(x), [I, I], (x,))),
    C("switch-index-2-elements", "efg", VE, r"^hop\.switch: index must have exactly one element, got shape \(2,\)",
      lambda x: hop.switch(torch.tensor([0, 1]), [I, I], (x,))),
    C("switch-index-out-of-range", "efvg", VE,
      r"^hop\.switch: index 2 is out of range for 2 branches\. Pass an index in \[0, 1\]",
      lambda x: hop.switch(2, [I, I], (x,))),
    C("switch-index-negative", "ef", VE, r"^hop\.switch: index -1 is out of range for 2 branches",
      lambda x: hop.switch(-1, [I, I], (x,))),
    C("switch-tensor-index-out-of-range", "efg", VE, r"^hop\.switch: index 5 is out of range for 2 branches",
      lambda x: hop.switch(torch.tensor(5), [I, I], (x,))),
    C("switch-batched-index-out-of-range", "v", VE,
      r"^hop\.switch: index [23] \(of a batch\) is out of range for 2 branches",
      lambda x: hop.switch((x[0] > 0).long() + 2, [I, I], (x,))),
    C("switch-no-branches", "efvg", VE,
      r"^hop\.switch: branches must be a non-empty list or tuple of callables, got \[\]",
      lambda x: hop.switch(0, [], (x,))),
    C("switch-branches-a-function", "ef", VE, r"^hop\.switch: branches must be a non-empty list or tuple",
      lambda x: hop.switch(0, I, (x,))),
    C("switch-branch-not-callable", "efvg", TE, r"^hop\.switch: branches\[1\] must be callable, got int",
      lambda x: hop.switch(ZERO(x), [I, 3], (x,))),
    C("switch-int-index-branch-not-callable", "e", TE, r"^hop\.switch: branches\[1\] must be callable, got NoneType",
      lambda x: hop.switch(0, [I, None], (x,))),
    C("switch-operands-bare-tensor", "efvg", TE, r"^hop\.switch: operands must be a tuple or list, got Tensor",
      lambda x: hop.switch(ZERO(x), [I, I], x)),
    C("switch-int-index-bare-tensor", "efvg", TE, r"^hop\.switch: operands must be a tuple or list, got Tensor",
      lambda x: hop.switch(0, [I, I], x)),
    C("switch-int-index-operand-str", "e", TE, r"^hop\.switch: operands\[0\] must be a tensor or an int, got str",
      lambda x: hop.switch(1, [I, I], ("s",))),
    C("switch-operands-set", "e", TE, r"^hop\.switch: operands must be a tuple or list, got set",
      lambda x: hop.switch(ZERO(x), [I, I], {1})),
    C("switch-dtype", "ef", OM,
      r"^hop\.switch: branches\[0\] and branches\[2\] disagree at output: dtype float32 vs int32",
      lambda x: hop.switch(ZERO(x), [I, I, lambda a: a.int()], (x,))),
    C("switch-structure", "ef", OM, r"^hop\.switch: branches\[0\] and branches\[1\] return different structures",
      lambda x: hop.switch(ZERO(x), [I, lambda a: [a]], (x,))),
    C("switch-returns-str", "ef", TE, r"^hop\.switch: branches\[0\] \(.*\) returns str 's' at output\[1\]",
      lambda x: hop.switch(ZERO(x), [lambda a: (a, "s"), lambda a: (a, "t")], (x,))),
    C("switch-batched-sizes", "v", VE, r"^hop\.switch: under vmap with a batched selector",
      lambda x: hop.switch((x[0] > 0).long(), [lambda a: a, lambda a: a[:1]], (x,))),
    # --- while_loop
    C("while-cond_fn-none", "efvg", TE, r"^hop\.while_loop: cond_fn must be callable, got NoneType",
      lambda x: hop.while_loop(None, I, (x,))),
    C("while-body_fn-str", "ef", TE, r"^hop\.while_loop: body_fn must be callable, got str",
      lambda x: hop.while_loop(lambda a: False, "b", (x,))),
    C("while-carry-bare-tensor", "efvg", TE,
      r"^hop\.while_loop: carried_inputs must be a tuple or list, got Tensor\. Pass carried_inputs=\(x,\)",
      lambda x: hop.while_loop(lambda a: a.sum() < 3, I, x)),
    C("while-carry-str", "efvg", TE, r"^hop\.while_loop: carried_inputs\[1\] must be a tensor or an int, got str",
      lambda x: hop.while_loop(lambda a, s: False, lambda a, s: (a, s), (x, "s"))),
    C("while-carry-float", "ef", TE, r"^hop\.while_loop: carried_inputs\[1\] must be a tensor or an int, got float",
      lambda x: hop.while_loop(lambda a, s: False, lambda a, s: (a, s), (x, 1.0))),
    C("while-carry-numpy-bool", "efvg", TE,
      r"^hop\.while_loop: carried_inputs\[1\] must be a tensor or an int, got numpy\.bool",
      lambda x: hop.while_loop(lambda a, s: False, lambda a, s: (a, s), (x, NP_TRUE))),
    C("while-cond-2-elements", "efg", TE,
      r"^hop\.while_loop: cond_fn( \(.*\))? must return a Python bool or .*got a tensor of dtype bool and shape \(3,\)",
      lambda x: hop.while_loop(lambda a: a < 3, lambda a: a + 1, (x,))),
    C("while-cond-float", "ef", TE,
      r"^hop\.while_loop: cond_fn \(.*\) must return .*got a tensor of dtype float32 and shape \(\)",
      lambda x: hop.while_loop(lambda a: a.sum(), lambda a: a + 1, (x,))),
    C("while-cond-str", "e", TE, r"^hop\.while_loop: cond_fn \(.*\) must return .*got str",
      lambda x: hop.while_loop(lambda a: "yes", lambda a: a + 1, (x,))),
    C("while-body-dtype", "efvg", OM,
      r"^hop\.while_loop: carried_inputs and body_fn disagree at carry\[0\]: dtype float32 vs float64",
      lambda x: hop.while_loop(lambda a: a.sum() < 3, lambda a: a.double() + 1, (x,))),
    C("while-body-structure", "efg", OM,
      r"^hop\.while_loop: carried_inputs and body_fn return different structures: \(\*,\) vs \(\*, \*\)",
      lambda x: hop.while_loop(lambda a: a.sum() < 3, lambda a: (a + 1, a), (x,))),
    C("while-body-rank", "ef", OM, r"^hop\.while_loop: .*disagree at carry\[0\]: rank 1 vs 2",
      lambda x: hop.while_loop(lambda a: a.sum() < 3, lambda a: (a + 1)[None], (x,))),
    # traced, a body that mixes an int carry with tensors is given its int carries as
    # tensors (Note [int carries in a traced condition]): a tensor returned for one is
    # then read back with .item(), the same value, and is not refused there
    C("while-body-int-to-tensor", "e", OM, r"^hop\.while_loop: .*disagree at carry\[0\]: int vs Tensor",
      lambda x: hop.while_loop(lambda i, a: i < 3, lambda i, a: (torch.tensor(i + 1), a), (0, x))),
    C("while-checkpoint-str", "efvg", TE, r"^hop\.while_loop: checkpoint must be True or False, got str 'no'",
      lambda x: hop.while_loop(lambda a: a.sum() < 3, lambda a: a + 1, (x,), checkpoint="no")),
    C("while-checkpoint-int", "e", TE, r"^hop\.while_loop: checkpoint must be True or False, got int 1",
      lambda x: hop.while_loop(lambda a: a.sum() < 3, lambda a: a + 1, (x,), checkpoint=1)),
    C("while-traced-inplace", "f", MutationError, r"^hop\.while_loop: body_fn \(.*\) writes carry 0 in place.*anot",
      lambda x: hop.while_loop(lambda a: a.sum() < 3, lambda a: a.add_(1) * 1, (x.clone(),))),
    # --- fori_loop
    C("fori-lower-float", "efvg", TE,
      r"^hop\.fori_loop: lower must be an int, a SymInt or an integer tensor, got float",
      lambda x: hop.fori_loop(0.5, 3, lambda i, v: v, x)),
    C("fori-upper-bool", "ef", TE, r"^hop\.fori_loop: upper must be an int, .*got bool",
      lambda x: hop.fori_loop(0, True, lambda i, v: v, x)),
    C("fori-upper-numpy-bool", "ef", TE, r"^hop\.fori_loop: upper must be an int, .*got numpy\.bool",
      lambda x: hop.fori_loop(0, NP_TRUE, lambda i, v: v, x)),
    C("fori-upper-str", "e", TE, r"^hop\.fori_loop: upper must be an int, .*got str",
      lambda x: hop.fori_loop(0, "3", lambda i, v: v, x)),
    C("fori-upper-float-tensor", "efvg", TE, r"^hop\.fori_loop: upper must be an integer tensor, got dtype float32",
      lambda x: hop.fori_loop(0, x.sum(), lambda i, v: v, x)),
    C("fori-upper-bool-tensor", "efvg", TE, r"^hop\.fori_loop: upper must be an integer tensor, got dtype bool",
      lambda x: hop.fori_loop(0, POS(x), lambda i, v: v, x)),
    C("fori-lower-float-tensor", "ef", TE, r"^hop\.fori_loop: lower must be an integer tensor, got dtype float32",
      lambda x: hop.fori_loop(torch.tensor(0.0), 3, lambda i, v: v, x)),
    C("fori-upper-2-elements", "efvg", VE, r"^hop\.fori_loop: upper must have exactly one element, got shape \(2,\)",
      lambda x: hop.fori_loop(0, torch.tensor([1, 2]), lambda i, v: v, x)),
    C("fori-lower-2-elements", "ef", VE, r"^hop\.fori_loop: lower must have exactly one element",
      lambda x: hop.fori_loop(torch.tensor([0, 1]), 3, lambda i, v: v, x)),
    C("fori-body_fn-none", "efvg", TE, r"^hop\.fori_loop: body_fn must be callable, got NoneType",
      lambda x: hop.fori_loop(0, 3, None, x)),
    C("fori-init-str", "efvg", TE, r"^hop\.fori_loop: init_val\[1\] must be a tensor or an int, got str",
      lambda x: hop.fori_loop(0, 3, lambda i, v: v, (x, "s"))),
    C("fori-body-dtype", "efvg", OM, r"^hop\.fori_loop: init_val and body_fn disagree at val: dtype float32 vs float64",
      lambda x: hop.fori_loop(0, 3, lambda i, v: v.double(), x)),
    C("fori-tensor-bound-body-dtype", "efvg", OM,
      r"^hop\.fori_loop: init_val and body_fn disagree at val: dtype float32 vs float64",
      lambda x: hop.fori_loop(0, torch.tensor(3), lambda i, v: v.double(), x)),
    C("fori-tensor-bound-body-structure", "efg", OM,
      r"^hop\.fori_loop: init_val and body_fn return different structures: \* vs \(\*, \*\)",
      lambda x: hop.fori_loop(torch.tensor(0), 3, lambda i, v: (v, v), x)),
    # --- map
    C("map-f-none", "efvg", TE, r"^hop\.map: f must be callable, got NoneType",
      lambda x: hop.map(None, x[None])),
    C("map-xs-scalar", "efvg", VE, r"^hop\.map: xs: dim 0 is out of range for a tensor of rank 0",
      lambda x: hop.map(I, x.sum())),
    C("map-xs-empty", "ef", VE, r"^hop\.map: xs must contain at least one tensor",
      lambda x: hop.map(I, ())),
    C("map-xs-str", "e", TE, r"^hop\.map: xs: must be a tensor, got str",
      lambda x: hop.map(I, "abc")),
    C("map-xs-lengths", "efvg", VE, r"^hop\.map: xs\[1\]: has length 2 along dim 0, but xs\[0\] has length 3",
      lambda x: hop.map(lambda a: a[0], (x, x[:2]))),
    C("map-args-str", "efvg", TE, r"^hop\.map: args\[0\]: must be a tensor or an int, got str",
      lambda x: hop.map(lambda a, s: a, x, "s")),
    C("map-args-numpy-bool", "ef", TE, r"^hop\.map: args\[0\]: must be a tensor or an int, got numpy\.bool",
      lambda x: hop.map(lambda a, s: a, x, NP_TRUE)),
    C("map-returns-str", "efvg", VE, r"^hop\.map: f: output\[1\]: must be a tensor, got str",
      lambda x: hop.map(lambda a: (a, "s"), x)),
    C("map-returns-int", "ef", VE, r"^hop\.map: f: output\[1\]: must be a tensor, got int",
      lambda x: hop.map(lambda a: (a, 1), x)),
    C("map-empty-data-dependent", "e", RE,
      r"^hop\.map: xs has length 0, and f \(.*\) returns output of a data-dependent shape \(u\d+,\)",
      lambda x: hop.map(lambda a: a[a > 0], x[:0, None])),
    C("map-empty-data-dependent-dict", "e", RE,
      r'^hop\.map: xs has length 0, and f \(.*\) returns output\["k"\] of a data-dependent shape',
      lambda x: hop.map(lambda a: {"k": a.nonzero()}, x[:0, None])),
    C("map-empty-item", "e", RE, r"^hop\.map: xs has length 0, .*fails on fake tensors",
      lambda x: hop.map(lambda a: torch.zeros(int(a.sum())), x[:0, None])),
    C("map-f-raises", "efvg", RuntimeError, r"^both arguments to matmul need to be at least 1D",
      lambda x: hop.map(lambda a: a @ torch.ones(7), x)),
    # --- scan
    C("scan-combine_fn-none", "efvg", TE, r"^hop\.scan: combine_fn must be callable, got NoneType",
      lambda x: hop.scan(None, x[0], x)),
    C("scan-dim-str", "ef", TE, r"^hop\.scan: dim must be an int, got str",
      lambda x: hop.scan(lambda c, a: (c, a), x[0], x, dim="0")),
    C("scan-dim-out-of-range", "efvg", VE, r"^hop\.scan: xs: dim 3 is out of range for a tensor of rank 1",
      lambda x: hop.scan(lambda c, a: (c, a), x[0], x, dim=3)),
    C("scan-reverse-str", "ef", TE, r"^hop\.scan: reverse must be a bool, got str",
      lambda x: hop.scan(lambda c, a: (c, a), x[0], x, reverse="yes")),
    C("scan-reverse-numpy-bool", "e", TE, r"^hop\.scan: reverse must be a bool, got numpy\.bool",
      lambda x: hop.scan(lambda c, a: (c, a), x[0], x, reverse=NP_TRUE)),
    C("scan-not-a-pair", "efvg", TE, r"^hop\.scan: combine_fn must return a \(next_carry, y\) pair, got Tensor",
      lambda x: hop.scan(lambda c, a: c, x[0], x)),
    C("scan-triple", "ef", TE, r"^hop\.scan: combine_fn must return a \(next_carry, y\) pair, got a tuple of length 3",
      lambda x: hop.scan(lambda c, a: (c, a, a), x[0], x)),
    C("scan-carry-dtype", "efvg", OM,
      r"^hop\.scan: combine_fn: carry: init and next_carry differ: dtype float32 vs float64",
      lambda x: hop.scan(lambda c, a: (c.double(), a), x[0], x)),
    C("scan-carry-shape", "ef", OM, r"^hop\.scan: combine_fn: carry: init and next_carry differ: rank 0 vs 1",
      lambda x: hop.scan(lambda c, a: (c[None], a), x[0], x)),
    C("scan-carry-structure", "efg", OM,
      r"^hop\.scan: combine_fn: carry: init and next_carry differ: structure \* vs \(\*, \*\)",
      lambda x: hop.scan(lambda c, a: ((c, c), a), x[0], x)),
    C("scan-init-str", "ef", TE, r"^hop\.scan: init: must be a tensor, got str",
      lambda x: hop.scan(lambda c, a: (c, a), "s", x)),
    C("scan-init-int", "e", TE, r"^hop\.scan: init: must be a tensor, got int",
      lambda x: hop.scan(lambda c, a: (c, a), 1, x)),
    C("scan-y-str", "efvg", VE, r"^hop\.scan: combine_fn: y: must be a tensor, got str",
      lambda x: hop.scan(lambda c, a: (c, "s"), x[0], x)),
    C("scan-empty-data-dependent", "e", RE,
      r"^hop\.scan: xs has length 0, and combine_fn \(.*\) returns y of a data-dependent shape",
      lambda x: hop.scan(lambda c, a: (c, a[a > 0]), x[0], x[:0, None])),
    # --- associative_scan
    C("ascan-combine_fn-int", "efvg", TE, r"^hop\.associative_scan: combine_fn must be callable, got int",
      lambda x: hop.associative_scan(3, x, 0)),
    C("ascan-combine_mode", "efvg", VE,
      r"^hop\.associative_scan: combine_mode must be \"pointwise\" or \"generic\", got 'fast'",
      lambda x: hop.associative_scan(torch.add, x, 0, combine_mode="fast")),
    C("ascan-reverse-str", "ef", TE, r"^hop\.associative_scan: reverse must be a bool, got str",
      lambda x: hop.associative_scan(torch.add, x, 0, reverse="no")),
    C("ascan-reverse-numpy-bool", "e", TE, r"^hop\.associative_scan: reverse must be a bool, got numpy\.bool",
      lambda x: hop.associative_scan(torch.add, x, 0, reverse=NP_TRUE)),
    C("ascan-dim-str", "ef", TE, r"^hop\.associative_scan: dim must be an int, got str",
      lambda x: hop.associative_scan(torch.add, x, "0")),
    C("ascan-dim-out-of-range", "efvg", VE, r"^hop\.associative_scan: xs: dim 5 is out of range for a tensor of rank 1",
      lambda x: hop.associative_scan(torch.add, x, 5)),
    C("ascan-xs-scalar", "ef", VE, r"^hop\.associative_scan: xs: dim 0 is out of range for a tensor of rank 0",
      lambda x: hop.associative_scan(torch.add, x.sum(), 0)),
    C("ascan-xs-str", "e", TE, r"^hop\.associative_scan: xs: must be a tensor, got str",
      lambda x: hop.associative_scan(torch.add, "abc", 0)),
    C("ascan-xs-empty", "e", VE, r"^hop\.associative_scan: xs must contain at least one tensor",
      lambda x: hop.associative_scan(torch.add, (), 0)),
    C("ascan-xs-lengths", "ef", VE,
      r"^hop\.associative_scan: xs\[1\]: has length 2 along dim 0, but xs\[0\] has length 3",
      lambda x: hop.associative_scan(lambda a, b: a, (x, x[:2]), 0)),
    C("ascan-dtype", "efvg", OM,
      r"^hop\.associative_scan: combine_fn: output: xs and the output differ: dtype float32 vs float64",
      lambda x: hop.associative_scan(lambda a, b: (a + b).double(), x, 0)),
    C("ascan-rank", "evg", OM, r"^hop\.associative_scan: combine_fn: output: xs and the output differ: rank 1 vs 0",
      lambda x: hop.associative_scan(lambda a, b: (a + b).sum(), x, 0)),
    C("ascan-structure", "efg", OM,
      r"^hop\.associative_scan: combine_fn: output: xs and the output differ: structure \* vs \(\*, \*\)",
      lambda x: hop.associative_scan(lambda a, b: (a + b, a), x, 0)),
    C("ascan-returns-int", "ef", OM,
      r"^hop\.associative_scan: combine_fn: output: xs and the output differ: Tensor vs int",
      lambda x: hop.associative_scan(lambda a, b: 1, x, 0)),
    # --- the framework: HigherOrderOperator, rules, modes, pickling
    C("op-name-int", "e", VE, r"^hop\.HigherOrderOperator: name must be a Python identifier, got 3",
      lambda x: hop.HigherOrderOperator(3)),  # type: ignore[arg-type]
    C("op-name-space", "e", VE, r"^hop\.HigherOrderOperator: name must be a Python identifier, got 'a b'",
      lambda x: hop.HigherOrderOperator("a b")),
    C("op-name-hops-cond", "e", VE,
      r"^hop\.HigherOrderOperator: the name 'cond' is hop's own torch\.ops\.hop\.cond.*Choose another name",
      lambda x: hop.HigherOrderOperator("cond")),
    C("op-name-hops-scan", "e", VE, r"^hop\.HigherOrderOperator: the name 'scan' is hop's own",
      lambda x: hop.HigherOrderOperator("scan")),
    C("op-py_impl-str", "e", TE, r"^hop\.misuse_registering: py_impl takes a DispatchKey, .*got str",
      lambda x: _REGISTERING.py_impl("CPU")),  # type: ignore[arg-type]
    C("op-py_impl-twice", "e", VE,
      r"^hop\.misuse_registering: a rule for DispatchKey\.CompositeExplicitAutograd is already registered",
      lambda x: _REGISTERING.py_impl(DispatchKey.CompositeExplicitAutograd)),
    C("op-py_impl-python-key", "e", VE,
      r"^hop\.misuse_registering: py_impl\(DispatchKey\.Python\): .*Register py_impl\(YourMode\)",
      lambda x: _REGISTERING.py_impl(DispatchKey.Python)),
    C("op-py_impl-not-callable", "e", TE,
      r"^hop\.misuse_registering: py_impl\(DispatchKey\.Meta\) registers a function, got int",
      lambda x: _REGISTERING.py_impl(DispatchKey.Meta)(3)),
    C("op-no-kernel", "e", MissingRuleError,
      r"^hop\.misuse_bare: has no kernel for dispatch key CPU\. Register one with .*misuse_bare\.py_impl",
      lambda x: _BARE(I, x)),
    C("op-no-autograd-rule", "e", MissingRuleError,
      r"^hop\.misuse_bare: has no autograd rule for dispatch key AutogradCPU",
      lambda x: _BARE(I, x.requires_grad_())),
    C("op-no-vmap-rule", "v", MissingRuleError, r"^hop\.misuse_bare: has no rule for the functorch transform Vmap",
      lambda x: _BARE(I, x)),
    C("op-no-grad-rule", "g", MissingRuleError, r"^hop\.misuse_bare: has no rule for the functorch transform Grad",
      lambda x: _BARE(I, x)),
    C("op-no-fake-rule", "f", UnsupportedModeError,
      r"^hop\.misuse_registering: the active TorchDispatchMode ProxyTorchDispatchMode has no rule",
      lambda x: _REGISTERING(I, x)),
    C("mode-tracing-without-a-rule", "e", UnsupportedModeError,
      r"^hop\.misuse_registering: the active TorchDispatchMode FakeTensorMode has no rule for this operator",
      lambda x: _under_fake_mode(x)),
    C("pickle-unknown-op", "e", UnknownOperatorError,
      r"^hop\.misuse_pickled: a pickled program refers to the operator torch\.ops\.hop\.misuse_pickled, "
      r"which is not defined in this process.*Import the module",
      lambda x: _unpickle_unknown()),
    # --- the raw operators: a bare tensor where a tuple goes was unpacked row by row
    C("op-raw-cond-operands-tensor", "efvg", TE,
      r"^hop\.cond: operands of torch\.ops\.hop\.cond must be a tuple or list, got Tensor\. Pass operands=\(x,\)",
      lambda x: torch.ops.hop.cond(POS(x), I, I, x.reshape(1, -1))),
    C("op-raw-switch-operands-tensor", "ef", TE,
      r"^hop\.switch: operands of torch\.ops\.hop\.switch must be a tuple or list, got Tensor",
      lambda x: torch.ops.hop.switch(torch.tensor(0), [I, I], x.reshape(1, -1))),
    C("op-raw-while-carried-tensor", "ef", TE,
      r"^hop\.while_loop: carried_inputs of torch\.ops\.hop\.while_loop must be a tuple or list, got Tensor",
      lambda x: torch.ops.hop.while_loop(lambda a: a.sum() < 0, I, x.reshape(1, -1), ())),
    C("op-raw-map-xs-tensor", "ef", TE,
      r"^hop\.map: xs of torch\.ops\.hop\.map must be a tuple or list, got Tensor",
      lambda x: torch.ops.hop.map(I, x.reshape(1, -1), ())),
    C("op-raw-scan-init-tensor", "ef", TE,
      r"^hop\.scan: init of torch\.ops\.hop\.scan must be a tuple or list, got Tensor",
      lambda x: torch.ops.hop.scan(lambda c, r: (c, r), x, (x.reshape(1, -1),), (), False)),
    C("op-raw-ascan-additional-tensor", "ef", TE,
      r"^hop\.associative_scan: additional_inputs of torch\.ops\.hop\.associative_scan must be a tuple",
      lambda x: torch.ops.hop.associative_scan(torch.add, (x,), x, "generic")),
    C("torch-ops-hop-unknown", "e", AttributeError,
      r"^torch\.ops\.hop has no operator 'misuse_nope'; known hop operators: .*cond",
      lambda x: torch.ops.hop.misuse_nope),
    # --- hop.config
    C("config-validate-unknown", "e", VE,
      r"^hop\.config: validate must be \"once\", \"always\" or \"never\", got 'sometimes'",
      lambda x: _with_config("validate", "sometimes", lambda: hop.cond(POS(x), I, lambda a: a + 1, (x,)))()),
    C("config-validate-bool", "e", VE, r"^hop\.config: validate must be .*got True",
      lambda x: _with_config("validate", True, lambda: hop.while_loop(lambda a: a.sum() < 0, I, (x,)))()),
    C("config-validate-never-still-checks-arguments", "e", TE, r"^hop\.cond: operands must be a tuple or list",
      lambda x: _with_config("validate", "never", lambda: hop.cond(POS(x), I, I, x))()),
    # --- hop.testing
    C("check-fn-none", "e", TE, r"^hop\.testing\.check: fn must be callable, got NoneType",
      lambda x: _check(None, x)),
    C("check-fn-int", "e", TE, r"^hop\.testing\.check: fn must be callable, got int",
      lambda x: _check(3, x)),
    C("check-reference-int", "e", TE, r"^hop\.testing\.check: reference must be callable, got int",
      lambda x: _check(I, x, reference=3)),
    C("check-transforms-str", "e", TE,
      r"^hop\.testing\.check: transforms must be a sequence of names, got 'eager'\. Pass \('eager',\)",
      lambda x: _check(I, x, transforms="eager")),
    C("check-transforms-unknown", "e", VE, r"^hop\.testing\.check: unknown transform 'eagre'\. Choose from eager, ",
      lambda x: _check(I, x, transforms=("eagre",))),
    C("check-skip-unknown", "e", VE, r"^hop\.testing\.check: unknown transform 'vmpa'",
      lambda x: _check(I, x, skip={"vmpa": "why"})),
    C("check-skip-list", "e", TE, r"^hop\.testing\.check: skip must be a mapping .*got list",
      lambda x: _check(I, x, transforms=("eager",), skip=["eager"])),
    C("check-rtol-alone", "e", VE, r"^hop\.testing\.check: rtol and atol go together",
      lambda x: _check(I, x, transforms=("eager",), rtol=1e-3)),
    C("check-batch-size-0", "e", VE, r"^hop\.testing\.check: batch_size must be a positive int, got 0",
      lambda x: _check(I, x, transforms=("vmap",), batch_size=0)),
    C("check-finds-a-wrong-program", "e", hop.testing.CheckFailure, r"^hop\.testing\.check: eager",
      lambda x: _check(lambda a: hop.cond(POS(a), I, I, (a,)), x, reference=lambda a: a + 1, transforms=("eager",))),
]  # fmt: skip


def _scalar(out: Any, x: torch.Tensor) -> torch.Tensor:
    floats = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum((t.sum() for t in floats), x.sum() * 0)


RUNNERS: dict[str, Callable[[Case], Any]] = {
    "e": lambda case: case.call(X.clone()),
    "f": lambda case: make_fx(case.call, tracing_mode="fake")(X.clone()),
    "v": lambda case: torch.vmap(case.call)(BATCH.clone()),
    "g": lambda case: torch.func.grad(lambda x: _scalar(case.call(x), x))(X.clone()),
}
MODE_NAMES = {"e": "eager", "f": "make_fx", "v": "vmap", "g": "grad"}


@pytest.mark.parametrize(
    ("case", "mode"),
    [pytest.param(case, mode, id=f"{case.id}-{MODE_NAMES[mode]}") for case in CASES for mode in case.modes],
)
def test_misuse(case: Case, mode: str) -> None:
    with pytest.raises(case.error, match=case.match) as info:
        RUNNERS[mode](case)
    if not issubclass(case.error, HopError):  # correct behaviour: passed through, not wrapped
        assert not isinstance(info.value, HopError)


def test_the_catalog_covers_every_operator_and_the_framework() -> None:
    ids = [case.id for case in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 100
    groups = ("cond", "switch", "while", "fori", "map", "scan", "ascan", "op", "mode", "pickle", "config", "check")
    for prefix in groups:
        assert any(i.startswith(prefix + "-") for i in ids), prefix
    assert sum("f" in case.modes for case in CASES) >= 40
    assert sum("v" in case.modes or "g" in case.modes for case in CASES) >= 40


# --- fixed internal errors whose check needs more than one call ---------------------------------


def test_checkpointed_loop_gives_a_first_order_gradient_and_refuses_a_second() -> None:
    w = torch.tensor([0.5, -0.3], dtype=torch.float64, requires_grad=True)
    body = lambda i, v: (i + 1, v * w)  # noqa: E731
    ones = torch.ones(2, dtype=torch.float64)
    plain = torch.autograd.grad(hop.while_loop(lambda i, v: i < 3, body, (0, ones))[1].sum(), w)[0]
    out = hop.while_loop(lambda i, v: i < 3, body, (0, ones), checkpoint=True)[1]
    (g,) = torch.autograd.grad(out.sum(), w, create_graph=True)
    torch.testing.assert_close(g, plain)  # the first order is unchanged by create_graph
    with pytest.raises(HopRuntimeError, match=r"^hop\.while_loop: .*checkpoint=True is first-order only.*=False"):
        torch.autograd.grad(g.sum(), w)


def test_the_raw_while_loop_refuses_a_checkpoint_that_is_not_a_bool() -> None:
    from hop.ops.while_loops.while_loop import while_loop_op

    x = torch.ones(2, requires_grad=True)
    with pytest.raises(HopTypeError, match=r"^hop\.while_loop: checkpoint must be True or False, got str 'no'"):
        while_loop_op(lambda v: v.sum() < 4, lambda v: (v * 2,), (x,), (), checkpoint="no")


def test_vmap_of_grad_with_a_batched_pred_and_an_integer_output() -> None:
    def loss(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        out = hop.cond(p, lambda a: (a.sin(), a.argmax()), lambda a: (a.cos(), a.argmin()), (x,))
        return out[0].sum()

    g = torch.vmap(torch.func.grad(loss, argnums=1))(torch.tensor([True, False]), BATCH)
    torch.testing.assert_close(g, torch.stack([BATCH[0].cos(), -BATCH[1].sin()]))


def test_a_mode_that_runs_hops_ops_as_usual() -> None:
    class Runs(TorchDispatchMode):  # what the NotImplemented error suggests
        supports_higher_order_operators = True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    with Runs():
        out = hop.cond(POS(X), lambda a: a + 1, lambda a: a - 1, (X,))
    torch.testing.assert_close(out, X + 1)


def test_branches_may_return_none_and_ints() -> None:
    def fn(x: torch.Tensor) -> Any:
        return hop.switch(ZERO(x), [lambda a: (a + 1, None, 2), lambda a: (a - 1, None, 3)], (x,))

    eager = fn(X)
    traced = make_fx(fn, tracing_mode="fake")(X)(X)
    assert eager[1] is None and traced[1] is None and eager[2] == 2
    torch.testing.assert_close(traced[0], X + 1)


def test_a_constant_switch_index_in_range_traces() -> None:
    gm = make_fx(lambda x: hop.switch(torch.tensor(1), [I, lambda a: a * 2], (x,)), tracing_mode="fake")(X)
    torch.testing.assert_close(gm(X), X * 2)


def test_the_names_refused_are_exactly_hops_own_operators() -> None:
    import importlib
    import pkgutil

    import hop.ops

    own = set()
    for info in pkgutil.walk_packages(hop.ops.__path__, "hop.ops."):
        module = importlib.import_module(info.name)
        own |= {v.name() for v in vars(module).values() if isinstance(v, hop.HigherOrderOperator)}
    assert own == {s.name for s in _spec.specs() if _operator._own(s.name)} | _operator._OWN_DECOMPOSED
    assert all(_operator._own(name) for name in own)
    with pytest.raises(HopValueError, match="hop's own"):
        hop.HigherOrderOperator("bounded_while")
    mine = hop.HigherOrderOperator("misuse_redefined")
    assert hop.HigherOrderOperator("misuse_redefined") is not mine  # a user op may be redefined


# --- the state every misuse must leave as it found it ----------------------------------------


def _state() -> dict[str, object]:
    """torch's dispatch and transform state, and hop's own thread-local state."""
    return {
        "dispatch mode stack": torch._C._len_torch_dispatch_stack(),
        "pre-dispatch mode stack": torch._ops._len_torch_dispatch_stack_pre_dispatch(),
        "PreDispatch key included": torch._C._dispatch_tls_is_dispatch_key_included(DispatchKey.PreDispatch),
        "TLS include set": str(torch._C._dispatch_tls_local_include_set()),
        "TLS exclude set": str(torch._C._dispatch_tls_local_exclude_set()),
        "torch-function mode enabled": torch._C._is_torch_function_mode_enabled(),
        "torch-function mode stack": len(torch.overrides._get_current_function_mode_stack()),
        "functorch level": torch._C._functorch.maybe_current_level(),
        "grad mode": torch.is_grad_enabled(),
        "fwd grad mode": torch._C._is_fwd_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "make_fx tracer": proxy_tensor._CURRENT_MAKE_FX_TRACER,
        "jit tracing state": torch._C._get_tracing_state(),
        "autocast cache": torch.is_autocast_cache_enabled(),
        "hop reference threads": _reference.ACTIVE,
        "hop reference here": _reference.here(),
        "hop validation depth": getattr(_fake_run._LOCAL, "depth", 0),
        "hop unbacked recording": len(_unbacked._RECORDING),
        "hop debug sinks": len(debug.SINKS),
    }


@pytest.fixture(autouse=True)
def no_leaked_state() -> Iterator[None]:
    before = _state()
    yield
    after = _state()
    assert after == before, {k: (before[k], after[k]) for k in before if before[k] != after[k]}
