"""The demo behind ``python -m hop``: a model with data-dependent control flow,
run eagerly, differentiated (reverse and forward mode), vmapped, exported with
torch.export, saved, loaded and run again, with a short report.

hop.cond and hop.switch are in the model; then a loop until convergence
(hop.while_loop), a counted loop (hop.fori_loop), a recurrence (hop.scan), a
per-row map (hop.map), a running sum (hop.associative_scan), and outputs whose size
depends on the data. This file is the demo's whole code.
"""

from __future__ import annotations

import io
import time
from typing import Any

import torch

import hop


class Model(torch.nn.Module):
    """A block whose path depends on the data.

    - ``hop.cond``: rows are renormalized only when the batch's activations blow up;
    - ``hop.switch``: a per-call mode (a tensor computed from the input) picks the
      activation.
    """

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("limit", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h = hop.cond(
            h.norm() > self.limit,
            lambda a: a / a.norm(dim=-1, keepdim=True) * self.limit,  # closes over a buffer
            lambda a: a.clone(),
            (h,),
        )
        mode = (x.abs().mean() * 3).long().clamp(0, 2)
        out: torch.Tensor = hop.switch(mode, [torch.relu, torch.tanh, torch.sigmoid], (h,))
        return out.sum(-1)


def reference(model: Model, x: torch.Tensor) -> torch.Tensor:
    """The same model written with Python ``if`` and indexing."""
    h = model.lin(x)
    if h.norm() > model.limit:
        h = h / h.norm(dim=-1, keepdim=True) * model.limit
    mode = int((x.abs().mean() * 3).long().clamp(0, 2))
    return [torch.relu, torch.tanh, torch.sigmoid][mode](h).sum(-1)


def _timed(fn: Any, n: int = 200) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    torch.manual_seed(0)
    model = Model()
    inputs = [torch.randn(3, 4) * s for s in (0.1, 1.0, 5.0)]
    report: list[tuple[str, str]] = []

    for x in inputs:
        torch.testing.assert_close(model(x), reference(model, x))
    report.append(("eager", f"matches the Python-if reference on {len(inputs)} inputs (every path)"))

    x = inputs[1]
    model(x).sum().backward()
    grad_hop = model.lin.weight.grad
    assert grad_hop is not None
    model.zero_grad()
    reference(model, x).sum().backward()  # type: ignore[no-untyped-call]
    torch.testing.assert_close(grad_hop, model.lin.weight.grad)
    report.append(("autograd", f"|d/dW| = {grad_hop.norm():.4f}, equal to the reference's"))

    params = dict(model.named_parameters())
    tangent = {k: torch.ones_like(v) for k, v in params.items()}
    jvp_out = torch.func.jvp(lambda p: torch.func.functional_call(model, p, (x,)), (params,), (tangent,))[1]
    report.append(("jvp", f"forward-mode derivative along all-ones weights, one per row: {tuple(jvp_out.shape)}"))

    batch = torch.stack(inputs)
    per_example = torch.vmap(model)(batch)
    torch.testing.assert_close(per_example, torch.stack([model(b) for b in inputs]))
    report.append(("vmap", "batched predicate and index: every path, selected per example"))

    start = time.perf_counter()
    ep = torch.export.export(model, (x,), dynamic_shapes={"x": {0: torch.export.Dim("batch")}})
    ops = sorted({repr(n.target) for n in ep.graph.nodes if isinstance(n.target, hop.HigherOrderOperator)})
    report.append(("torch.export", f"{(time.perf_counter() - start) * 1e3:.0f} ms, nodes: {', '.join(ops)}"))

    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer).module()
    for v in [*inputs, torch.randn(7, 4)]:
        torch.testing.assert_close(loaded(v), model(v).detach())
    report.append(("save/load/run", f"{buffer.getbuffer().nbytes} bytes, matches eager at batch 3 and 7"))

    # torch.compile: the whole model is one graph, hop's operators captured as torch.ops.hop.* nodes
    start = time.perf_counter()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
    for v in [*inputs, torch.randn(7, 4)]:
        torch.testing.assert_close(compiled(v), model(v))
    report.append(("torch.compile", f"fullgraph, {time.perf_counter() - start:.1f} s, matches eager at batch 3 and 7"))
    torch.compiler.reset()

    # a loop until convergence (hop.while_loop) and a recurrence over a sequence (hop.scan)
    target = torch.tensor(2.0)
    (root,) = hop.while_loop(
        lambda r: (r * r - target).abs() > 1e-6, lambda r: (0.5 * (r + target / r),), (torch.tensor(1.0),)
    )
    torch.testing.assert_close(root, target.sqrt())
    cell = torch.nn.GRUCell(4, 4)
    seq = torch.randn(5, 1, 4)
    h, _ = hop.scan(lambda c, x: (cell(x, c), cell(x, c).sum()), torch.zeros(1, 4), seq)
    ref_h = torch.zeros(1, 4)
    for x_t in seq:
        ref_h = cell(x_t, ref_h)
    torch.testing.assert_close(h, ref_h)
    decayed = hop.fori_loop(0, 10, lambda i, v: v * 0.5, torch.ones(2))
    torch.testing.assert_close(decayed, torch.full((2,), 0.5**10))
    norms = hop.map(lambda row: row.norm(), seq[:, 0])
    torch.testing.assert_close(norms, seq[:, 0].norm(dim=-1))
    running = hop.associative_scan(lambda a, b: a + b, seq[:, 0], 0)
    torch.testing.assert_close(running, seq[:, 0].cumsum(0))
    report.append(("loops", f"while_loop: Newton sqrt(2) = {root.item():.6f}; scan: a GRU over {len(seq)} steps"))
    report.append(("", "fori_loop: 10 halvings; map: a norm per row; associative_scan: a running sum; all match"))

    # data-dependent sizes: each branch keeps a different number of values; exported,
    # the two outputs share one unbacked size (no Eq assert) and its range is asserted
    class Kept(torch.nn.Module):
        def forward(self, v: torch.Tensor) -> torch.Tensor:
            def pos(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                m = v[v > 0]
                return m, m * 2

            def neg(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                m = v[v < 0]
                return m, -m

            a, b = hop.cond(v.sum() > 0, pos, neg, (v,))
            total: torch.Tensor = a + b
            return total

    kept = torch.export.export(Kept(), (torch.tensor([1.0, -2.0, 3.0]),))
    asserts = [str(n.args[1]) for n in kept.graph.nodes if n.target is torch.ops.aten._assert_scalar.default]
    for v in (torch.tensor([1.0, -2.0, 3.0]), torch.tensor([-1.0, -2.0, 3.0])):
        torch.testing.assert_close(kept.module()(v), Kept()(v))
    report.append(("unbacked", f"sizes known at run time only: 2 outputs share one, {len(asserts)} asserts check it"))

    p, small = torch.tensor(True), torch.randn(8)
    t_hop = _timed(lambda: hop.cond(p, torch.sin, torch.cos, (small,)))
    t_py = _timed(lambda: torch.sin(small) if p else torch.cos(small))
    report.append(("eager cost", f"hop.cond {t_hop:.1f} us vs Python if {t_py:.1f} us per call, no compile step"))

    print("hop demo: control flow that depends on the data, with all seven operators (code: hop/_demo.py)")
    for step, result in report:
        print(f"  {step:<14} {result}")
    print("  operators at torch.ops.hop:", ", ".join(sorted(hop.registered_ops())))


if __name__ == "__main__":
    main()
