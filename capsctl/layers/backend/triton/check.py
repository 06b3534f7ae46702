"""The Triton kernels' self-test on a device, before a model's passes are handed to them.

A kernel that Triton cannot compile for the device's architecture or Triton version, or one
that computes wrong numbers there, must not break or silently spoil a user's training: the
first time the dispatch (capsctl/layers/backend/dispatch.py) would choose the kernels on a
device, :func:`self_test` runs every custom op of ops.py and em_ops.py, forward and backward,
on small float32 inputs against the same math written here as einsums (autograd for the
gradients), with partial tiles and both pose kinds. Any exception or a difference above
:data:`RTOL` of the largest reference value is the reason the dispatch gives for running the
torch code instead (with one warning). Every output is checked, so a kernel that writes
nothing fails too.

Letters and layouts as in capsctl/layers/passes/routed.py and em_moments.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["RTOL", "self_test"]

RTOL = 1e-3  # of the largest reference value: float32 sums in another order (atomic adds)
# (J, B, a, x, m, c): 4x4 matrix poses with partial tiles, and 1 x 6 vector poses
SHAPES = ((5, 3, 4, 4, 3, 4), (3, 2, 1, 6, 5, 3))


def _votes(x: Tensor, w: Tensor) -> Tensor:
    return torch.einsum("jbax,jxmc->jbamc", x, w)  # [J, B, a, m, c]


def _routed(x: Tensor, w: Tensor, p: Tensor, scale: float) -> tuple[Tensor, ...]:
    v = _votes(x, w)  # [J, B, a, m, c]
    r = torch.softmax(torch.einsum("jbamc,bmac->jbm", v, p) * scale, -1)  # [J, B, m]
    return torch.einsum("jbm,jbamc->bmac", r, v), r  # [B, m, a, c], [J, B, m]


def _weighted(x: Tensor, w: Tensor, r: Tensor) -> tuple[Tensor, ...]:
    return (torch.einsum("jbm,jbamc->bmac", r, _votes(x, w)),)  # [B, m, a, c]


def _shifted(x: Tensor, w: Tensor, shift: Tensor) -> Tensor:
    return torch.einsum("jbax,jxmc->bjmac", x, w) - shift[:, None]  # [B, J, m, a, c]


def _moments(r: Tensor, act: Tensor, x: Tensor, w: Tensor, shift: Tensor) -> tuple[Tensor, ...]:
    u = _shifted(x, w, shift)  # [B, J, m, a, c]
    k = r * act[:, :, None]  # [B, J, m]
    s1 = torch.einsum("bjm,bjmac->bmac", k, u)  # [B, m, a, c]
    return s1, torch.einsum("bjm,bjmac->bmac", k, u * u), k.sum(1)


def _quad(q: Tensor, p: Tensor, x: Tensor, w: Tensor, shift: Tensor) -> tuple[Tensor, ...]:
    u = _shifted(x, w, shift)  # [B, J, m, a, c]
    return (torch.einsum("bjmac,bmac->bjm", u, q) + torch.einsum("bjmac,bmac->bjm", u * u, p),)


def _compare(name: str, fused: tuple[Tensor, ...], ref: tuple[Tensor, ...], leaves: list) -> None:
    """Outputs, then the gradients of one random projection of the outputs the fused op makes
    differentiable (the coefficients are not)."""
    for i, (got, want) in enumerate(zip(fused, ref, strict=True)):
        _close(f"{name} output {i}", got, want)
    g = torch.Generator().manual_seed(7)
    weights = [torch.randn(t.shape, generator=g).to(t.device) for t in ref]
    keep = [o.requires_grad for o in fused]
    grads = []
    for outs, ins in ((fused, leaves[0]), (ref, leaves[1])):
        terms = [(o.float() * wt).sum() for o, wt, k in zip(outs, weights, keep, strict=True) if k]
        grads.append(torch.autograd.grad(sum(terms), ins, allow_unused=True))
    for i, (got, want) in enumerate(zip(*grads, strict=True)):
        if want is not None:
            _close(f"{name} gradient {i}", torch.zeros_like(want) if got is None else got, want)


def _close(what: str, got: Tensor, want: Tensor) -> None:
    got, want = got.detach().float(), want.detach().float()
    scale = float(want.abs().max()) if want.numel() else 0.0
    diff = float((got - want).abs().max()) if want.numel() else 0.0
    if not diff <= RTOL * max(scale, 1e-6):  # also catches NaN
        raise ValueError(f"{what} differs by {diff:.3g} (largest value {scale:.3g})")


def self_test(device: torch.device | str) -> str:
    """ "" when every Triton op gives the equations' numbers on ``device``, else why not."""
    with torch.enable_grad(), torch.autocast(torch.device(device).type, enabled=False):
        return _run(device)


def _run(device: torch.device | str) -> str:
    try:
        from capsctl.layers.backend.triton.em_ops import triton_em_moments, triton_em_quad
        from capsctl.layers.backend.triton.ops import triton_routed, triton_weighted

        g = torch.Generator().manual_seed(0)

        def rand(*shape: int, positive: bool = False) -> Tensor:
            t = torch.rand(shape, generator=g) if positive else torch.randn(shape, generator=g)
            return t.to(device)

        def leaves(*ts: Tensor) -> tuple[list[Tensor], list[Tensor]]:
            return [t.clone().requires_grad_() for t in ts], [
                t.clone().requires_grad_() for t in ts
            ]

        for j, bsz, a, xd, m, c in SHAPES:
            x, p = rand(j, bsz, a, xd), rand(bsz, m, a, c)
            w = rand(j, xd, m, c) / xd**0.5
            r = rand(j, bsz, m, positive=True)
            fused, ref = leaves(x, w, p)
            _compare("routed", triton_routed(*fused, 0.5), _routed(*ref, 0.5), [fused, ref])
            fused, ref = leaves(x, w, r)
            _compare("weighted", (triton_weighted(*fused),), _weighted(*ref), [fused, ref])
            act = rand(bsz, j, positive=True)
            shift = rand(bsz, m, a, c)
            rb = torch.softmax(rand(bsz, j, m), -1)
            fused, ref = leaves(rb, act, x, w)
            _compare(
                "EM moments",
                triton_em_moments(*fused, shift),
                _moments(*ref, shift),
                [fused, ref],
            )
            q = rand(bsz, m, a, c)
            fused, ref = leaves(q, p, x, w)
            _compare(
                "EM quadratic form",
                (triton_em_quad(*fused, shift),),
                _quad(*ref, shift),
                [fused, ref],
            )
    except Exception as exc:  # a compile error, a launch failure or wrong numbers
        return (
            f"the Triton kernels failed their self-test on {device} ({type(exc).__name__}: {exc})"
        )
    return ""
