"""Strict export of torch.vmap over a hop loop whose carry changes size (Dim.AUTO):
Dynamo binds the carry's unbacked size with aten.sym_size.int in the captured graphs,
which had no batching rule when the vmap rule ran them on batched tensors."""

import io

import pytest
import torch

import hop


def _while(x, y):
    return hop.while_loop(lambda i, a: i < 2, lambda i, a: (i + 1, x), (torch.tensor(0), y * 2))[1]


def _while_reads_size(x, y):  # a live size read of the generalized carry
    return hop.while_loop(lambda i, a: i < 2, lambda i, a: (i + 1, x * a.shape[0]), (torch.tensor(0), y * 2))[1]


def _fori(x, y):
    return hop.fori_loop(torch.tensor(0), torch.tensor(2), lambda i, a: x, y * 2)


class _M(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, y):
        return torch.vmap(self.fn)(x, y)


@pytest.mark.parametrize("fn", [_while, _while_reads_size, _fori])
@pytest.mark.parametrize("dims", [(1,), (0, 1)])
def test_strict_export_vmapped_loop_dim_auto(fn, dims):
    torch._dynamo.reset()
    x, y = torch.randn(3, 3), torch.randn(3, 3)
    spec = {d: torch.export.Dim.AUTO for d in dims}
    ep = torch.export.export(_M(fn), (x, y), dynamic_shapes=(spec, spec), strict=True)
    torch.testing.assert_close(ep.module()(x, y), torch.vmap(fn)(x, y))
    if 0 in dims:
        x2, y2 = torch.randn(4, 5), torch.randn(4, 5)
        torch.testing.assert_close(ep.module()(x2, y2), torch.vmap(fn)(x2, y2))
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)
    torch.testing.assert_close(loaded.module()(x, y), torch.vmap(fn)(x, y))


@pytest.mark.parametrize("fn", [_while, _while_reads_size])
def test_compile_vmapped_loop_dynamic(fn):
    torch._dynamo.reset()
    x, y = torch.randn(3, 3), torch.randn(3, 3)
    compiled = torch.compile(_M(fn), fullgraph=True, dynamic=True, backend="eager")
    torch.testing.assert_close(compiled(x, y), torch.vmap(fn)(x, y))
