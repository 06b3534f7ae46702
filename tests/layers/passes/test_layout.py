"""capsctl.layers.passes.layout: permute_rows gives the same bytes as a plain permuted copy, both
passes; window_copy gives every window, and its gradient is the sum over the windows."""

from __future__ import annotations

import pytest
import torch

from capsctl.layers.passes.layout import _grouped, permute_rows, window_copy


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


def _windows_by_loops(t: torch.Tensor, k: int, s: int) -> torch.Tensor:
    """``[B=(b,h,w), J=(k,l,n), *e]``, window by window: the child at offset ``(i, j)`` of the
    window at output position ``(y, x)`` is ``t[:, s*y + i, s*x + j]``."""
    b, hh, ww = t.shape[:3]
    h, w = (hh - k) // s + 1, (ww - k) // s + 1
    rows = []
    for bi in range(b):
        for y in range(h):
            for x in range(w):
                win = [t[bi, s * y + i, s * x + j] for i in range(k) for j in range(k)]
                rows.append(torch.cat(win))  # [(k, l, n), *e] flattened over (k, l)
    return torch.stack(rows)


@pytest.mark.parametrize(
    ("shape", "k", "s"),
    [
        ((2, 7, 7, 3, 4), 3, 2),  # overlapping windows
        ((2, 6, 5, 3, 4), 3, 2),  # a last row and column in no window
        ((1, 6, 6, 2, 4), 2, 3),  # gaps between windows
        ((2, 5, 5, 3), 3, 1),  # activations: no pose dim
    ],
)
@pytest.mark.parametrize("child_major", [False, True])
def test_window_copy_and_its_gradient(
    shape: tuple[int, ...], k: int, s: int, child_major: bool
) -> None:
    g = torch.Generator().manual_seed(0)
    t = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
    out = window_copy(t, k, s, child_major=child_major)
    want = _windows_by_loops(t.detach(), k, s)  # [B, J, *e]
    assert torch.equal(out, want.transpose(0, 1) if child_major else want)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (got,) = torch.autograd.grad(out, t, grad)
    ref = _windows_by_loops(t, k, s)
    (expected,) = torch.autograd.grad(ref, t, grad.transpose(0, 1) if child_major else grad)
    assert torch.allclose(got, expected, atol=1e-12)
    strided = grad.transpose(0, 1).contiguous().transpose(0, 1)  # the same values, strided
    (again,) = torch.autograd.grad(window_copy(t, k, s, child_major=child_major), t, strided)
    assert torch.allclose(again, expected, atol=1e-12)


def _backbone_input(name: str, x: torch.Tensor) -> torch.Tensor:
    from capsctl.config import build_model

    model = build_model(name)
    seen: list[torch.Tensor] = []
    model.backbone.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    with torch.no_grad():
        model(x)
    return seen[0]


@pytest.mark.parametrize("name", ["cifar10-caps-simple", "cifar10-caps"])
def test_a_capsule_network_runs_its_convolutions_channels_last_on_a_cpu(name: str) -> None:
    x = torch.randn(2, 3, 32, 32)
    seen = _backbone_input(name, x)
    assert seen.is_contiguous(memory_format=torch.channels_last)
    assert not seen.is_contiguous()
    assert torch.equal(seen, x)


def test_images_channels_last_leaves_other_shapes_and_devices_alone() -> None:
    from capsctl.layers.passes.layout import images_channels_last

    x = torch.randn(2, 3, 8, 8)
    assert images_channels_last(x).is_contiguous(memory_format=torch.channels_last)
    flat = torch.randn(2, 3, 8)
    assert images_channels_last(flat) is flat
    meta = torch.empty(2, 3, 8, 8, device="meta")
    assert images_channels_last(meta) is meta
