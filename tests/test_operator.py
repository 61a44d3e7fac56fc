"""hop.HigherOrderOperator: identity, registration, the torch.ops.hop namespace."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from apply_op import apply
from torch._C import DispatchKey
from torch._C._functorch import TransformType
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

import hop
from hop.errors import HopTypeError, HopValueError


def test_is_a_torch_higher_order_operator() -> None:
    assert isinstance(apply, torch._ops.HigherOrderOperator)
    assert isinstance(apply, hop.HigherOrderOperator)
    assert apply.name() == "test_apply"
    assert apply.namespace == "hop"


def test_lives_at_torch_ops_hop() -> None:
    assert torch.ops.hop.test_apply is apply
    assert "test_apply" in dir(torch.ops.hop)
    assert hop.registered_ops()["test_apply"] is apply
    assert repr(apply) == "torch.ops.hop.test_apply"


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(
        AttributeError, match=r"torch.ops.hop has no operator 'nope'; known hop operators: .*test_apply"
    ):
        torch.ops.hop.nope  # noqa: B018
    assert not hasattr(torch.ops.hop, "nope")


def test_does_not_replace_torchs_operator_of_the_same_name() -> None:
    torch_op = torch.ops.higher_order.invoke_subgraph
    mine = hop.HigherOrderOperator("invoke_subgraph")
    assert torch.ops.higher_order.invoke_subgraph is torch_op
    assert torch._ops._higher_order_ops["invoke_subgraph"] is torch_op
    assert torch.ops.hop.invoke_subgraph is mine


def test_new_name_is_not_added_to_torch_higher_order() -> None:
    hop.HigherOrderOperator("only_in_hop")
    assert "only_in_hop" not in torch._ops._higher_order_ops
    with pytest.raises(AttributeError):
        torch.ops.higher_order.only_in_hop  # noqa: B018


def test_fx_code_prints_the_qualified_name() -> None:
    gm = make_fx(lambda a: apply(torch.sin, a))(torch.randn(2))
    assert "torch.ops.hop.test_apply(" in gm.code


def test_pickle_and_deepcopy_keep_identity() -> None:
    assert pickle.loads(pickle.dumps(apply)) is apply
    assert copy.deepcopy(apply) is apply


def test_name_must_be_an_identifier() -> None:
    with pytest.raises(HopValueError, match="name must be a Python identifier, got 'not a name'"):
        hop.HigherOrderOperator("not a name")


def test_py_impl_rejects_a_second_rule_for_the_same_key() -> None:
    op = hop.HigherOrderOperator("twice")

    @op.py_impl(DispatchKey.CompositeExplicitAutograd)
    def dense(x: torch.Tensor) -> torch.Tensor:
        return x

    with pytest.raises(HopValueError, match=r"hop.twice: a rule for DispatchKey.CompositeExplicitAutograd is already"):
        op.py_impl(DispatchKey.CompositeExplicitAutograd)(dense)
    op.py_impl(TransformType.Vmap)(dense)
    with pytest.raises(HopValueError, match="already registered"):
        op.py_impl(TransformType.Vmap)(dense)


def test_py_impl_rejects_what_is_not_a_key_mode_subclass_or_transform() -> None:
    op = hop.HigherOrderOperator("bad_key")
    with pytest.raises(HopTypeError, match="py_impl takes a DispatchKey"):
        op.py_impl("CPU")  # type: ignore[arg-type]
    with pytest.raises(HopTypeError):
        op.py_impl(int)  # type: ignore[arg-type]


def test_registration_tables_and_kernel_cache() -> None:
    op = hop.HigherOrderOperator("tables")

    class MyMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    @op.py_impl(DispatchKey.CompositeExplicitAutograd)
    def dense(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    @op.py_impl(MyMode)
    def in_mode(mode: MyMode, x: torch.Tensor) -> torch.Tensor:
        return x + 2

    @op.py_impl(TransformType.Vmap)
    def vmap_rule(interpreter: object, x: torch.Tensor) -> torch.Tensor:
        return x

    assert op.py_kernels[DispatchKey.CompositeExplicitAutograd] is dense
    assert op.python_key_table[MyMode] is in_mode
    assert op.functorch_table[TransformType.Vmap] is vmap_rule
    torch.testing.assert_close(op(torch.zeros(1)), torch.ones(1))
    assert op._hop_kernels  # resolved once, cached per key

    @op.py_impl(DispatchKey.CPU)
    def cpu(x: torch.Tensor) -> torch.Tensor:
        return x + 3

    assert not op._hop_kernels  # registration invalidates the cache
    torch.testing.assert_close(op(torch.zeros(1)), torch.full((1,), 3.0))
    assert op(torch.zeros(1, device="meta")).device.type == "meta"  # Meta still takes the dense kernel
    z = torch.zeros(1)
    with MyMode():
        torch.testing.assert_close(op(z), torch.full((1,), 2.0))


def test_torch_library_ops_in_the_hop_namespace_still_resolve() -> None:
    lib = torch.library.Library("hop", "FRAGMENT")
    lib.define("twice_lib(Tensor x) -> Tensor")
    lib.impl("twice_lib", lambda x: x * 2, "CompositeExplicitAutograd")
    torch.testing.assert_close(torch.ops.hop.twice_lib(torch.ones(2)), torch.full((2,), 2.0))


def test_dynamo_breaks_the_graph_at_an_operator_it_has_no_handler_for() -> None:
    # test_apply has no Dynamo handler: the call runs eagerly between two graphs, and
    # fullgraph=True names the operator (hop.compile.dynamo).
    from torch._dynamo.utils import counters

    from hop.errors import CompileUnsupported

    def f(x: torch.Tensor) -> torch.Tensor:
        return apply(lambda t: t + 1, x * 2) * 3  # type: ignore[no-any-return]

    x = torch.randn(3)
    torch._dynamo.reset()
    counters.clear()
    torch.testing.assert_close(torch.compile(f, backend="eager")(x), f(x))
    reason = "hop.test_apply: a hop.HigherOrderOperator with no Dynamo handler"
    assert any(key.startswith(reason) for key in counters["graph_break"])
    torch._dynamo.reset()
    with pytest.raises(CompileUnsupported, match=f"^{reason}"):
        torch.compile(f, backend="eager", fullgraph=True)(x)


def test_dynamo_handlers_are_registered_lazily_also_for_ops_made_before_dynamo() -> None:
    import subprocess
    import sys

    code = (
        "import sys, hop\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "named_like_torch = hop.HigherOrderOperator('wrap')\n"
        "import torch, torch._dynamo\n"
        "from torch._dynamo.variables import higher_order_ops as h\n"
        "from hop.compile._dynamo_capture import UnhandledVariable\n"
        "from hop.compile._dynamo_branching import CondVariable\n"
        "after = hop.HigherOrderOperator('made_after_dynamo')\n"
        "assert isinstance(h.TorchHigherOrderOperatorVariable.make(hop.ops.branching.cond.cond_op), CondVariable)\n"
        "assert isinstance(h.TorchHigherOrderOperatorVariable.make(named_like_torch), UnhandledVariable)\n"
        "assert isinstance(h.TorchHigherOrderOperatorVariable.make(after), UnhandledVariable)\n"
        "torch_cond = h.TorchHigherOrderOperatorVariable.make(torch.ops.higher_order.cond)\n"
        "assert isinstance(torch_cond, h.CondHigherOrderVariable)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_submodules_work_after_a_bare_import() -> None:
    # `import hop; hop.passes.optimize(ep)` raised AttributeError (hop.passes was never imported)
    import subprocess
    import sys

    code = (
        "import hop\n"
        "assert callable(hop.passes.optimize) and callable(hop.debug.draw) and callable(hop.testing.check)\n"
        "assert 'passes' in hop.__all__ and 'debug' in hop.__all__\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_tuple_args_refuse_anything_but_a_tuple_or_list() -> None:
    op = hop.HigherOrderOperator("test_tuple_args", tuple_args={1: "operands"})

    @op.py_impl(DispatchKey.CompositeExplicitAutograd)
    def dense(fn: object, operands: tuple[torch.Tensor, ...]) -> object:
        return fn(*operands)  # type: ignore[operator]

    x = torch.ones(2, 3)
    torch.testing.assert_close(op(lambda a: a + 1, (x,)), x + 1)
    torch.testing.assert_close(op(lambda a: a + 1, [x]), x + 1)
    with pytest.raises(
        HopTypeError, match=r"^hop\.test_tuple_args: operands of torch\.ops\.hop\.test_tuple_args must be"
    ):
        op(lambda a, b: a + b, x)
