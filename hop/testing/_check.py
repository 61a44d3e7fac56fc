"""``hop.testing.check``: a program against its reference semantics, transform by transform.

The oracle is the program run under :func:`hop.testing.reference` (every hop
operator as plain Python), or a reference function the caller gives. Each
transform either runs and matches, raises :class:`CheckFailure` naming the
transform, the output path and the values, or is skipped with a reason that
the returned :class:`Report` records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hop import _reference
from hop.errors import HopTypeError, HopValueError, format_message
from hop.testing._case import COMPILED, TRANSFORMS, CheckCase, CheckFailure, Fn, Skip, reference
from hop.testing._compiled_checks import (
    check_compile,
    check_compile_compositions,
    check_compile_vmap,
    check_deploy_vmap,
    check_export_compositions,
    check_export_strict,
    check_export_vmap,
)
from hop.testing._composition_checks import check_grad_vmap, check_jvp_vmap, check_vmap_grad, check_vmap_jvp
from hop.testing._deployment_checks import check_aoti, check_onnx
from hop.testing._transform_checks import (
    check_autograd,
    check_eager,
    check_export,
    check_fake,
    check_gradcheck,
    check_jvp,
    check_make_fx,
    check_vmap,
    eager_outputs,
)

__all__ = ["COMPILED", "TRANSFORMS", "CheckFailure", "Report", "bundle", "check", "reference"]


_NAME = "testing.check"


@dataclasses.dataclass
class Report:
    """What :func:`check` did: the transforms that ran and matched, and those skipped, with why."""

    ran: list[str] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"ran: {', '.join(self.ran) or '-'}"]
        lines += [f"skipped {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


def check(
    fn: Fn,
    *args: Any,
    transforms: Sequence[str] = TRANSFORMS,
    reference: Fn | None = None,
    skip: Mapping[str, str] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    batch_size: int = 3,
    seed: int = 0,
) -> Report:
    """Check ``fn(*args)`` against its reference under each transform; raise on the first mismatch.

    Args:
        fn: the program, taking ``args`` (pytrees of tensors, ints, floats).
        transforms: which of ``TRANSFORMS`` to check, in that order: ``eager``;
            ``autograd`` (gradients w.r.t. every floating-point input equal the
            reference's); ``gradcheck`` (float64 inputs only); ``jvp``
            (``torch.func.jvp``); ``vmap`` (over ``batch_size`` perturbed copies
            of every tensor input, against a Python loop of the reference);
            ``vmap_grad`` / ``grad_vmap`` (the gradient of those copies taken
            inside the vmap, per example, and outside it, as a batch is trained:
            each row's equals the reference's on that row); ``vmap_jvp`` /
            ``jvp_vmap`` (forward mode inside the vmap, and outside it);
            ``fake`` (output metadata under ``FakeTensorMode``, unbacked sizes
            within their ranges); ``make_fx_fake`` / ``make_fx_symbolic`` (the
            graph runs and matches on ``args`` and on perturbed copies);
            ``export`` (``ep.module()`` and a ``torch.export.save``/``load``
            round trip match); and, opt-in (``COMPILED``), the compiler bridge,
            each on ``args`` and on perturbed copies that take other branches and
            trip counts, forward and (for float inputs) gradients:
            ``compile_aot_eager`` / ``compile_inductor`` (``torch.compile(fullgraph=True,
            dynamic=True)``), ``compile_inductor_static`` (``dynamic=False``),
            ``compile_inductor_vmap`` (the vmapped program compiled, forward and the
            gradient outside the vmap), ``compile_compositions`` (``vmap_grad``,
            ``grad_vmap``, ``vmap_jvp``, ``jvp_vmap`` and ``jvp``, each compiled with
            aot_eager and with Inductor, dynamic and static, per row),
            ``export_strict`` (``torch.export.export(strict=True)``), ``export_vmap``
            (the vmapped program exported, strict and not, saved and loaded),
            ``export_compositions`` (the ``jvp`` exported strict and not, saved and
            loaded, and as an AOTInductor package in a fresh process), ``aoti``
            (an AOTInductor package of the exported program, run in a fresh process
            without hop; forward only), ``onnx`` (``torch.onnx.export(dynamo=True)``,
            the file run in onnxruntime; forward only), ``deploy_vmap`` (the vmapped
            program exported, as an AOTInductor package in a fresh process and an ONNX
            file in onnxruntime). A documented refusal
            (``hop.errors.CompileUnsupported``) skips the transform; any other error,
            or a different value, is a failure.
        reference: the oracle; by default ``fn`` under :func:`reference`.
        skip: transforms known not to apply, each with the reason to record.
        rtol, atol: tolerances for ``torch.testing.assert_close`` (its dtype
            defaults when ``None``).
        batch_size: the vmap batch size.
        seed: seeds the perturbations, tangents and cotangents.

    Returns:
        A :class:`Report` of the transforms that ran and those skipped, with why.

    Raises:
        CheckFailure: the first mismatch: transform, output path and values.
    """
    _check_arguments(fn, transforms, reference, skip)
    _check_settings(skip, rtol, atol, batch_size)
    ref = reference if reference is not None else _under_reference(fn)
    case = CheckCase(fn, ref, args, rtol, atol, batch_size, seed)
    report = Report()
    eager_outputs(case)
    for name in _CHECKS:
        if name not in transforms:
            continue
        if skip and name in skip:
            report.skipped[name] = skip[name]
            continue
        try:
            _CHECKS[name](case)
        except Skip as why:
            report.skipped[name] = str(why)
        else:
            report.ran.append(name)
    return report


def _check_arguments(fn: Any, transforms: Any, reference: Any, skip: Any) -> None:
    if isinstance(transforms, str):  # would be read letter by letter
        raise HopTypeError(
            format_message(
                _NAME, f"transforms must be a sequence of names, got {transforms!r}", fix=f"Pass ({transforms!r},)."
            ),
            op=_NAME,
        )
    for role, value in (("fn", fn), ("reference", reference)):
        if value is not None and not callable(value):
            raise HopTypeError(format_message(_NAME, f"{role} must be callable, got {type(value).__name__}"), op=_NAME)
    if fn is None:
        raise HopTypeError(format_message(_NAME, "fn must be callable, got NoneType"), op=_NAME)
    unknown = [t for t in (*transforms, *(skip or ())) if t not in _CHECKS]
    if unknown:
        raise HopValueError(
            format_message(_NAME, f"unknown transform {unknown[0]!r}", fix=f"Choose from {', '.join(_CHECKS)}."),
            op=_NAME,
        )


def _check_settings(skip: Any, rtol: Any, atol: Any, batch_size: Any) -> None:
    if skip is not None and not isinstance(skip, Mapping):
        raise HopTypeError(
            format_message(
                _NAME,
                f"skip must be a mapping from transform to the reason it does not apply, got {type(skip).__name__}",
                fix='Pass e.g. skip={"vmap": "why"}.',
            ),
            op=_NAME,
        )
    if (rtol is None) != (atol is None):
        raise HopValueError(
            format_message(_NAME, "rtol and atol go together (as in assert_close)", fix="Pass both or neither."),
            op=_NAME,
        )
    if type(batch_size) is not int or batch_size < 1:
        raise HopValueError(
            format_message(_NAME, f"batch_size must be a positive int, got {batch_size!r}"),
            op=_NAME,
        )


def _under_reference(fn: Fn) -> Fn:
    def ref(*args: Any) -> Any:
        with _reference.enabled():
            return fn(*args)

    return ref


def bundle(programs: Sequence[tuple[Fn, tuple[Any, ...]]]) -> tuple[Fn, tuple[Any, ...]]:
    """Many ``(fn, args)`` as one program and its arguments, so that one compilation (one
    AOTInductor build) checks them all: output ``k`` is program ``k``'s output.

    ``check(*bundle(pairs), transforms=COMPILED)``.
    """
    counts = [len(args) for _, args in programs]

    def bundled(*args: Any) -> tuple[Any, ...]:
        out, start = [], 0
        for (fn, _), n in zip(programs, counts, strict=True):
            out.append(fn(*args[start : start + n]))
            start += n
        return tuple(out)

    return bundled, tuple(a for _, args in programs for a in args)


_CHECKS: dict[str, Callable[[CheckCase], None]] = {
    "eager": check_eager,
    "autograd": check_autograd,
    "gradcheck": check_gradcheck,
    "jvp": check_jvp,
    "vmap": check_vmap,
    "vmap_grad": check_vmap_grad,
    "grad_vmap": check_grad_vmap,
    "vmap_jvp": check_vmap_jvp,
    "jvp_vmap": check_jvp_vmap,
    "fake": check_fake,
    "make_fx_fake": lambda case: check_make_fx(case, "fake"),
    "make_fx_symbolic": lambda case: check_make_fx(case, "symbolic"),
    "export": check_export,
    "compile_aot_eager": lambda case: check_compile(case, "aot_eager"),
    "compile_inductor": lambda case: check_compile(case, "inductor"),
    "compile_inductor_static": lambda case: check_compile(case, "inductor", dynamic=False),
    "compile_inductor_vmap": check_compile_vmap,
    "compile_compositions": check_compile_compositions,
    "export_strict": check_export_strict,
    "export_vmap": check_export_vmap,
    "export_compositions": check_export_compositions,
    "aoti": check_aoti,
    "onnx": check_onnx,
    "deploy_vmap": check_deploy_vmap,
}
