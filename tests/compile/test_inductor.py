"""hop's operators in Inductor: ``torch.compile(backend="inductor")`` and AOTInductor.

Inductor builds take tens of seconds on a small CPU, so one program holding all
seven operators is built once per mode (module-scoped fixtures) and run on
several inputs (branches taken and not, trip counts 0 to 5, lengths 0 to 7, an
index out of range); the per-operator tests read those shared results. The
AOTInductor package runs in a fresh process where hop is not imported.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hop
from hop.compile.inductor import POST_GRAD_PASS, chain
from hop.errors import HopRuntimeError

OPS = ["cond", "switch", "while_loop", "fori_loop", "map", "scan", "associative_scan"]
ROOT = Path(__file__).resolve().parents[2]


def program(x: torch.Tensor, w: torch.Tensor, k: torch.Tensor, n: torch.Tensor) -> dict[str, Any]:
    """All seven operators; ``x``'s length is dynamic, ``w``'s static."""
    zero = torch.zeros((), dtype=torch.int64, device=x.device)
    carry, ys = hop.scan(lambda c, r: (c + r, c * r), w[0], x, reverse=True)
    return {
        "cond": hop.cond(x.sum() > 0, lambda a: (a.sin(), a - 1), lambda a: (a.cos(), a + 1), (x,)),
        "switch": hop.switch(k, [lambda a: a + 1, lambda a: a * 2, lambda a: a.exp()], (x,)),
        "while_loop": (
            hop.while_loop(lambda i, y: i < n, lambda i, y: (i + 1, y * 1.5), (zero, x))[1],
            hop.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y - w[1]), (0, x))[1],  # an int carry
        ),
        "fori_loop": hop.fori_loop(0, n, lambda i, y: y + i, x),
        "map": hop.map(lambda r, s: r * s, x, w[0]),
        "scan": (carry, ys),
        "associative_scan": (
            hop.associative_scan(lambda a, b: a * b, x, 0),  # symbolic length: a sequential loop
            hop.associative_scan(lambda a, b: a + b, w, 0, combine_mode="generic"),  # static: plain ops
        ),
    }


def compiled_program(x: torch.Tensor, w: torch.Tensor, k: torch.Tensor, n: torch.Tensor) -> dict[str, Any]:
    """``program``, and a map over ``x[1:]``: its loop is given the symbol n of length n - 1."""
    out = program(x, w, k, n)
    out["map"] = (out["map"], hop.map(lambda r: r.sin(), x[1:]))
    return out


def cases(device: str, sizes: tuple[int, ...]) -> list[tuple[torch.Tensor, ...]]:
    """(x, w, k, n): each branch of cond and switch, trip counts 0, 3, 5, the lengths ``sizes``."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 3, generator=g)
    out = []
    for i, (k, n) in enumerate([(1, 3), (0, 0), (2, 5)]):
        for size in sizes:
            x = torch.randn(size, 3, generator=g) * 0.5
            x = x.abs() + 0.1 if i % 2 == 0 else -x.abs() - 0.1
            out.append((x, w, torch.tensor(k), torch.tensor(n)))
    return [tuple(t.to(device) for t in case) for case in out]


def out_of_range(case: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    x, w, _, n = case
    return (x, w, torch.tensor(3, device=x.device), n)


def same(actual: Any, expected: Any) -> bool:
    a, b = torch.utils._pytree.tree_leaves(actual), torch.utils._pytree.tree_leaves(expected)
    if len(a) != len(b):
        return False
    return all(torch.allclose(p.cpu(), q.cpu(), atol=1e-5, rtol=1e-5) for p, q in zip(a, b, strict=True))


# --- AOTInductor ---------------------------------------------------------------------------

# Runs in a fresh interpreter where hop cannot even be imported.
_LOAD = """
import sys
sys.modules["hop"] = None  # an import of hop would raise ImportError
import torch
package, inputs, outputs = sys.argv[1:]
model = torch._inductor.aoti_load_package(package)
cases, bad = torch.load(inputs)
results = [model(*case) for case in cases]
try:
    model(*bad)
    error = None
except RuntimeError as e:
    error = str(e)
loaded = sorted(m for m in sys.modules if m.startswith("hop") and sys.modules[m] is not None)
torch.save({"results": results, "error": error, "hop_modules": loaded}, outputs)
"""


def build_and_run(device: str, tmp: Path) -> dict[str, Any]:
    """Export the program (dynamic length), package it, run it in a fresh process."""
    example = cases(device, (4,))[0]
    length = torch.export.Dim("length")
    ep = torch.export.export(_Program(), example, dynamic_shapes=({0: length}, None, None, None))
    package = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp / "program.pt2"))
    runs = cases(device, (7, 1, 0))
    torch.save((runs, out_of_range(runs[0])), tmp / "inputs.pt")
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD, package, str(tmp / "inputs.pt"), str(tmp / "outputs.pt")],
        capture_output=True,
        text=True,
        cwd=tmp,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with zipfile.ZipFile(package) as z:
        cpp = "\n".join(z.read(n).decode() for n in z.namelist() if n.endswith(".cpp"))
    return {"cases": runs, "cpp": cpp, **torch.load(tmp / "outputs.pt")}


def exported_program(x: torch.Tensor, w: torch.Tensor, k: torch.Tensor, n: torch.Tensor) -> dict[str, Any]:
    """``program``, and a loop whose node says checkpoint=True (Note [the checkpoint
    keyword]): torch.compile refuses it, an exported graph holds it."""
    out = program(x, w, k, n)
    zero = torch.zeros((), dtype=torch.int64, device=x.device)
    body = lambda i, y: (i + 1, y * 1.5)  # noqa: E731
    out["checkpointed"] = hop.while_loop(lambda i, y: i < n, body, (zero, x), checkpoint=True)[1]
    return out


class _Program(torch.nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor, k: torch.Tensor, n: torch.Tensor) -> dict[str, Any]:
        return exported_program(x, w, k, n)


@pytest.fixture(scope="module")
def aoti(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return build_and_run("cpu", tmp_path_factory.mktemp("aoti"))


@pytest.mark.parametrize("op", [*OPS, "checkpointed"])
def test_aoti_package_matches_eager(aoti: dict[str, Any], op: str) -> None:
    for case, result in zip(aoti["cases"], aoti["results"], strict=True):
        assert same(result[op], exported_program(*case)[op]), (op, [tuple(t.shape) for t in case], case[2:])


def test_aoti_package_runs_without_hop(aoti: dict[str, Any]) -> None:
    assert aoti["hop_modules"] == []
    assert "torch.ops.hop" not in aoti["cpp"]
    assert "while (1)" in aoti["cpp"]  # Inductor's own loop, not a call back into Python


def test_aoti_switch_index_out_of_range_fails(aoti: dict[str, Any]) -> None:
    assert aoti["error"] is not None and "hop.switch: index out of range for 3 branches" in aoti["error"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_aoti_package_matches_eager_cuda(tmp_path: Path) -> None:
    run = build_and_run("cuda", tmp_path)
    assert run["hop_modules"] == []
    for case, result in zip(run["cases"], run["results"], strict=True):
        assert same(result, program(*case))
    assert run["error"] is not None


# --- torch.compile(backend="inductor") -------------------------------------------------------


class Recorder:
    """A user's post-grad pass: records the hop operators it sees (hop's pass runs first)."""

    def __init__(self) -> None:
        self.calls = 0
        self.seen: set[str] = set()

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.calls += 1
        self.seen |= {str(n.target) for n in graph.nodes if str(getattr(n.target, "__module__", "")) == "torch.ops.hop"}


def compile_and_run(device: str) -> dict[str, Any]:
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    recorder = Recorder()
    compiled = torch.compile(compiled_program, backend="inductor", fullgraph=True, dynamic=True)
    runs = cases(device, (7, 4))
    with inductor_config.patch(post_grad_custom_pre_pass=chain(recorder)):
        first, code = run_and_get_code(compiled, *runs[0])
        results = [first, *(compiled(*case) for case in runs[1:])]
        error = None
        try:  # not on CUDA: a device-side assert would leave this process's CUDA context unusable
            if device == "cpu":
                compiled(*out_of_range(runs[0]))
        except RuntimeError as e:
            error = str(e)
    return {"cases": runs, "results": results, "code": "\n".join(code), "recorder": recorder, "error": error}


@pytest.fixture(scope="module")
def compiled() -> Iterator[dict[str, Any]]:
    yield compile_and_run("cpu")
    torch._dynamo.reset()


@pytest.mark.parametrize("op", OPS)
def test_compile_inductor_matches_eager(compiled: dict[str, Any], op: str) -> None:
    for case, result in zip(compiled["cases"], compiled["results"], strict=True):
        assert same(result[op], compiled_program(*case)[op]), (op, [tuple(t.shape) for t in case], case[2:])


def test_compile_inductor_code_has_no_hop_call(compiled: dict[str, Any]) -> None:
    assert "torch.ops.hop" not in compiled["code"]
    assert re.search(r"\bwhile\b", compiled["code"])


def test_compile_user_pass_runs_after_hops(compiled: dict[str, Any]) -> None:
    """``chain(user_pass)`` keeps the user's pass; hop's has rewritten switch, map, scan
    and associative_scan before it (cond and while_loop are lowered directly)."""
    recorder = compiled["recorder"]
    assert recorder.calls > 0
    assert recorder.seen <= {"cond", "while_loop"}


def test_compile_switch_index_out_of_range_fails(compiled: dict[str, Any]) -> None:
    assert compiled["error"] is not None and "index out of range" in compiled["error"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compile_inductor_matches_eager_cuda() -> None:
    run = compile_and_run("cuda")
    for case, result in zip(run["cases"], run["results"], strict=True):
        assert same(result, compiled_program(*case))
    assert "torch.ops.hop" not in run["code"]


def test_compile_training_matches_eager() -> None:
    """Backward graphs hold scans (the derivatives of scan, map, associative_scan): rewritten
    too, with no buffer donated to a loop body (Note [donated buffers and subgraphs]). The
    default (static) compile: its fake mode refuses ``.item()`` unless hop allows it."""

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        def body(c: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            inner = hop.map(lambda q: (q * c).sin(), r)
            return c * w + inner.sum(0), inner * c

        c, ys = hop.scan(body, w, x)
        prefix = hop.associative_scan(lambda a, b: a * b, ys.tanh(), 0)
        return c.sum() + hop.cond(c.sum() > 0, lambda p: p.sum(), lambda p: p.mean(), (prefix,))

    torch._dynamo.reset()
    torch.manual_seed(0)  # float32 compiled vs eager: an unlucky draw puts c.sum() near 0, where they may pick
    x = torch.randn(5, 4, 3, requires_grad=True)  # different branches of the cond (seen once in CI)
    w = torch.randn(3, requires_grad=True)
    grads = torch.autograd.grad(torch.compile(f, backend="inductor", fullgraph=True)(x, w), (x, w))
    expected = torch.autograd.grad(f(x, w), (x, w))
    assert same(grads, expected)
    torch._dynamo.reset()


def test_compile_complex_scan() -> None:
    """Complex tensors: Inductor's pattern-matcher pass would skip the node; hop's rewrite does not."""

    def f(x: torch.Tensor) -> Any:
        return hop.scan(lambda c, r: (c * r, c + r), x[0], x)

    torch._dynamo.reset()
    x = torch.randn(5, 3, dtype=torch.complex64)
    assert same(torch.compile(f, backend="inductor", fullgraph=True)(x), f(x))
    torch._dynamo.reset()


def test_docs_aoti_example() -> None:
    """docs/deploy.md's AOTInductor example (a ```py block, which tests/test_docs.py skips),
    after the page's first block, which defines its model."""
    page = (ROOT / "docs" / "deploy.md").read_text()
    model = re.findall(r"^```python\n(.*?)^```", page, re.S | re.M)[0]
    blocks = re.findall(r"^```py\n(.*?)^```", page, re.S | re.M)
    assert len(blocks) == 1
    namespace = {"__name__": "docs_deploy_aoti"}
    exec(compile(model, "deploy.md[model]", "exec"), namespace)
    exec(compile(blocks[0], "deploy.md[aoti]", "exec"), namespace)


# --- registration ---------------------------------------------------------------------------

_FRESH = """
import sys, threading
import hop
assert "torch._inductor" not in sys.modules, "import hop imported Inductor"
import torch._inductor.config as config
mine = lambda graph: None
config.post_grad_custom_pre_pass = mine  # set before Inductor's lowerings load
import torch._inductor.lowering
from hop.compile.inductor import POST_GRAD_PASS
assert config.post_grad_custom_pre_pass == [POST_GRAD_PASS, mine], config.post_grad_custom_pre_pass
other = []
thread = threading.Thread(target=lambda: other.append(config.post_grad_custom_pre_pass))
thread.start()
thread.join()
assert other == [POST_GRAD_PASS], other  # a thread that sets nothing gets hop's pass
print("ok")
"""


def test_registration_is_lazy_and_keeps_a_users_pass() -> None:
    proc = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, cwd=ROOT)
    assert proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_chain_puts_hops_pass_first_once() -> None:
    def mine(graph: torch.fx.Graph) -> None:
        pass

    assert chain(None) == [POST_GRAD_PASS]
    assert chain(mine) == [POST_GRAD_PASS, mine]
    assert chain([mine, POST_GRAD_PASS]) == [mine, POST_GRAD_PASS]  # a list holding it is kept as it is


_FIRST_COMPILE_IN_A_PATCH = """
import torch, hop
import torch._inductor.config as config
scan = lambda xs: hop.scan(lambda c, x: (c + x, c * x), torch.zeros(2), xs)
xs = torch.randn(3, 2)
with config.patch(post_grad_custom_pre_pass=hop.compile.inductor.chain(lambda graph: None)):
    torch.testing.assert_close(torch.compile(scan, backend="inductor")(xs), scan(xs))
torch._dynamo.reset()  # after the patch, hop's pass is still the default
torch.testing.assert_close(torch.compile(lambda xs: scan(xs * 2), backend="inductor")(xs), scan(xs * 2))
print("ok")
"""


def test_the_first_compile_inside_a_config_patch_keeps_hops_pass_afterwards() -> None:
    proc = subprocess.run([sys.executable, "-c", _FIRST_COMPILE_IN_A_PATCH], capture_output=True, text=True, cwd=ROOT)
    assert proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_a_pass_set_without_hops_is_explained() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return hop.map(lambda r: r * 2, x)

    import torch._inductor.lowering  # hop registers here; a pass set before that would go after hop's
    from torch._inductor import config as inductor_config

    torch._dynamo.reset()
    with (
        inductor_config.patch(post_grad_custom_pre_pass=lambda graph: None),
        pytest.raises(Exception, match=r"hop\.map: .*post_grad_custom_pre_pass.*chain\(your_pass\)") as info,
    ):
        torch.compile(f, backend="inductor", fullgraph=True)(torch.randn(3, 2))
    assert any(isinstance(e, HopRuntimeError) for e in _causes(info.value))
    torch._dynamo.reset()


def _causes(e: BaseException | None) -> Iterator[BaseException]:
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__
