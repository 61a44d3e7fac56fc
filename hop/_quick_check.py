"""``python -m hop --check``: a minute's check that this install works.

One small program per public operator, checked by ``hop.testing.check`` against the
plain Python program it stands for: eager, autograd, ``torch.func`` (grad, jvp, vmap
and their compositions), fake tensors, ``make_fx`` and ``torch.export``, and
``torch.compile(fullgraph=True)`` with aot_eager. It prints one line per operator
and exits 1 if any fails. The full suite (``python -m pytest -n 2 -q``) checks far
more, in tens of minutes.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import hop
from hop.testing import TRANSFORMS, check

TRANSFORMS_CHECKED = (*TRANSFORMS, "compile_aot_eager")


def _programs() -> dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]:
    x, xs = torch.randn(3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    return {
        "cond": (lambda x: hop.cond(x.sum() > 0, lambda a: a.sin(), lambda a: a * 2, (x,)), (x,)),
        "switch": (lambda i, x: hop.switch(i, [lambda a: a + 1, lambda a: a.cos(), lambda a: -a], (x,)), (1, x)),
        "while_loop": (
            lambda x: hop.while_loop(lambda a: a.abs().sum() < 20, lambda a: (a * 1.5 + 0.1,), (x,))[0],
            (x,),
        ),
        "fori_loop": (lambda x: hop.fori_loop(0, 4, lambda i, a: a.tanh() + 0.1 * i, x), (x,)),
        "map": (lambda xs: hop.map(lambda r: r.sin() * r.sum(), xs), (xs,)),
        "scan": (lambda xs: hop.scan(lambda c, r: (c * 0.5 + r, (c * r).sum()), xs[0] * 0, xs), (xs,)),
        "associative_scan": (lambda xs: hop.associative_scan(lambda a, b: a + b, xs, 0), (xs,)),
    }


def main(argv: list[str]) -> int:
    del argv
    # torch's serializer logs what a saved-and-loaded program of hop's drops on purpose
    logging.getLogger("torch._export.serde.serialize").setLevel(logging.ERROR)
    print(f"hop on torch {torch.__version__}: each operator against its Python program")
    failed = 0
    for name, (fn, args) in _programs().items():
        start = time.perf_counter()
        try:
            check(fn, *args, transforms=TRANSFORMS_CHECKED)
            verdict = "ok"
        except Exception as e:  # a failure of this install, reported, not raised
            failed += 1
            verdict = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(f"  {name:<17} {verdict} ({time.perf_counter() - start:.1f} s)")
    print("all operators ok" if not failed else f"{failed} operator(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
