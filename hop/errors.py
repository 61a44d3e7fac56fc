"""The hop exception hierarchy.

Every user mistake raises a subclass of :class:`HopError`. Each subclass also
derives from the builtin that fits, so ``except TypeError`` keeps working for
code written against torch's control-flow functions.

Messages follow one shape: ``hop.<op>: <role>: <what differs>. <how to fix>``,
with the pytree path of the offending output (``output[1]["h"]``) when there is
one. :func:`format_message` builds that shape so every raise site agrees.
"""

from __future__ import annotations

__all__ = [
    "HopError",
    "HopTypeError",
    "HopValueError",
    "HopRuntimeError",
    "OutputMismatchError",
    "AliasingError",
    "MutationError",
    "UnsupportedModeError",
    "MissingRuleError",
    "UnknownOperatorError",
    "CompileUnsupported",
    "format_message",
    "not_a_sequence",
    "type_name",
]


def format_message(
    op: str,
    what: str,
    *,
    role: str | None = None,
    path: str | None = None,
    fix: str | None = None,
) -> str:
    """Build ``hop.<op>: <role>: <path>: <what>. <fix>``, skipping absent parts."""
    parts = [f"hop.{op}"]
    if role:
        parts.append(role)
    if path:
        parts.append(path)
    msg = ": ".join(parts) + ": " + what
    if fix:
        msg = msg.rstrip(".") + ". " + fix
    return msg


def type_name(value: object) -> str:
    """The name of ``value``'s type for a message: ``int``, ``Tensor``, ``numpy.bool``.

    Builtins and torch's types keep their short name, and every tensor subclass
    (a FakeTensor while tracing) reads ``Tensor``; any other type gets its module,
    so that a ``numpy.bool_`` (whose ``__name__`` is ``"bool"``) does not read as
    the Python ``bool`` a message may be asking for.
    """
    cls = type(value)
    if any(c.__name__ == "Tensor" and c.__module__ == "torch" for c in cls.__mro__):
        return "Tensor"
    module = cls.__module__
    if module == "builtins" or module == "torch" or module.startswith("torch."):
        return cls.__qualname__
    return f"{module}.{cls.__qualname__}"


def not_a_sequence(op: str, role: str, got: str, *, named: str | None = None) -> HopTypeError:
    """The error for an argument (``role``; ``named`` if the message spells it otherwise)
    that must be a tuple or list and is a ``got``: every operator's operands and carries."""
    what = f"{named or role} must be a tuple or list, got {got}"
    return HopTypeError(format_message(op, what, fix=f"Pass {role}=(x,) for a single one."), op=op, role=role)


class HopError(Exception):
    """Base class of every error hop raises for a user mistake.

    Attributes:
        op: the operator's name (``"cond"``), or ``None`` for framework errors.
        role: the callable or argument at fault (``"true_fn"``, ``"operands"``).
        path: the pytree path of the offending value (``'output[1]["h"]'``).
    """

    def __init__(
        self,
        message: str,
        *,
        op: str | None = None,
        role: str | None = None,
        path: str | None = None,
    ) -> None:
        super().__init__(message)
        self.op = op
        self.role = role
        self.path = path


class HopTypeError(HopError, TypeError):
    """A value of the wrong kind: not callable, not a tensor, wrong dtype."""


class HopValueError(HopError, ValueError):
    """A value of the right kind but out of range or of the wrong size."""


class HopRuntimeError(HopError, RuntimeError):
    """A call that cannot proceed in the current context."""


class OutputMismatchError(HopTypeError):
    """Outputs of branches or bodies disagree in structure or metadata."""


class AliasingError(HopRuntimeError):
    """A subgraph output aliases one of its inputs where that is not allowed."""


class MutationError(HopRuntimeError):
    """A subgraph mutates one of its inputs where that is not supported."""


class UnsupportedModeError(HopRuntimeError):
    """A TorchDispatchMode that does not handle higher-order operators."""


class MissingRuleError(HopRuntimeError, NotImplementedError):
    """The operator has no rule for a dispatch key, mode, subclass or transform."""


class UnknownOperatorError(HopError, LookupError):
    """A name no hop operator has in this process (e.g. an unpickled program's op)."""


class CompileUnsupported(HopRuntimeError):
    """A feature that runs in eager but that ``torch.compile`` cannot capture into its graph.

    With ``fullgraph=True`` (and in ``torch.export(strict=True)``) it is raised; without,
    Dynamo breaks the graph with this message as the reason and the operator runs eagerly.
    Also raised where an ONNX export cannot write a program faithfully (docs/deploy.md).
    """
