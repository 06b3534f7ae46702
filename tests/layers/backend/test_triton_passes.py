"""The Triton passes (capsctl/layers/backend/triton/), run on the CPU by Triton's interpreter.

The routed pass of inverted dot-product attention routing (Tsai et al., ICLR 2020) and the
weighted pass (votes summed with given coefficients, as self-routing's), forward and backward,
against the equations written here as einsums in float64 over the full vote tensor, against
the torch passes of capsctl/layers/passes/ (dense and chunked), and by gradcheck; in fully
connected and convolutional site layouts (conv windows unfolded here from a child grid), with
one parent type, one child, block edges that leave partial tiles, and matrix (4 x 4) and
vector (1 x d) poses; self-routing's gated pass (Hahn et al., NeurIPS 2019), torch's logits
and the weighted pass's kernels, against its equations and the torch code; bf16 inputs summed
in float32;
then the custom ops' registration (fake, autograd, torch.compile).
"""

from __future__ import annotations

import math
import os

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: the kernels run on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton cannot import (it ships with torch's CUDA wheels)")

from capsctl.layers.backend import dispatch  # noqa: E402
from capsctl.layers.backend import triton as triton_backend  # noqa: E402
from capsctl.layers.backend.triton.gate_ops import triton_gate  # noqa: E402
from capsctl.layers.backend.triton.ops import (  # noqa: E402
    triton_routed,
    triton_weighted,
)
from capsctl.layers.passes.gated import SELF_ROUTING_EPS, gated_pass  # noqa: E402
from capsctl.layers.passes.routed import ChunkedRoutedPass, routed_pass_dense  # noqa: E402
from capsctl.layers.passes.weighted import ChunkedWeightedPass, weighted_pass_dense  # noqa: E402

F64 = torch.float64

# (J children per site, B sites, a, x, m parents, c, block_j, sites per program); block_j /
# sites 0: the default launch shape
SHAPES = {
    "fc-matrix-partial-tiles": (5, 3, 4, 4, 3, 4, 2, 2),
    "fc-vector-odd-dims": (7, 2, 1, 6, 5, 3, 4, 1),
    "one-parent": (4, 2, 4, 4, 1, 4, 0, 0),
    "one-child": (1, 3, 4, 4, 3, 4, 0, 2),
    "vector-default-launch": (6, 4, 1, 8, 4, 8, 0, 0),
    # 36-wide vectors (cifar100-dynamic): one child's weights for all parents outgrow a
    # program, so the routed pass is composed of weighted launches on blocks of parents
    "wide-vector-parent-blocks": (3, 5, 1, 36, 5, 36, 0, 0),
}


def _inputs(shape: tuple[int, ...], dtype: torch.dtype = F64, seed: int = 0):
    """Child poses ``x[J, B, a, x]``, weights ``w[J, x, m, c]``, parent poses ``p[B, m, a, c]``,
    coefficients ``r[J, B, m]`` (positive, as a routing's) and the scale ``1 / sqrt(a c)``."""
    j, bsz, a, xd, m, c = shape[:6]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(j, bsz, a, xd, generator=g, dtype=dtype)
    w = torch.randn(j, xd, m, c, generator=g, dtype=dtype) / math.sqrt(xd)
    p = torch.randn(bsz, m, a, c, generator=g, dtype=dtype)
    r = torch.rand(j, bsz, m, generator=g, dtype=dtype)
    return x, w, p, r, 1.0 / math.sqrt(a * c)


def votes_of(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``V_ij = X_i W_ij``, the pose on the left (a vector pose is a 1 x x matrix)."""
    return torch.einsum("jbax,jxmc->jbamc", x, w)  # [J, B, a, m, c]


def routed_equations(x, w, p, scale):  # type: ignore[no-untyped-def]
    """The paper's routed pass: ``a_ij = scale <p_j, V_ij>``, ``r_ij = softmax_j a_ij`` over the
    parents of the site, ``s_j = sum_i r_ij V_ij``."""
    v = votes_of(x, w)  # [J, B, a, m, c]
    agreement = torch.einsum("jbamc,bmac->jbm", v, p) * scale  # [J, B, m]
    r = torch.softmax(agreement, dim=-1)  # [J, B, m]: each child's sum to 1 over parents
    return torch.einsum("jbm,jbamc->bmac", r, v), r  # [B, m, a, c], [J, B, m]


def weighted_equations(x, w, r):  # type: ignore[no-untyped-def]
    """``s_j = sum_i r_ij V_ij`` with the coefficients given."""
    return torch.einsum("jbm,jbamc->bmac", r, votes_of(x, w))  # [B, m, a, c]


def _grads(out: torch.Tensor, inputs, seed: int = 1):  # type: ignore[no-untyped-def]
    """Gradients of ``<out, G>`` for a fixed random ``G``."""
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, inputs, g)


def _leaves(*ts: torch.Tensor):  # type: ignore[no-untyped-def]
    return [t.clone().requires_grad_() for t in ts]


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_routed_pass_matches_the_equations_in_float64(shape: tuple[int, ...]) -> None:
    x, w, p, _, scale = _inputs(shape)
    copies = [t.clone() for t in (x, w, p)]
    xs, ws, ps = _leaves(x, w, p)
    s, r = triton_routed(xs, ws, ps, scale, block_j=shape[6], sites=shape[7])
    xe, we, pe = _leaves(x, w, p)
    s_ref, r_ref = routed_equations(xe, we, pe, scale)
    assert s.dtype == F64 and s.shape == s_ref.shape and not r.requires_grad
    torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(r, r_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(r.sum(-1), torch.ones_like(r[..., 0]))  # softmax over parents
    for got, want in zip(_grads(s, (xs, ws, ps)), _grads(s_ref, (xe, we, pe)), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for t, before in zip((x, w, p), copies, strict=True):
        assert torch.equal(t, before)  # no input written to


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_weighted_pass_matches_the_equations_in_float64(shape: tuple[int, ...]) -> None:
    x, w, _, r, _ = _inputs(shape)
    xs, ws, rs = _leaves(x, w, r)
    s = triton_weighted(xs, ws, rs, block_j=shape[6], sites=shape[7])
    xe, we, re = _leaves(x, w, r)
    s_ref = weighted_equations(xe, we, re)
    torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-12)
    for got, want in zip(_grads(s, (xs, ws, rs)), _grads(s_ref, (xe, we, re)), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


GRADCHECK = ["fc-matrix-partial-tiles", "fc-vector-odd-dims", "one-parent"]


@pytest.mark.parametrize("name", GRADCHECK)
def test_routed_and_weighted_passes_pass_gradcheck(name: str) -> None:
    shape = SHAPES[name]
    x, w, p, r, scale = _inputs(shape, seed=2)
    tiles = {"block_j": shape[6], "sites": shape[7]}
    assert torch.autograd.gradcheck(
        lambda *t: triton_routed(*t, scale, **tiles)[0], _leaves(x, w, p), fast_mode=True
    )
    assert torch.autograd.gradcheck(
        lambda *t: triton_weighted(*t, **tiles), _leaves(x, w, r), fast_mode=True
    )


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_float32_passes_match_the_torch_passes(shape: tuple[int, ...]) -> None:
    """Float32 against capsctl/layers/passes/: the dense expressions and the chunked autograd
    functions (torch code, tile by tile), values and every gradient."""
    x, w, p, r, scale = _inputs(shape, dtype=torch.float32, seed=3)
    tiles = {"block_j": shape[6], "sites": shape[7]}
    tol = {"rtol": 1e-4, "atol": 1e-5}
    xs, ws, ps = _leaves(x, w, p)
    s, rt = triton_routed(xs, ws, ps, scale, **tiles)
    assert s.dtype == torch.float32 and rt.dtype == torch.float32
    got = _grads(s, (xs, ws, ps))

    def chunked(*t):  # type: ignore[no-untyped-def]
        return ChunkedRoutedPass.apply(*t, dispatch.choose(*t[:3]))

    for torch_pass in (routed_pass_dense, chunked):
        xe, we, pe = _leaves(x, w, p)
        with dispatch.use("chunked", sites=2):  # the torch code, forward and backward
            s_ref, r_ref = torch_pass(xe, we, pe, scale)
            want_g = _grads(s_ref, (xe, we, pe))
        torch.testing.assert_close(s, s_ref, **tol)
        torch.testing.assert_close(rt, r_ref.detach(), **tol)
        for g, want in zip(got, want_g, strict=True):
            torch.testing.assert_close(g, want, **tol)
    xs, ws, rs = _leaves(x, w, r)
    s = triton_weighted(xs, ws, rs, **tiles)
    got = _grads(s, (xs, ws, rs))
    chunked = dispatch.Choice("chunked", sites=2)
    for torch_pass in (weighted_pass_dense, lambda *t: ChunkedWeightedPass.apply(*t, chunked)):
        xe, we, re = _leaves(x, w, r)
        with dispatch.use("chunked"):
            s_ref = torch_pass(xe, we, re)
            want_g = _grads(s_ref, (xe, we, re))
        torch.testing.assert_close(s, s_ref, **tol)
        for g, want in zip(got, want_g, strict=True):
            torch.testing.assert_close(g, want, **tol)


def conv_sites(u: torch.Tensor, wk: torch.Tensor, stride: int):  # type: ignore[no-untyped-def]
    """A conv capsule layer's sites: child poses ``u[b, n, H, W, a, x]`` and weights
    ``wk[k, l, n, x, m, c]`` (shared over positions) -> ``x[J, B, a, x]`` with ``J = (n, k, l)``
    and ``B = (b, h, w)``, and ``w[J, x, m, c]``."""
    b, n, _, _, a, xd = u.shape
    k = wk.shape[0]
    win = u.unfold(2, k, stride).unfold(3, k, stride)  # [b, n, h, w, a, x, k, l]
    h, w_out = win.shape[2], win.shape[3]
    win = win.permute(1, 6, 7, 0, 2, 3, 4, 5)  # [n, k, l, b, h, w, a, x]
    x = win.reshape(n * k * k, b * h * w_out, a, xd)  # [J, B, a, x]
    w = wk.permute(2, 0, 1, 3, 4, 5).reshape(n * k * k, xd, *wk.shape[4:])  # [J, x, m, c]
    return x, w, (b, h, w_out)


def conv_equations(u, wk, pg, stride, scale):  # type: ignore[no-untyped-def]
    """The routed pass of a conv capsule layer on its grid: the parent at ``(h, w)`` takes the
    votes of the ``k x k`` window at ``(h stride, w stride)``; softmax over the parent types
    there. ``pg[b, h, w, m, a, c]`` -> ``s[b, h, w, m, a, c]``."""
    k = wk.shape[0]
    _, hh, ww = pg.shape[:3]
    out = torch.zeros_like(pg)
    for i in range(hh):
        for j in range(ww):
            win = u[:, :, i * stride : i * stride + k, j * stride : j * stride + k]
            v = torch.einsum("bnklax,klnxmc->bnklamc", win, wk)  # [b, n, k, l, a, m, c]
            agree = torch.einsum("bnklamc,bmac->bnklm", v, pg[:, i, j]) * scale  # [b,n,k,l,m]
            r = torch.softmax(agree, dim=-1)  # [b, n, k, l, m]
            out[:, i, j] = torch.einsum("bnklm,bnklamc->bmac", r, v)  # [b, m, a, c]
    return out


@pytest.mark.parametrize(
    "a, xd, c, stride", [(4, 4, 4, 1), (1, 5, 3, 2)], ids=["matrix-stride-1", "vector-stride-2"]
)
def test_conv_site_layout_matches_the_grid_equations(a: int, xd: int, c: int, stride: int) -> None:
    g = torch.Generator().manual_seed(4)
    b, n, grid, k, m = 2, 2, 5, 3, 3
    u = torch.randn(b, n, grid, grid, a, xd, generator=g, dtype=F64)
    wk = torch.randn(k, k, n, xd, m, c, generator=g, dtype=F64) / math.sqrt(xd)
    x, w, (_, h, w_out) = conv_sites(u, wk, stride)
    pg = torch.randn(b, h, w_out, m, a, c, generator=g, dtype=F64)
    p = pg.reshape(b * h * w_out, m, a, c)  # [B, m, a, c]
    scale = 1.0 / math.sqrt(a * c)
    s, _ = triton_routed(x, w, p, scale, block_j=4, sites=3)  # 18 children, 2*h*w sites
    want = conv_equations(u, wk, pg, stride, scale)  # [b, h, w, m, a, c]
    torch.testing.assert_close(s.view_as(want), want, rtol=1e-10, atol=1e-12)
    xs, ws, ps = _leaves(x, w, p)
    s = triton_routed(xs, ws, ps, scale, block_j=4, sites=3)[0]
    xe, we, pe = _leaves(x, w, p)
    for got, ref in zip(
        _grads(s, (xs, ws, ps)),
        _grads(routed_equations(xe, we, pe, scale)[0], (xe, we, pe)),
        strict=True,
    ):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    r = torch.rand(x.shape[0], x.shape[1], m, generator=g, dtype=F64)
    torch.testing.assert_close(
        triton_weighted(x, w, r, block_j=8, sites=5), weighted_equations(x, w, r)
    )


def test_only_the_needed_gradients_are_computed() -> None:
    x, w, p, r, scale = _inputs(SHAPES["fc-matrix-partial-tiles"])
    w_leaf = w.clone().requires_grad_()
    s, _ = triton_routed(x, w_leaf, p, scale, block_j=2, sites=2)
    (gw,) = _grads(s, (w_leaf,))
    we = w.clone().requires_grad_()
    torch.testing.assert_close(gw, _grads(routed_equations(x, we, p, scale)[0], (we,))[0])
    r_leaf = r.clone().requires_grad_()
    (gr,) = _grads(triton_weighted(x, w, r_leaf, block_j=2, sites=2), (r_leaf,))
    re = r.clone().requires_grad_()
    torch.testing.assert_close(gr, _grads(weighted_equations(x, w, re), (re,))[0])


def test_custom_ops_have_fake_implementations_and_autograd() -> None:
    x, w, p, r, scale = _inputs(SHAPES["one-child"], dtype=torch.float32)
    x, w, p, r = _leaves(x, w, p, r)
    ops = torch.ops.capsctl
    torch.library.opcheck(ops.triton_routed.default, (x, w, p, scale, [0, 0]))
    torch.library.opcheck(ops.triton_weighted.default, (x, w, r, [0, 0]))
    s, rr = ops.triton_routed(x, w, p, scale, [0, 0])
    g = torch.randn_like(s)
    args = (x.detach(), w.detach(), p.detach(), rr, g, scale, [True, False, True], [0, 0])
    torch.library.opcheck(ops.triton_routed_backward.default, args)
    args = (x.detach(), w.detach(), r.detach(), g, [False, True, True], [0, 0])
    torch.library.opcheck(ops.triton_weighted_backward.default, args)
    gx, wr, br, act = _leaves(*_gate_inputs(GATES["odd-width"], torch.float32))
    torch.library.opcheck(ops.triton_gate.default, (gx, wr, br, act))
    coef, mass = ops.triton_gate(gx, wr, br, act)
    args = (gx.detach(), wr.detach(), coef, act.detach(), torch.randn_like(mass))
    torch.library.opcheck(ops.triton_gate_backward.default, (*args, [True, True, False, True]))


def test_torch_compile_keeps_the_fused_passes_forward_and_backward() -> None:
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen: list[str] = []

    def record(gm: torch.fx.GraphModule, _inputs):  # type: ignore[no-untyped-def]
        seen.extend(str(nd.target) for nd in gm.graph.nodes if nd.op == "call_function")
        return make_boxed_func(gm.forward)

    def layer(x, w, p, scale):  # type: ignore[no-untyped-def]
        s, r = triton_routed(x, w, p, scale)
        return triton_weighted(x, w, r, 0, 0) + s

    x, w, p, _, scale = _inputs(SHAPES["one-parent"], dtype=torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=aot_autograd(fw_compiler=record), fullgraph=True)
    xs, ws, ps = _leaves(x, w, p)
    out = compiled(xs, ws, ps, scale)
    out.sum().backward()
    xe, we, pe = _leaves(x, w, p)
    s_ref, r_ref = routed_equations(xe, we, pe, scale)
    want = weighted_equations(xe, we, r_ref.detach()) + s_ref
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    want.sum().backward()
    for got, ref in zip((xs, ws, ps), (xe, we, pe), strict=True):
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-4, atol=1e-5)
    for op in ("triton_routed", "triton_weighted", "triton_routed_backward"):
        assert any(f"capsctl.{op}." in t for t in seen), (op, seen)
    assert not any("bmm" in t or "mm." in t or "einsum" in t for t in seen)  # no votes built


def test_the_backend_says_where_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    assert triton_backend.unavailable("cpu") == ""  # the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "CUDA" in triton_backend.unavailable("cpu")
    if not torch.cuda.is_available():
        assert triton_backend.unavailable("cuda") == "no CUDA device"
    assert "CUDA devices only" in triton_backend.unavailable("meta")


def _gated_inputs(shape: tuple[int, ...], dtype: torch.dtype = F64, seed: int = 5):
    """Activations ``act[B, J]`` in (0, 1), poses ``x[J, B, a, x]``, pose weights
    ``w[J, x, m, c]``, routing weights ``wr[J, a*x, m]`` and biases ``br[J, m]``."""
    j, bsz, a, xd, m, c = shape[:6]
    g = torch.Generator().manual_seed(seed)
    act = torch.rand(bsz, j, generator=g, dtype=dtype)
    x = torch.randn(j, bsz, a, xd, generator=g, dtype=dtype)
    w = torch.randn(j, xd, m, c, generator=g, dtype=dtype) / math.sqrt(xd)
    wr = torch.randn(j, a * xd, m, generator=g, dtype=dtype) / math.sqrt(a * xd)
    br = torch.randn(j, m, generator=g, dtype=dtype)
    return act, x, w, wr, br


def gated_equations(act, x, w, wr, br):  # type: ignore[no-untyped-def]
    """Self-routing: ``c_ij = softmax_j(W^route_i u_i + b^route_ij)`` over the parents, the
    mass ``c_ij a_i``; ``S_j = sum_i c_ij a_i V_ij`` and ``T_j = sum_i c_ij a_i``."""
    j, bsz, a, xd = x.shape
    logits = torch.einsum("jbi,jim->jbm", x.reshape(j, bsz, a * xd), wr) + br[:, None]  # [J,B,m]
    coef = torch.softmax(logits, dim=-1)  # [J, B, m]
    mass = coef * act.t()[:, :, None]  # [J, B, m]
    return torch.einsum("jbm,jbamc->bmac", mass, votes_of(x, w)), mass.sum(0), coef


def _gated_loss(out, seed: int = 6):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    return sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in out[:2])


GATED = ["fc-matrix-partial-tiles", "fc-vector-odd-dims", "one-parent", "one-child"]


def gate_equations(x, wr, br, act):  # type: ignore[no-untyped-def]
    """Self-routing's gate: ``c_ij = softmax_j(W^route_i u_i + b^route_ij)`` of child poses
    ``x[J, B, D]`` and the mass ``c_ij a_i`` (``[J, B, m]`` each)."""
    logits = torch.einsum("jbd,jdm->jbm", x, wr) + br[:, None]  # [J, B, m]
    coef = torch.softmax(logits, dim=-1)  # [J, B, m]
    return coef, coef * act.t()[:, :, None]  # [J, B, m]


# (J children, B sites, D = a*x, m parents): sites past a block of 64, one parent, a width
# below the tile's 16, one child
GATES = {
    "partial-site-blocks": (3, 70, 16, 5),
    "one-parent": (4, 5, 16, 1),
    "odd-width": (5, 3, 6, 3),
    "one-child": (1, 66, 4, 10),
}


def _gate_inputs(shape: tuple[int, ...], dtype: torch.dtype = F64, seed: int = 7):
    j, bsz, d, m = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(j, bsz, d, generator=g, dtype=dtype)
    wr = torch.randn(j, d, m, generator=g, dtype=dtype) / math.sqrt(d)
    br = torch.randn(j, m, generator=g, dtype=dtype)
    act = torch.rand(bsz, j, generator=g, dtype=dtype)
    return x, wr, br, act


@pytest.mark.parametrize("shape", GATES.values(), ids=GATES.keys())
def test_the_gate_kernels_match_the_equations(shape: tuple[int, ...]) -> None:
    ins = _leaves(*_gate_inputs(shape))
    coef, mass = triton_gate(*ins)
    assert not coef.requires_grad and mass.requires_grad
    ref_ins = _leaves(*_gate_inputs(shape))
    coef_want, mass_want = gate_equations(*ref_ins)
    torch.testing.assert_close((coef, mass), (coef_want, mass_want), rtol=1e-12, atol=1e-13)
    got = _grads(mass, ins)
    want = _grads(mass_want, ref_ins)
    for g_got, g_want in zip(got, want, strict=True):
        torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-12)
    # float32: the logits' product in tf32x3, float32's accuracy
    ins32 = _leaves(*_gate_inputs(shape, torch.float32))
    ref32 = [t.detach().double().requires_grad_() for t in ins32]
    got32 = triton_gate(*ins32)
    want32 = gate_equations(*ref32)
    for g_got, g_want in zip(got32, want32, strict=True):
        torch.testing.assert_close(g_got, g_want.float(), rtol=1e-5, atol=1e-6)
    gm = torch.randn(want32[1].shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    got_g = torch.autograd.grad(got32[1], ins32, gm.float())
    want_g = torch.autograd.grad(want32[1], ref32, gm)
    for g_got, g_want in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(g_got, g_want.float(), rtol=1e-4, atol=1e-5)


def test_the_gate_passes_gradcheck() -> None:
    x, wr, br, act = _leaves(*_gate_inputs(GATES["odd-width"]))
    assert torch.autograd.gradcheck(lambda *t: triton_gate(*t)[1], (x, wr, br, act))


def test_the_gate_computes_only_the_needed_gradients() -> None:
    x, wr, br, act = _gate_inputs(GATES["partial-site-blocks"])
    for i in range(4):
        ins = [t.clone().requires_grad_(k == i) for k, t in enumerate((x, wr, br, act))]
        (got,) = _grads(triton_gate(*ins)[1], (ins[i],))
        ref = [t.clone().requires_grad_(k == i) for k, t in enumerate((x, wr, br, act))]
        (want,) = _grads(gate_equations(*ref)[1], (ref[i],))
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_self_routing_runs_its_gate_as_kernels_not_torch_operators(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from capsctl.layers.backend.triton import aot as gpu_aot
    from capsctl.layers.passes import gated

    def no_torch_gate(*args: object) -> None:
        raise AssertionError("the torch gate ran where the Triton kernels run")

    monkeypatch.setattr(gated, "gate", no_torch_gate)
    monkeypatch.setattr(gated, "routing_logits", no_torch_gate)
    ins = _leaves(*_gated_inputs(SHAPES["fc-matrix-partial-tiles"], dtype=torch.float32))
    with gpu_aot.capturing() as launches:
        u, act_out, _ = gated_pass(*ins)
        (u.sum() + act_out.sum()).backward()
    kernels = [launch.kernel for launch in launches]
    assert kernels[:2] == ["gate_forward", "pass_forward"], kernels
    assert "gate_backward" in kernels and kernels.count("gate_forward") == 1, kernels


@pytest.mark.parametrize("name", GATED)
def test_gated_pass_matches_the_equations_and_the_torch_pass(name: str) -> None:
    # under the Triton backend self-routing is the gate's kernels and the Triton weighted pass
    shape = SHAPES[name]
    ins = _leaves(*_gated_inputs(shape))
    with dispatch.use("triton"):
        u, act_out, coef = gated_pass(*ins)
    assert not coef.requires_grad
    ref_ins = _leaves(*_gated_inputs(shape))
    s, total, coef_want = gated_equations(*ref_ins)
    u_want = s / (total + SELF_ROUTING_EPS)[:, :, None, None]  # [B, m, a, c]
    act_want = total / (ref_ins[0].sum(-1, keepdim=True) + SELF_ROUTING_EPS)  # [B, m]
    for got, ref in zip((u, act_out, coef), (u_want, act_want, coef_want), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    got_g = torch.autograd.grad(_gated_loss((u, act_out)), ins)
    want_g = torch.autograd.grad(_gated_loss((u_want, act_want)), ref_ins)
    for got, ref in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    # and the torch code's chunks, in float32
    ins = _leaves(*_gated_inputs(shape, dtype=torch.float32))
    with dispatch.use("triton"):
        got = gated_pass(*ins)
        got_g = torch.autograd.grad(_gated_loss(got), ins)
    ref_ins = _leaves(*_gated_inputs(shape, dtype=torch.float32))
    with dispatch.use("chunked", sites=2):
        want = gated_pass(*ref_ins)
        want_g = torch.autograd.grad(_gated_loss(want), ref_ins)
    tol = {"rtol": 1e-4, "atol": 1e-5}
    for got_t, ref in zip((*got, *got_g), (*want, *want_g), strict=True):
        torch.testing.assert_close(got_t, ref, **tol)


def test_bfloat16_inputs_are_summed_in_float32() -> None:
    """bf16 poses and weights: the coefficients as float32's on the same (rounded) inputs, the
    sum and every gradient rounded to bf16 only at the end."""
    shape = SHAPES["fc-matrix-partial-tiles"]
    x, w, p, _, scale = (t.bfloat16() if torch.is_tensor(t) else t for t in _inputs(shape))
    tiles = {"block_j": shape[6], "sites": shape[7]}
    half, full = _leaves(x, w, p), _leaves(x.float(), w.float(), p.float())
    (s, r), (s32, r32) = (triton_routed(*t, scale, **tiles) for t in (half, full))
    assert s.dtype == torch.bfloat16 and r.dtype == torch.float32
    torch.testing.assert_close(r, r32, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(s, s32.bfloat16())
    grads = torch.autograd.grad(s.float().sum(), half)
    for got, want in zip(grads, torch.autograd.grad(s32.sum(), full), strict=True):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want.bfloat16())


# The routed pass under bf16 autocast against the float64 equations on the unrounded inputs:
# bf16 keeps 8 significant bits, so inputs and results each carry a relative rounding of up to
# 2^-8; through the agreement and the softmax that is at most a few percent of the largest
# value. Written down here: 3e-2 of the largest reference value.
BF16_TOLERANCE = 3e-2


def test_bf16_reaches_the_kernels_under_autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    from capsctl.layers.backend.triton import ops
    from capsctl.layers.passes.routed import routed_pass_under_autocast

    seen: list[torch.dtype] = []
    real = ops.triton_routed

    def spy(x, w, p, scale, *rest):  # type: ignore[no-untyped-def]
        seen.append(x.dtype)
        return real(x, w, p, scale, *rest)

    with dispatch.use("triton"):  # the kernels' self-test runs on first use: before the spy
        assert dispatch.takes_triton(torch.zeros(1))
    monkeypatch.setattr(ops, "triton_routed", spy)
    shape = SHAPES["fc-matrix-partial-tiles"]
    x, w, p, _, scale = _inputs(shape)
    s64, _ = routed_equations(x, w, p, scale)
    x, w, p = x.float(), w.float(), p.float()
    with dispatch.use("triton"), torch.autocast("cpu", dtype=torch.bfloat16):
        s, r = routed_pass_under_autocast(x, w, p, scale)
    assert seen == [torch.bfloat16] and s.dtype == torch.bfloat16
    # the coefficients stay in the kernels' float32, as on every backend (no cast of R)
    assert r.dtype == torch.float32
    err = (s.double() - s64).abs().max() / s64.abs().max()
    assert err <= BF16_TOLERANCE
    # where the kernels do not run, the pass stays float32 under autocast
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s32, _ = routed_pass_under_autocast(x, w, p, scale)
    assert seen == [] and s32.dtype == torch.float32
    torch.testing.assert_close(s32.double(), s64, rtol=1e-5, atol=1e-5)


def test_self_routing_takes_bf16_votes_under_autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    """Self-routing's gated pass under bf16 autocast where the kernels run: the weighted pass
    gets bf16 poses and weights and the float32 mass; the pose and the activation against the
    float64 equations within :data:`BF16_TOLERANCE` (the activation, from float32 logits and
    mass, within float32's)."""
    from capsctl.layers.backend.triton import ops

    seen: list[tuple[torch.dtype, torch.dtype]] = []
    real = ops.triton_weighted

    def spy(x, w, r, *rest):  # type: ignore[no-untyped-def]
        seen.append((x.dtype, r.dtype))
        return real(x, w, r, *rest)

    with dispatch.use("triton"):
        assert dispatch.takes_triton(torch.zeros(1))
    monkeypatch.setattr(ops, "triton_weighted", spy)
    ins = _gated_inputs(SHAPES["fc-matrix-partial-tiles"])
    s64, total64, _ = gated_equations(*ins)
    u64 = s64 / (total64 + SELF_ROUTING_EPS)[:, :, None, None]  # [B, m, a, c]
    act64 = total64 / (ins[0].sum(-1, keepdim=True) + SELF_ROUTING_EPS)  # [B, m]
    ins32 = [t.float() for t in ins]
    with dispatch.use("triton"):
        u, act, _ = gated_pass(*ins32, autocast=torch.bfloat16)
    assert seen == [(torch.bfloat16, torch.float32)] and u.dtype == torch.float32
    assert (u.double() - u64).abs().max() / u64.abs().max() <= BF16_TOLERANCE
    torch.testing.assert_close(act.double(), act64, rtol=1e-5, atol=1e-6)
    # where the kernels do not run, all of it stays float32
    seen.clear()
    u32, _, _ = gated_pass(*ins32, autocast=torch.bfloat16)
    assert seen == []
    torch.testing.assert_close(u32.double(), u64, rtol=1e-4, atol=1e-5)


def test_the_routed_backward_builds_no_zero_gradient_of_the_coefficients() -> None:
    """R[J, B, m] is not differentiable and the backward never reads a gradient of it: none is
    built (a zero tensor as large as R, 231 MB a pass on cifar10-dynamic-simple at batch 128)."""
    from capsctl.layers.backend.triton.aot_ops import recording
    from capsctl.layers.passes.routed import routed_pass

    x, w, p, _, scale = _inputs(SHAPES["fc-matrix-partial-tiles"], torch.float32)
    for t in (x, w, p):
        t.requires_grad_(True)
    with dispatch.use("triton"):
        s, r = routed_pass(x, w, p, scale)
        with recording() as ops:
            s.sum().backward()
    fills = [o for o in ops if o.op in ("zeros", "zeros_like", "new_zeros", "zero_", "fill_")]
    assert not [o for o in fills if o.bytes >= r.numel() * r.element_size()]
    assert x.grad is not None and w.grad is not None and p.grad is not None


def test_a_wide_routed_pass_whose_parents_take_no_gradient() -> None:
    """36-wide vectors run the routed pass on blocks of parents; where ``P`` needs no gradient
    the backward takes ``dA`` without the launch that sums ``dP``: ``dX`` and ``dW`` still
    match the equations."""
    shape = SHAPES["wide-vector-parent-blocks"]
    x, w, p, _, scale = _inputs(shape, seed=4)
    xs, ws = _leaves(x, w)
    s, _ = triton_routed(xs, ws, p, scale)
    xe, we = _leaves(x, w)
    s_ref, _ = routed_equations(xe, we, p, scale)
    torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-12)
    for got, want in zip(_grads(s, (xs, ws)), _grads(s_ref, (xe, we)), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
