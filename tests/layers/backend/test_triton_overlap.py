"""The reductions over a conv child's overlapping windows as Triton kernels
(capsctl/layers/backend/triton/overlap.py), run on the CPU by Triton's interpreter, against
references written from the definition: a child ``(b, Y, X, t)`` falls in the window of every
output site ``(h, w)`` with ``Y = h S + k``, ``X = w S + l``, ``0 <= k, l < K``, as entry
``J = (k, l, t)`` of site ``B = (b, h, w)``."""

from __future__ import annotations

import logging
import math
import os

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: the kernels run on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton cannot import (it ships with torch's CUDA wheels)")

from capsctl.layers.backend import dispatch  # noqa: E402
from capsctl.layers.backend.triton.overlap_ops import (  # noqa: E402
    triton_overlap_lse,
    triton_overlap_reduce,
)
from capsctl.layers.passes.layout import window_copy  # noqa: E402
from capsctl.layers.routers.em.windows import WindowGrid  # noqa: E402

F64 = torch.float64

# (b, H, W, n, K, S): overlapping 3x3 windows; stride 2 with an uncovered last row and column
# (H = 8: sites 0..2 reach row 6); 2x2 windows that do not overlap; one child type
GEOMETRIES = [(2, 5, 5, 3, 3, 1), (2, 8, 7, 2, 3, 2), (1, 4, 4, 1, 2, 2), (2, 6, 6, 4, 2, 1)]


def _geometry(b: int, hh: int, ww: int, n: int, k: int, s: int) -> list[int]:
    return [b, hh, ww, n, (hh - k) // s + 1, (ww - k) // s + 1, k, s]


def _members(geometry: list[int]) -> dict[tuple[int, int, int, int], list[tuple[int, int]]]:
    """Every child's entries ``(B, J)``, from the definition."""
    b, hh, ww, n, ho, wo, k, s = geometry
    found: dict[tuple[int, int, int, int], list[tuple[int, int]]] = {}
    for bb in range(b):
        for h in range(ho):
            for w in range(wo):
                for ky in range(k):
                    for kx in range(k):
                        for t in range(n):
                            child = (bb, h * s + ky, w * s + kx, t)
                            site, entry = (bb * ho + h) * wo + w, (ky * k + kx) * n + t
                            found.setdefault(child, []).append((site, entry))
    return found


@pytest.mark.parametrize("shape", GEOMETRIES, ids=str)
def test_each_entry_gets_its_childs_sum_and_max(shape: tuple[int, ...]) -> None:
    geometry = _geometry(*shape)
    b, _, _, n, ho, wo, k, _ = geometry
    x = torch.randn(b * ho * wo, k * k * n, generator=torch.Generator().manual_seed(0), dtype=F64)
    want_sum, want_max = torch.full_like(x, math.nan), torch.full_like(x, math.nan)
    for entries in _members(geometry).values():
        values = [x[i, j] for i, j in entries]
        for i, j in entries:
            want_sum[i, j], want_max[i, j] = sum(values), max(values)
    got_sum = triton_overlap_reduce(x, geometry, False, False, False)
    torch.testing.assert_close(got_sum, want_sum, rtol=1e-14, atol=1e-14)
    assert torch.equal(triton_overlap_reduce(x, geometry, False, False, True), want_max)


@pytest.mark.parametrize("shape", GEOMETRIES, ids=str)
@pytest.mark.parametrize("child_major", [False, True], ids=["site-major", "child-major"])
def test_the_child_grid_gets_the_sum_of_its_entries(
    shape: tuple[int, ...], child_major: bool
) -> None:
    """``to_grid``: the window copy's gradient, 4x4 pose entries; children in no window get 0."""
    geometry = _geometry(*shape)
    b, hh, ww, n, ho, wo, k, _ = geometry
    g = torch.randn(b * ho * wo, k * k * n, 4, 4, generator=torch.Generator().manual_seed(1))
    g = g.to(F64)
    want = torch.zeros(b, hh, ww, n, 4, 4, dtype=F64)
    for (bb, y, xx, t), entries in _members(geometry).items():
        want[bb, y, xx, t] = sum(g[i, j] for i, j in entries)
    src = g.transpose(0, 1).contiguous() if child_major else g  # [J, B, 4, 4]
    got = triton_overlap_reduce(src, geometry, child_major, True, False)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("shape", GEOMETRIES, ids=str)
def test_each_entry_gets_its_childs_log_sum_exp_over_all_its_parents(
    shape: tuple[int, ...],
) -> None:
    """From each entry's ``zmax`` and ``esum = sum_m exp(z - zmax)``: ``log sum_entries esum
    exp(zmax)``, the normalizer of EM's E-step over every parent the child votes for."""
    geometry = _geometry(*shape)
    b, _, _, n, ho, wo, k, _ = geometry
    gen = torch.Generator().manual_seed(2)
    zmax = torch.randn(b * ho * wo, k * k * n, generator=gen, dtype=F64) * 30.0  # wide range
    esum = torch.rand(zmax.shape, generator=gen, dtype=F64) * 3.0 + 1.0  # >= 1 (the max's 1)
    want = torch.full_like(zmax, math.nan)
    for entries in _members(geometry).values():
        terms = torch.stack([torch.log(esum[i, j]) + zmax[i, j] for i, j in entries])
        for i, j in entries:
            want[i, j] = torch.logsumexp(terms, 0)
    got = triton_overlap_lse(zmax, esum, geometry)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-12)


def test_bf16_entries_are_summed_in_float32() -> None:
    geometry = _geometry(2, 5, 5, 3, 3, 1)
    g = torch.randn(2 * 9, 27, 16, generator=torch.Generator().manual_seed(3)).bfloat16()
    got = triton_overlap_reduce(g, geometry, False, True, False)
    assert got.dtype == torch.bfloat16
    want = triton_overlap_reduce(g.double(), geometry, False, True, False)
    # float32 sums of the bf16 values, converted once to bf16: within one bf16 step (2^-7
    # relative: 7 stored mantissa bits) of the exact sum; bf16 sums would drift further
    assert ((got.double() - want).abs() <= want.abs() * 2.0**-7).all()


def test_the_overlap_ops_pass_opcheck() -> None:
    geometry = _geometry(2, 5, 5, 3, 3, 1)
    ops = torch.ops.capsctl
    x = torch.randn(18, 27)
    for to_grid, take_max in ((False, False), (False, True), (True, False)):
        args = (x, geometry, False, to_grid, take_max)
        torch.library.opcheck(ops.triton_overlap_reduce.default, args)
    poses = torch.randn(27, 18, 16)
    torch.library.opcheck(ops.triton_overlap_reduce.default, (poses, geometry, True, True, False))
    torch.library.opcheck(ops.triton_overlap_lse.default, (x, torch.rand(18, 27) + 1, geometry))


def test_mismatched_entries_and_a_max_to_the_grid_are_refused() -> None:
    geometry = _geometry(2, 5, 5, 3, 3, 1)
    with pytest.raises(ValueError, match="do not match"):
        triton_overlap_reduce(torch.randn(5, 27), geometry, False, True, False)
    with pytest.raises(ValueError, match="entries only"):
        triton_overlap_reduce(torch.randn(18, 27), geometry, False, True, True)


def test_the_window_grid_and_the_window_copy_take_the_kernels_where_triton_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inside ``dispatch.use("triton")`` the grid's sums and maxima and the window copy's
    gradient are one kernel launch each (the torch code: ``K*K`` operators), with the torch
    code's values; outside it they are torch code."""
    from capsctl.layers.backend.triton import aot as gpu_aot

    act = torch.zeros(2, 8, 7, 2)
    grid = WindowGrid.of(act, 3, 2)
    x = torch.randn(2 * 3 * 3, 18, generator=torch.Generator().manual_seed(4))
    want_sum, want_max = grid.sum_overwindow_sites(x), grid.max_overwindow_sites(x)
    poses = torch.randn(2, 8, 7, 2, 16, requires_grad=True)
    gw = torch.randn(18, 18, 16, generator=torch.Generator().manual_seed(5))
    (want_fold,) = torch.autograd.grad(window_copy(poses, 3, 2), poses, gw)
    with dispatch.use("triton"):
        got = (grid.sum_overwindow_sites(x), grid.max_overwindow_sites(x))
        (fold,) = torch.autograd.grad(window_copy(poses, 3, 2), poses, gw)
    torch.testing.assert_close(got[0], want_sum)
    assert torch.equal(got[1], want_max)
    torch.testing.assert_close(fold, want_fold)
    with gpu_aot.capturing() as launches:
        grid.sum_overwindow_sites(x)
        grid.max_overwindow_sites(x)
        torch.autograd.grad(window_copy(poses, 3, 2), poses, gw)
    assert [launch.kernel for launch in launches] == ["overlap_reduce"] * 3
    flags = [dict(launch.constexprs) for launch in launches]
    assert [(f["MAX"], f["TO_GRID"]) for f in flags] == [
        (False, False),
        (True, False),
        (False, True),
    ]


class _Failing:
    """Stands for a Triton kernel whose launch fails."""

    def __getitem__(self, grid):  # type: ignore[no-untyped-def]
        def launch(*args, **kwargs):  # type: ignore[no-untyped-def]
            raise RuntimeError("out of resources: shared memory")

        return launch


def test_failing_window_kernels_leave_the_torch_code_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where a window kernel fails at real shapes, the grid's sums and the window copy's
    gradient run as torch code, with the same values, after one warning naming the kernel."""
    from capsctl.layers.backend.triton import overlap

    monkeypatch.setattr(dispatch, "_FUSED_FAILED", {})
    monkeypatch.setattr(overlap, "overlap_reduce", _Failing())
    grid = WindowGrid.of(torch.zeros(1, 5, 5, 2), 3, 1)
    x = torch.randn(9, 18, generator=torch.Generator().manual_seed(6))
    poses = torch.randn(1, 5, 5, 2, 4, requires_grad=True)
    gw = torch.randn(9, 18, 4, generator=torch.Generator().manual_seed(7))
    want = grid.sum_overwindow_sites(x)
    (want_fold,) = torch.autograd.grad(window_copy(poses, 3, 1), poses, gw)
    with caplog.at_level(logging.WARNING), dispatch.use("triton"):
        got = [grid.sum_overwindow_sites(x) for _ in range(2)]
        (fold,) = torch.autograd.grad(window_copy(poses, 3, 1), poses, gw)
    torch.testing.assert_close(got[0], want)
    torch.testing.assert_close(got[1], want)
    torch.testing.assert_close(fold, want_fold)
    warned = [r.getMessage() for r in caplog.records if "overlap_sum" in r.getMessage()]
    assert len(warned) == 2, warned  # once for each set of shapes, not once a call
    assert "out of resources" in warned[0]
