"""hop's operators compiled by Inductor and AOTInductor, against torch's twins, in one run.

Per operator, the hop program and its torch twin (``torch.cond``; nested ``torch.cond``
for switch; ``torch._higher_order_ops`` ``while_loop``, ``map``, ``scan``,
``associative_scan``; torch's while_loop for fori_loop) are measured for:

- compile: the first call of ``torch.compile(fn, backend="inductor")`` (after
  ``torch._dynamo.reset()``, Inductor's caches off), in s;
- inductor: the steady-state time per call of that compiled function, in us;
- aoti build: ``torch.export.export`` + ``aoti_compile_and_package``, in s;
- aoti run: the time per call of the loaded package, in us;
- eager: the time per call of the uncompiled function, in us.

A row that fails prints ``n/a (reason)``. Run:
``python benchmarks/bench_compile.py [--quick] [--ops cond,scan]``
(``--quick`` skips AOTInductor, the slowest part: a build per program).

``--models`` compiles the realistic programs of ``benchmarks/passes.py`` (a decoder
loop with an invariant projection, a gated block with a shared prefix, a configured
block) with Inductor instead: hop as it is, hop with ``hop.passes.inductor``'s
optimize pass, and torch's twin (torch's cond and while_loop), each timed per call
(no grad; CPU time of one thread; each in a fresh process, the three taking turns
for three rounds) and checked against the hop model in eager.

``--models --training`` times a training step instead: the compiled forward and
backward (``loss.backward()``, parameters requiring grad), its gradients checked
against the hop model's in eager; a twin that torch cannot differentiate prints
``n/a``.

``--models --interleaved`` compiles the three in one process instead and times them
in alternating blocks of calls, so that a drift of the machine falls on each alike;
run twice, each impl built first once (what is built first runs faster: memory
layout). Per program, the median block of each impl and its ratio to torch's, per
build order and their geometric mean. Differences of a percent or two are below what
separate processes can resolve on a shared machine.

``--warm`` measures warm starts instead: per program, two fresh processes share one
``TORCHINDUCTOR_CACHE_DIR`` (caches on) and each times its first compiled call
(Dynamo, AOTAutograd and Inductor, or the cached code they load); the table has the
cold and the warm time and what the FX graph and AOTAutograd caches did in the warm one.
"""

from __future__ import annotations

import os
import sys

if "--child" not in sys.argv and "--warm" not in sys.argv:  # --model-child compiles with caches off
    os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # every first call compiles

import argparse
import json
import math
import re
import statistics
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch._higher_order_ops import associative_scan as torch_associative_scan
from torch._higher_order_ops import map as torch_map
from torch._higher_order_ops import scan as torch_scan
from torch._higher_order_ops import while_loop as torch_while_loop

sys.path.insert(0, str(Path(__file__).parent))
from _timing import per_call_us
from passes import Configured, Decoder, Gated

import hop

Fn = Callable[..., Any]
STEPS = 50  # loop trip count and scanned length


def _counter() -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64)


def branches() -> list[Fn]:
    return [lambda x: x.sin() + 1, lambda x: x.cos() * 2, lambda x: x.tanh() - 3]


def step(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c = c * 0.5 + x
    return c, c.cos()


# (name, hop program, torch twin, inputs): programs take tensors only.
def programs() -> list[tuple[str, Fn, Fn, tuple[torch.Tensor, ...]]]:
    x, xs, k, n = torch.randn(16, 16), torch.randn(STEPS, 16), torch.tensor(1), torch.tensor(STEPS)
    b = branches()

    def hop_switch(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return hop.switch(k, b, (x,))

    def torch_switch(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        inner = lambda y: torch.cond(k == 1, b[1], b[2], (y,))  # noqa: E731
        return torch.cond(k == 0, b[0], inner, (x,))

    def while_body(i: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return i + 1, y * 0.9 + 0.1

    return [
        (
            "cond",
            lambda x: hop.cond(x.sum() > 0, b[0], b[1], (x,)),
            lambda x: torch.cond(x.sum() > 0, b[0], b[1], (x,)),
            (x,),
        ),
        ("switch", hop_switch, torch_switch, (x, k)),
        (
            "while_loop",
            lambda x, n: hop.while_loop(lambda i, y: i < n, while_body, (_counter(), x))[1],
            lambda x, n: torch_while_loop(lambda i, y: i < n, while_body, (_counter(), x))[1],
            (x, n),
        ),
        (
            "fori_loop",
            lambda x, n: hop.fori_loop(0, n, lambda i, y: y * 0.9 + 0.1, x),
            lambda x, n: torch_while_loop(lambda i, y: i < n, while_body, (_counter(), x))[1],
            (x, n),
        ),
        ("map", lambda xs: hop.map(lambda r: r.sin() * 2, xs), lambda xs: torch_map(lambda r: r.sin() * 2, xs), (xs,)),
        ("scan", lambda xs: hop.scan(step, xs[0], xs), lambda xs: torch_scan(step, xs[0], xs), (xs,)),
        (
            "associative_scan",
            lambda xs: hop.associative_scan(lambda a, c: a * c, xs, 0),
            lambda xs: torch_associative_scan(lambda a, c: a * c, xs, 0, combine_mode="generic"),
            (xs,),
        ),
    ]


class _Module(torch.nn.Module):
    def __init__(self, fn: Fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: torch.Tensor) -> Any:
        return self.fn(*args)


def _na(e: Exception) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"n/a ({type(e).__name__}: {first[:70]})"


def _timed(what: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = what()
    return time.perf_counter() - start, out


def measure(fn: Fn, args: tuple[torch.Tensor, ...], aoti: bool) -> list[str]:
    """The cells of one row: compile s, inductor us, aoti build s, aoti run us, eager us."""
    cells = []
    try:
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="inductor")
        seconds, _ = _timed(lambda: compiled(*args))
        cells += [f"{seconds:.1f}", f"{per_call_us(lambda: compiled(*args), number=50, repeat=5):.1f}"]
    except Exception as e:
        cells += [_na(e), "n/a"]
    if aoti:
        try:
            with tempfile.TemporaryDirectory() as tmp:
                build = lambda: torch._inductor.aoti_compile_and_package(  # noqa: E731
                    torch.export.export(_Module(fn), args), package_path=f"{tmp}/p.pt2"
                )
                seconds, path = _timed(build)
                loaded = torch._inductor.aoti_load_package(path)
                cells += [f"{seconds:.1f}", f"{per_call_us(lambda: loaded(*args), number=50, repeat=5):.1f}"]
        except Exception as e:
            cells += [_na(e), "n/a"]
    else:
        cells += ["-", "-"]
    cells.append(f"{per_call_us(lambda: fn(*args), number=20, repeat=5):.1f}")
    return cells


class _TorchDecoder(Decoder):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def body(i: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            proj = (self.w * self.scale).t() @ self.w
            return i + 1, (h @ proj).tanh()

        out: torch.Tensor = torch_while_loop(lambda i, h: i < 16, body, (_counter(), x))[1]
        return out


class _TorchGated(Gated):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def wide(v: torch.Tensor) -> torch.Tensor:
            return self.out(torch.nn.functional.gelu(self.proj(v)))

        def narrow(v: torch.Tensor) -> torch.Tensor:
            return self.out(self.proj(v).relu()) * 0.5

        out: torch.Tensor = torch.cond(x.mean() > 0, wide, narrow, (x,))
        return out


class _TorchConfigured(Configured):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        use_norm, act = torch.tensor(True), torch.tensor(2)
        norm = lambda v: torch.nn.functional.layer_norm(v, v.shape[-1:])  # noqa: E731
        h = torch.cond(use_norm, norm, lambda v: v.clone(), (x,))
        h = torch_while_loop(lambda i, v: i < 1, lambda i, v: (i + 1, self.lin(v).tanh() + v), (_counter(), h))[1]
        rest = lambda v: torch.cond(act == 1, torch.nn.functional.gelu, torch.nn.functional.silu, (v,))  # noqa: E731
        out: torch.Tensor = torch.cond(act == 0, torch.relu, rest, (h,))
        return out


_MODELS = {
    "decoder loop, invariant projection": (Decoder, _TorchDecoder, (8, 64)),
    "gated block, shared prefix": (Gated, _TorchGated, (32, 256)),
    "configured block (constants, 1-step loop)": (Configured, _TorchConfigured, (8, 64)),
}
_IMPLS = ("hop", "hop + passes", "torch")


def model_child(name: str, impl: str, mode: str = "inference") -> None:
    """One process of ``--models``: compile one program one way; print its compile s and
    us per call (per training step with ``mode == "training"``)."""
    from torch._inductor import config

    import hop.passes.inductor

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model_type, twin_type, shape = _MODELS[name]
    model, x = model_type(), torch.randn(shape)
    m = (model_type if impl != "torch" else twin_type)()  # every impl a second module: the same memory layout
    m.load_state_dict(model.state_dict())
    passes = hop.passes.inductor.chain(None) if impl == "hop + passes" else config.post_grad_custom_pre_pass
    with config.patch(post_grad_custom_pre_pass=passes):
        compiled = torch.compile(m, backend="inductor", fullgraph=True)
        if mode == "training":
            seconds, us = _training(model, m, compiled, x)
        else:
            with torch.no_grad():
                seconds, got = _timed(lambda: compiled(x))
                torch.testing.assert_close(got, model(x))
                us = per_call_us(lambda: compiled(x), number=100, repeat=7, timer=time.process_time)
    print(f"{seconds:.2f} {us:.2f}")


def _compiled_model(name: str, impl: str) -> tuple[Fn, torch.Tensor]:
    """``name``'s program compiled by Inductor as ``impl``, checked against eager, and its input."""
    from torch._inductor import config

    import hop.passes.inductor

    torch.manual_seed(0)
    model_type, twin_type, shape = _MODELS[name]
    model, x = model_type(), torch.randn(shape)
    own = type(model_type.__name__, (model_type if impl != "torch" else twin_type,), {})
    m = own()  # its own class: Dynamo reuses a graph for another instance of one class, passes or not
    m.load_state_dict(model.state_dict())
    passes = hop.passes.inductor.chain(None) if impl == "hop + passes" else config.post_grad_custom_pre_pass
    with config.patch(post_grad_custom_pre_pass=passes), torch.no_grad():
        compiled = torch.compile(m, backend="inductor", fullgraph=True)
        torch.testing.assert_close(compiled(x), model(x))
    return compiled, x


def interleaved_child(name: str, first: str, blocks: int = 40, number: int = 50) -> None:
    """One process of ``--models --interleaved``: every impl compiled, ``first`` first,
    then timed in turns; prints each impl's median us per call over the blocks."""
    torch.set_num_threads(1)
    order = [first, *(i for i in _IMPLS if i != first)]
    built = {impl: _compiled_model(name, impl) for impl in order}
    times: dict[str, list[float]] = {impl: [] for impl in order}
    with torch.no_grad():
        for fn, x in built.values():
            fn(x)
        for _ in range(blocks):
            for impl, (fn, x) in built.items():
                start = time.process_time()
                for _ in range(number):
                    fn(x)
                times[impl].append((time.process_time() - start) / number * 1e6)
    print(json.dumps({impl: statistics.median(ts) for impl, ts in times.items()}))


def interleaved() -> None:
    """The table of ``--models --interleaved``."""
    header = ["program", "impl", "us (hop first)", "us (torch first)", "/ torch (each order)", "/ torch (geo mean)"]
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for name in _MODELS:
        runs = []
        for first in ("hop", "torch"):
            proc = subprocess.run(
                [sys.executable, __file__, "--interleaved-child", name, first], capture_output=True, text=True
            )
            if proc.returncode:
                print(f"{name} | n/a ({_reason(proc.stderr)})", flush=True)
                break
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        else:
            for impl in _IMPLS:
                ratios = [r[impl] / r["torch"] for r in runs]
                cells = [f"{r[impl]:.1f}" for r in runs]
                each = " / ".join(f"{q:.3f}" for q in ratios)
                print(" | ".join([name, impl, *cells, each, f"{math.sqrt(ratios[0] * ratios[1]):.3f}x"]), flush=True)


def _training(model: torch.nn.Module, m: torch.nn.Module, compiled: Fn, x: torch.Tensor) -> tuple[float, float]:
    """Compile s and us per step of ``compiled(x).sum().backward()``, whose gradients
    equal the hop model's in eager."""

    def grads(module: torch.nn.Module, fn: Fn) -> list[torch.Tensor]:
        module.zero_grad(set_to_none=True)
        fn(x).sum().backward()
        return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in module.parameters()]

    seconds, got = _timed(lambda: grads(m, compiled))
    want = grads(model, model)
    worst = max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))
    if not all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(got, want, strict=True)):
        raise AssertionError(f"wrong gradients: {worst:.3g} off eager's")
    us = per_call_us(lambda: compiled(x).sum().backward(), number=50, repeat=7, timer=time.process_time)
    return seconds, us


def models(rounds: int = 3, mode: str = "inference") -> None:
    """The table of ``--models``: each (program, impl) in a fresh process, the impls
    taking turns for ``rounds`` rounds (run-to-run drift on a shared machine is larger
    than the differences); the best time per call, the median compile time."""
    header = ["program", "impl", "compile s", "inductor us" if mode == "inference" else "training step us", "/ torch"]
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for name in _MODELS:
        runs: dict[str, list[tuple[float, float]]] = {impl: [] for impl in _IMPLS}
        failed: dict[str, str] = {}
        for _ in range(rounds):
            for impl in _IMPLS:
                if impl in failed:
                    continue
                proc = subprocess.run(
                    [sys.executable, __file__, "--model-child", name, impl, mode], capture_output=True, text=True
                )
                if proc.returncode:
                    if impl != "torch":
                        raise RuntimeError(f"{name} / {impl}: {proc.stderr.strip()[-2000:]}")
                    failed[impl] = f"n/a ({_reason(proc.stderr)})"  # torch's twin cannot
                    continue
                compile_s, us = proc.stdout.split()[-2:]
                runs[impl].append((float(compile_s), float(us)))
        base = min((us for _, us in runs["torch"]), default=None)
        for impl in _IMPLS:
            if impl in failed:
                print(" | ".join([name, impl, failed[impl], "", ""]), flush=True)
                continue
            compile_s = sorted(c for c, _ in runs[impl])[rounds // 2]
            us = min(u for _, u in runs[impl])
            ratio = f"{us / base:.2f}x" if base else "-"
            print(" | ".join([name, impl, f"{compile_s:.1f}", f"{us:.1f}", ratio]), flush=True)


def _reason(stderr: str) -> str:
    """The exception line of a child's traceback."""
    lines = stderr.strip().splitlines() or ["?"]
    found = next((ln for ln in reversed(lines) if re.match(r"^[\w.]+(Error|Exception|Unsupported)\b", ln)), lines[-1])
    return found[:90]


def child(name: str, impl: str) -> None:
    """One process's first compiled call of a program; prints its seconds and the caches' counters."""
    from torch._dynamo.utils import counters

    if name == _FLOOR:  # no control flow: the warm start's floor (importing Dynamo and Inductor, loading)
        hop_fn = torch_fn = lambda x: x.sin() * 2 + 1
        args: tuple[Any, ...] = (torch.randn(4, 8),)
    else:
        _, hop_fn, torch_fn, args = next(p for p in programs() if p[0] == name)
    compiled = torch.compile(hop_fn if impl == "hop" else torch_fn, backend="inductor")
    seconds, _ = _timed(lambda: compiled(*args))
    fx = {k.removeprefix("fxgraph_cache_"): v for k, v in counters["inductor"].items() if "cache" in k}
    aot = {k.removeprefix("autograd_cache_"): v for k, v in counters["aot_autograd"].items() if "cache" in k}
    print(f"{seconds:.2f}|{fx}|{aot}")


_FLOOR = "no control flow"


def warm(wanted: set[str]) -> None:
    """The table of ``--warm``; its first row is a program without control flow (one
    process pair), the floor under every warm start."""
    header = ["op", "impl", "cold s", "warm s", "warm / cold", "warm: FX graph cache", "warm: AOTAutograd cache"]
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for name in [_FLOOR, *(p[0] for p in programs())]:
        if wanted and name not in wanted and name != _FLOOR:
            continue
        for impl in ("hop", "torch") if name != _FLOOR else ("plain",):
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "0"}
                runs = [
                    subprocess.run(
                        [sys.executable, __file__, "--child", name, impl], env=env, capture_output=True, text=True
                    )
                    for _ in range(2)
                ]
            if any(r.returncode for r in runs):
                print(f"{name} | {impl} | n/a ({runs[-1].stderr.strip().splitlines()[-1][:70]})", flush=True)
                continue
            (cold, _, _), (hot, fx, aot) = (r.stdout.strip().splitlines()[-1].split("|") for r in runs)
            ratio = f"{float(hot) / float(cold):.2f}"
            print(" | ".join([name, impl, cold, hot, ratio, fx, aot]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip AOTInductor")
    parser.add_argument("--ops", default="", help="comma-separated operators (default: all)")
    parser.add_argument("--models", action="store_true", help="realistic programs: hop, hop + passes, torch")
    parser.add_argument("--training", action="store_true", help="with --models: a compiled training step")
    parser.add_argument("--interleaved", action="store_true", help="with --models: the impls in one process, in turns")
    parser.add_argument("--warm", action="store_true", help="cold and warm starts from the compile caches")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--model-child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--interleaved-child", nargs=2, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    wanted = set(filter(None, opts.ops.split(",")))
    warnings.filterwarnings("ignore")
    if opts.child:
        return child(*opts.child)
    if opts.model_child:
        return model_child(*opts.model_child)
    if opts.interleaved_child:
        return interleaved_child(*opts.interleaved_child)
    if opts.warm:
        return warm(wanted)
    if opts.models and opts.interleaved:
        return interleaved()
    if opts.models:
        return models(mode="training" if opts.training else "inference")
    torch.compile(lambda t: t + 1, backend="inductor")(torch.ones(2))  # Inductor's one-time start-up
    header = ["op", "impl", "compile s", "inductor us", "aoti build s", "aoti run us", "eager us"]
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for name, hop_fn, torch_fn, args in programs():
        if wanted and name not in wanted:
            continue
        for impl, fn in (("hop", hop_fn), ("torch", torch_fn)):
            print(" | ".join([name, impl, *measure(fn, args, not opts.quick)]), flush=True)


if __name__ == "__main__":
    main()
