"""hop.errors: every class is a HopError and the builtin that fits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hop import errors


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (errors.HopTypeError, TypeError),
        (errors.HopValueError, ValueError),
        (errors.HopRuntimeError, RuntimeError),
        (errors.OutputMismatchError, TypeError),
        (errors.AliasingError, RuntimeError),
        (errors.MutationError, RuntimeError),
        (errors.UnsupportedModeError, RuntimeError),
        (errors.MissingRuleError, NotImplementedError),
        (errors.UnknownOperatorError, LookupError),
    ],
)
def test_hierarchy(cls: type[errors.HopError], builtin: type[Exception]) -> None:
    err = cls("msg", op="cond", role="true_fn", path="output[0]")
    assert isinstance(err, errors.HopError) and isinstance(err, builtin)
    assert (err.op, err.role, err.path) == ("cond", "true_fn", "output[0]")


def test_format_message() -> None:
    msg = errors.format_message("cond", "dtype float32 vs float64.", role="false_fn", path="output[1]", fix="Cast it.")
    assert msg == "hop.cond: false_fn: output[1]: dtype float32 vs float64. Cast it."
    assert errors.format_message("x", "bad") == "hop.x: bad"


def test_type_name_says_numpy_for_a_numpy_bool_and_tensor_for_any_tensor() -> None:
    assert errors.type_name(True) == "bool" and errors.type_name(None) == "NoneType"
    assert errors.type_name(np.bool_(True)) in ("numpy.bool", "numpy.bool_")  # numpy 2 names it "bool"
    assert errors.type_name(np.int64(3)) == "numpy.int64"
    assert errors.type_name(torch.float32) == "dtype"
    assert errors.type_name(torch.zeros(1)) == "Tensor"
    with FakeTensorMode() as mode:
        assert errors.type_name(mode.from_tensor(torch.zeros(1))) == "Tensor"
    assert errors.type_name(test_format_message) == "function"
