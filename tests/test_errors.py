"""hop.errors: every class is a HopError and the builtin that fits."""

from __future__ import annotations

import pytest

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
