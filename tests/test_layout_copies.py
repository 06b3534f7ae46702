"""capsctl.layers.layout.permute_rows: the same bytes as a plain permuted copy, both passes."""

from __future__ import annotations

import pytest
import torch

from capsctl.layers.layout import _grouped, permute_rows


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((3, 5, 5, 7, 4, 4), torch.float32),  # 16-byte runs: 4x4 poses
        ((3, 5, 5, 7, 6, 6), torch.float32),  # 24-byte runs: no element that wide, plain copy
        ((3, 5, 5, 7, 4, 4), torch.float64),  # 32-byte runs: plain copy
        ((2, 3, 3, 5, 4, 2), torch.float32),  # 8-byte runs
        ((2, 3, 3, 5, 4, 4), torch.bfloat16),  # 8-byte runs
    ],
)
def test_forward_and_backward_match_a_plain_permute_bit_for_bit(
    shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype).requires_grad_(True)
    dims = (0, 4, 1, 2, 3, 5)
    out = permute_rows(x, dims)
    ref = x.permute(*dims).contiguous()
    assert out.is_contiguous() and out.dtype == dtype
    assert torch.equal(out, ref)
    grad = torch.randn(ref.shape, generator=g).to(dtype)
    (gx,) = torch.autograd.grad(out, x, grad)
    (rx,) = torch.autograd.grad(ref, x, grad)
    assert torch.equal(gx, rx)


def test_runs_of_four_floats_move_as_one_element() -> None:
    x = torch.zeros(2, 3, 4, 4)
    assert _grouped(x).dtype == torch.complex128
    assert _grouped(x[..., 1:3]).dtype == torch.float32  # offset 1 float: misaligned
    assert _grouped(x[..., 1:4]).dtype == torch.float32  # 12-byte runs: left as they are
    assert _grouped(torch.zeros(100)[1:97].view(2, 3, 4, 4)).dtype == torch.float32  # offset 1


def test_gradcheck_in_double() -> None:
    x = torch.randn(2, 3, 2, 3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: permute_rows(t, (2, 0, 3, 1, 4)), (x,))


def test_the_last_dim_must_stay_last() -> None:
    with pytest.raises(ValueError, match="last dim"):
        permute_rows(torch.zeros(2, 3, 4), (0, 2, 1))


@pytest.mark.parametrize("kind", ["expanded", "strided"])
def test_a_non_contiguous_gradient_comes_back_the_same(kind: str) -> None:
    x = torch.randn(2, 3, 3, 5, 4, 4, requires_grad=True)
    dims = (0, 4, 1, 2, 3, 5)
    out = permute_rows(x, dims)
    ref = x.permute(*dims).contiguous()
    if kind == "expanded":  # every stride 0, as sum()'s gradient is
        grad = torch.ones(()).expand(ref.shape)
    else:  # a slice of a wider tensor: rows 16 bytes apart in 32
        grad = torch.randn(*ref.shape[:-1], 8)[..., :4]
    (gx,) = torch.autograd.grad(out, x, grad)
    (rx,) = torch.autograd.grad(ref, x, grad)
    assert torch.equal(gx, rx)
