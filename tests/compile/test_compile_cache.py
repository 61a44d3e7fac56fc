"""hop programs in the FX graph and AOTAutograd caches (Note [hop in the compile caches]):
a second process that compiles the same program loads its code; a program whose
branch changed compiles again. Each run is a fresh process sharing one cache dir."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import hop
from hop.compile.inductor import POST_GRAD_PASS

ROOT = Path(__file__).resolve().parents[2]

# argv[1]: the scale one branch applies (its code, so the cache key, changes with it);
# prints the caches' counters and whether forward and gradients equal eager's
_COMPILE = """
import sys
import torch
import hop
from torch._dynamo.utils import counters

scale = float(sys.argv[1])


def fn(x, w):
    y = hop.cond(x.sum() > 0, lambda a: (a @ w).tanh() * scale, lambda a: a.cos() - 1, (x,))
    carry, ys = hop.scan(lambda c, r: (c * 0.5 + r, (c * r).sin()), y[0], y)
    _, z = hop.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v * 0.9 + carry), (0, ys))
    return hop.switch((x.sum() > 1).long(), [lambda a: a * 2, lambda a: a.exp()], (z,))


torch.manual_seed(0)
w = torch.randn(4, 4, requires_grad=True)
results = {}
for name, x in (("pos", torch.rand(3, 4) + 0.5), ("neg", -torch.rand(3, 4))):
    x.requires_grad_(True)
    got = torch.compile(fn, backend="inductor", fullgraph=True)(x, w)
    g = torch.autograd.grad(got.sum(), (x, w))
    want = fn(x, w)
    h = torch.autograd.grad(want.sum(), (x, w))
    results[name] = torch.allclose(got, want) and all(torch.allclose(a, b) for a, b in zip(g, h))
fx = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
aot = {k: v for k, v in counters["aot_autograd"].items() if k.startswith("autograd_cache")}
print(repr({"same": results, "fx": fx, "aot": aot}))
"""


def _compile_in_a_fresh_process(cache: Path, scale: float) -> dict[str, Any]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE, str(scale)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    return result


def test_a_second_process_loads_the_compiled_program_and_a_changed_branch_compiles_again(tmp_path: Path) -> None:
    cold = _compile_in_a_fresh_process(tmp_path, 2.0)
    assert cold["same"] == {"pos": True, "neg": True}, cold
    assert "fxgraph_cache_bypass" not in cold["fx"] and "autograd_cache_bypass" not in cold["aot"], cold
    assert cold["aot"].get("autograd_cache_saved", 0) >= 1, cold

    warm = _compile_in_a_fresh_process(tmp_path, 2.0)
    assert warm["same"] == {"pos": True, "neg": True}, warm
    assert warm["aot"].get("autograd_cache_hit", 0) == cold["aot"]["autograd_cache_saved"], warm
    assert "autograd_cache_miss" not in warm["aot"], warm

    changed = _compile_in_a_fresh_process(tmp_path, 3.0)  # never the code of scale 2.0
    assert changed["same"] == {"pos": True, "neg": True}, changed
    assert changed["aot"].get("autograd_cache_miss", 0) >= 1 and "autograd_cache_hit" not in changed["aot"], changed


def test_hops_operators_are_cacheable_and_a_users_is_not_by_default() -> None:
    ops = [torch.ops.hop.cond, torch.ops.hop.switch, torch.ops.hop.while_loop, torch.ops.hop.map]
    ops += [torch.ops.hop.scan, torch.ops.hop.associative_scan]
    assert all(op.cacheable() for op in ops)
    # a user's operator has rules of its own, outside the hash that keys hop's entries
    assert not hop.HigherOrderOperator("a_users_cache_probe").cacheable()
    assert hop.HigherOrderOperator("a_users_cacheable_probe", cacheable=True).cacheable()


def test_the_key_covers_every_source_file_of_hop() -> None:
    from torch._inductor.custom_graph_pass import get_hash_for_files

    files = sorted(Path(hop.__file__).resolve().parent.rglob("*.py"))
    assert len(files) > 50 and any(f.name == "_reverse.py" for f in files)
    assert POST_GRAD_PASS.uuid() == get_hash_for_files(tuple(map(str, files)))
