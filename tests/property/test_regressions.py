"""Programs hop.testing found wrong, shrunk by hypothesis, kept as plain regression tests.

Each test names the transform that disagreed and what was wrong.
"""

from __future__ import annotations

from typing import Any

import torch

import hop
from hop.testing import check


def test_associative_scan_jvp_of_an_empty_scan() -> None:
    """jvp / grad of a scan over a dimension of length 0 selected element 0 of nothing."""

    def program(x: torch.Tensor) -> Any:
        return hop.associative_scan(lambda a, b: a + b, x, dim=0)

    report = check(program, torch.zeros(0, 3, dtype=torch.float64), transforms=["eager", "autograd", "jvp", "vmap"])
    assert report.ran == ["eager", "autograd", "jvp", "vmap"]


def test_fori_loop_with_a_tensor_bound_inside_a_traced_body() -> None:
    """A tensor-bound fori_loop inside another loop's body made a tensor constant there,
    which torch.export.save cannot serialize."""

    def program(x: torch.Tensor) -> Any:
        inner = lambda i, a: hop.fori_loop(0, torch.full((), 2), lambda j, b: b + 0.1 * j, a)  # noqa: E731
        return hop.fori_loop(0, torch.full((), 2), inner, x)

    assert "export" in check(program, torch.ones(3), transforms=["eager", "export"]).ran


def test_cond_branches_with_different_strides() -> None:
    """The traced output was claimed contiguous while the true branch returned a transposed
    tensor (a later reshape became a view); now that branch's graph returns it contiguous."""

    def program(x: torch.Tensor) -> Any:
        return hop.cond(x.sum() > 0, lambda a: a.mT * 2.0, lambda a: a * 1.0, (x,)).reshape(-1)

    check(program, torch.arange(4.0).reshape(2, 2), transforms=["eager", "make_fx_fake"])


def test_while_loop_body_reads_its_initial_carry() -> None:
    """The body was traced on the carry tensors themselves, so reading the tensor the loop
    started with (a closure) read the carry; now it is traced on fresh tensors."""

    def program(y: torch.Tensor) -> Any:
        return hop.while_loop(lambda i, a: i < 2, lambda i, a: (i + 1, y.sin()), (0, y))[1]

    check(program, torch.tensor(0.5), transforms=["eager", "make_fx_fake"])


def test_tensor_constant_in_a_traced_body() -> None:
    """torch.tensor(...) in a traced body was a constant of the subgraph, which torch.export
    neither lifts nor saves; now it is lifted to the parent graph."""

    def program(x: torch.Tensor) -> Any:
        inner = lambda a: hop.while_loop(lambda j, b: j < 1, lambda j, b: (j + 1, b * 2), (torch.tensor(0), a))[1]  # noqa: E731
        return hop.while_loop(lambda i, a: i < 1, lambda i, a: (i + 1, inner(a)), (0, x))[1]

    check(program, torch.ones(2), transforms=["eager", "export"])


def test_closure_sizes_in_symbolic_make_fx() -> None:
    """A branch that lifted one size twice (two SymInts of one expression) kept a stray
    placeholder; now every duplicate maps to the one lifted argument."""

    def program(x: torch.Tensor, y: torch.Tensor) -> Any:
        return hop.cond(x.sum() > 0, lambda a: y.reshape(-1).reshape(y.shape), lambda a: a, (x,))

    check(program, torch.ones(3, 2), torch.ones(3, 2), transforms=["eager", "make_fx_symbolic"])


def test_scan_jvp_of_an_empty_scan_with_a_boolean_mask() -> None:
    """jvp of a length-0 scan shaped its ys by faking the differentiated combine_fn, where a
    boolean mask cannot be guarded; now the body itself is run on plain stand-ins."""

    def program(y: torch.Tensor) -> Any:
        return hop.scan(lambda c, r: (c + r[r > 0].sum(), r), y.sum(0), y)

    check(program, torch.zeros(0, 3), transforms=["eager", "jvp"])


def test_map_jvp_of_an_empty_map_keeps_the_tangent_dtype() -> None:
    """jvp of a length-0 map gave a float64 tangent for a float32 input (the differentiated
    body promoted on 0-dim fake slices); now the ys carry no tangent of their own."""

    def program(y: torch.Tensor) -> Any:
        return hop.map(lambda r: r * 0.1, y)

    check(program, torch.zeros(0), transforms=["eager", "jvp"])


def test_jvp_of_an_empty_scan_whose_body_nests_a_cond() -> None:
    """Found by the long profile: shaping a length-0 scan under jvp ran the body at the jvp
    level, where a nested cond on fake stand-ins hit a functorch level assert."""

    def program(x: torch.Tensor) -> Any:
        def step(c: torch.Tensor, r: torch.Tensor) -> Any:
            y = r * c
            return c + r, hop.cond(y.sum() > 0, lambda a: y, lambda a: y, (y,))

        return hop.scan(step, x.sum(0), x)[1]

    assert "jvp" in check(program, torch.zeros(0), transforms=["eager", "jvp"]).ran


def test_jvp_of_a_cond_over_an_empty_map_of_loops() -> None:
    """Found by the long profile: a length-0 map under jvp, inside a cond, whose body is a
    while_loop with an int counter (tangent of a non-differentiable carry; an int in a jvp)."""

    def program(x: torch.Tensor) -> Any:
        def rows(a: torch.Tensor) -> Any:
            return hop.map(lambda r: hop.while_loop(lambda i, v: i < 0, lambda i, v: (i + 1, v), (0, r))[1], a)

        return hop.cond(x.sum() > 0, lambda a: a, rows, (x,))

    assert "jvp" in check(program, torch.zeros(0), transforms=["eager", "jvp"]).ran


def test_traced_scan_body_sees_the_layout_it_was_traced_with() -> None:
    """Found by the long profile: a traced body bakes `reshape` as `view` on the contiguous
    carry it was traced with, while later iterations passed a non-contiguous carry (the
    result of a nested scan along the last dim). Traced bodies now get contiguous values."""

    def program(x: torch.Tensor) -> Any:
        def inner(s: torch.Tensor) -> torch.Tensor:
            c, ys = hop.scan(lambda c, r: (c + r, r * c), s.sum(-1), s, dim=-1)
            return ys + c.unsqueeze(-1)  # type: ignore[no-any-return]

        def step(c: torch.Tensor, r: torch.Tensor) -> Any:
            t = c + r
            return inner(t * t.reshape(-1).amax()), r * c

        c, ys = hop.scan(step, x.sum(0), x)
        return ys + c.unsqueeze(0)

    assert "make_fx_fake" in check(program, torch.rand(2, 2, 2), transforms=["eager", "make_fx_fake", "export"]).ran


def test_vmap_of_a_boolean_mask_after_an_associative_scan_is_a_torch_limitation() -> None:
    """torch.vmap cannot batch a boolean mask; on a zero-size tensor batched at another
    dimension it raises IndexError "Dimension out of range" (not its usual message),
    which check() took for a failure of hop. Now vmap of the plain-Python program is
    tried too: when it fails as well, the transform does not apply."""

    def program(x: torch.Tensor) -> Any:
        inner = hop.associative_scan(torch.logaddexp, x, dim=-1, combine_mode="pointwise")
        return inner + inner[inner > 0].sum()

    report = check(program, torch.zeros(0), transforms=["eager", "vmap"])
    # (with the scan's output batched at dim 0, torch's message names the mask's shape)
    reasons = ("plain-Python program too", "a boolean mask of a zero-size tensor")
    assert report.ran == ["eager"] and any(r in report.skipped["vmap"] for r in reasons)


def test_vmap_jvp_compares_tangents_in_the_primal_dtype() -> None:
    """Found by the long profile: torch's forward AD gives a 0-dim output a float64
    tangent where a Python float took part (``x * 0.5``), and the same output batched
    its primal's dtype; vmap_jvp compared the reference's per-row float64 tangent with
    hop's batched float32 one."""

    def program(x: torch.Tensor) -> Any:
        return hop.switch((x.sum().abs() * 3).long() % 1, [lambda a: a], (x * 0.5,))

    report = check(program, torch.tensor(0.0), transforms=["eager", "vmap_jvp"])
    assert report.ran == ["eager", "vmap_jvp"]


def test_a_traced_loop_over_an_empty_carry_with_a_stride_zero() -> None:
    """Found by the long profile (layouts): a carry with no element and a stride 0
    (an empty tensor expanded, or channels-last) counted as overlapping, and the trace
    made it contiguous, which left it as it was, then traced again: RecursionError."""
    from hop.testing.strategies import with_layout

    def loops(x: torch.Tensor) -> Any:
        counted = hop.fori_loop(0, 0, lambda i, a: a + 0.1 * i, x)
        return counted, hop.while_loop(lambda i, a: i < 0, lambda i, a: (i + 1, a), (0, x))[1]

    for x in (
        with_layout(torch.zeros(0, 0, 2), "channels_last"),
        with_layout(torch.zeros(2, 0), "expanded"),
    ):
        report = check(loops, x, transforms=["eager", "make_fx_fake", "make_fx_symbolic", "export"])
        assert report.ran == ["eager", "make_fx_fake", "make_fx_symbolic", "export"], report


def test_batched_gradients_in_float32_compare_within_a_batched_kernels_rounding() -> None:
    """Found by the long profile: vmap_grad of a scan whose body squares a matmul and
    scales by an amax differed from the rows' gradients by 7e-6 relative in float32 (a
    batched matmul sums in another order), beyond assert_close's float32 default."""

    def program(x: torch.Tensor) -> Any:
        def body(c: torch.Tensor, r: torch.Tensor) -> Any:
            t = c + r
            t = t + (t.reshape(1, -1) @ t.reshape(-1, 1)).reshape(()) * 0.1
            t = t * t.reshape(-1).amax() if t.numel() else t
            return t.sin(), r * c

        carry, ys = hop.scan(body, x.sum(0), x, dim=0, reverse=False)
        return ys + carry.unsqueeze(0)

    x = torch.tensor([[[0.0, 0.0, 0.0], [1.0, 0.0, 1.0]]])
    report = check(program, x, transforms=["eager", "vmap_grad"])
    assert report.ran == ["eager", "vmap_grad"]


def test_inductor_values_in_float32_compare_within_its_rounding() -> None:
    """Found by the compiled long profile: Inductor's scan of squares growing to 1e6 in
    float32 differed from eager by 1.6e-6 relative (fused, vectorized arithmetic),
    beyond assert_close's float32 default; float64 keeps the defaults."""
    from hop.testing.strategies import with_layout

    def program(x: torch.Tensor, y: torch.Tensor) -> Any:
        return (
            (
                lambda s8: (lambda out: out[1] + out[0].unsqueeze(-1))(
                    hop.scan(
                        lambda c_s8, r_s8: (
                            (
                                lambda c3: (
                                    lambda o4: hop.cond(
                                        o4.sum() > 0, lambda a5, a5_extra: a5, lambda a6, a6_extra: a6, (o4, o4)
                                    )
                                )((c3 * c3))
                            )(c_s8 + r_s8),
                            (lambda y7: y7)(r_s8 * c_s8),
                        ),
                        s8.sum(-1),
                        s8,
                        dim=-1,
                        reverse=False,
                    )
                )
            )(hop.while_loop(lambda i1, a2: i1 < 1, lambda i1, a2: (i1 + 1, (x - y)), (torch.tensor(0), y))[1]),
        )

    x = with_layout(
        torch.tensor(
            [
                [
                    [1.296863079071045, 1.8018039464950562, -1.0489908456802368],
                    [-1.7389488220214844, -9.999999747378752e-06, -1.0982125997543335],
                    [1.6780341863632202, -1.7314224243164062, -1.2990177657448302e-31],
                    [0.5, 1.1754943508222875e-38, -0.11776846647262573],
                ],
                [
                    [-1.4887276887893677, -1.6176036596298218, -0.030221208930015564],
                    [-1.3321537971496582, -1.5124962329864502, 1.401298464324817e-45],
                    [0.0, -0.11740592867136002, -0.0],
                    [-0.0, -0.2018340677022934, 1.6651980876922607],
                ],
                [
                    [-0.6523667573928833, 1.1754943508222875e-38, -1.0031360387802124],
                    [2.0, -0.48067426681518555, -1.6566588878631592],
                    [0.0, -1.3614373207092285, 1.6541247367858887],
                    [1.2040495872497559, 1.8541769981384277, 1.4450379610061646],
                ],
                [
                    [0.0, 1.154653787612915, -0.0],
                    [-1.2149314880371094, 0.41275787353515625, -0.10446228086948395],
                    [-1.1920928955078125e-07, -0.0, 1.1754943508222875e-38],
                    [0.8638138771057129, 9.999999747378752e-06, 0.5],
                ],
            ],
            dtype=torch.float32,
        ).reshape((4, 4, 3)),
        "transposed",
    )
    block = [
        [-0.0, 0.5141817927360535, 0.0],
        [0.01851796731352806, 2.0, 1.1754943508222875e-38],
        [0.3935348391532898, -0.21449795365333557, -0.0],
        [0.08854302763938904, -0.08800515532493591, 0.01600000075995922],
    ]
    y = torch.tensor([block]).expand(4, 4, 3)  # with_layout's "expanded": stride 0 along dim 0
    report = check(program, x, y, transforms=["eager", "compile_inductor"])
    assert report.ran == ["eager", "compile_inductor"]


def test_a_traced_loop_body_runs_on_the_layout_it_was_traced_with() -> None:
    """Found by the compiled long profile (layouts): a fori_loop body calling `reshape`
    was traced on a contiguous carry (a `view`), and the fake rule ran that graph on the
    channels-last initial carry: "Cannot view a tensor" under aot_eager and export."""
    from hop.testing.strategies import with_layout

    def program(x: torch.Tensor) -> Any:
        return hop.fori_loop(0, 3, lambda i, t: t.reshape(1, -1).reshape(t.shape) * 0.5 + 1.0, x)

    for layout in ("channels_last", "transposed"):
        x = with_layout(torch.rand(2, 3, 4, 2, dtype=torch.float64), layout)
        transforms = ["eager", "make_fx_symbolic", "export", "compile_aot_eager", "compile_inductor"]
        assert check(program, x, transforms=transforms).ran == transforms


def test_a_switch_branch_returning_an_expanded_empty_tensor_compiles() -> None:
    """Found by the compiled long profile: an empty tensor of stride 0 (expanded) returned
    by one branch beside a contiguous one from another was not made contiguous (the
    contiguity check stepped over a size-0 dim as a 0, not as torch's 1), and Inductor's
    cond refused branch outputs whose stride orders differ."""
    from hop.testing.strategies import with_layout

    def program(x: torch.Tensor, y: torch.Tensor) -> Any:
        index = (x.reshape(-1)[:1].sum() > 0).long() + 1
        return hop.switch(index % 3, [lambda a: a, lambda a: a * 2, lambda a: y], (hop.map(lambda r: r, x.sigmoid()),))

    x, y = (with_layout(torch.zeros(3, 4, 0), "expanded") for _ in range(2))
    assert check(program, x, y, transforms=["eager", "compile_inductor"]).ran == ["eager", "compile_inductor"]
