"""The common part of the capsule layers of the baseline routings with activations (EM routing,
self-routing).

Letters as in capsctl/layers/passes/routed.py. As there, every *parent site* (a batch item for an FC
layer, a batch item at one output position for a conv layer) is flattened into ``B``, and every
child that votes at that site (all child types, and for a conv layer all ``k x k`` window
offsets) into ``J``. Votes are laid out ``[B, m, J, d]`` so that every sum over children is one
batched matrix product without copies. The routing procedures themselves live in
capsctl/layers/routers/em/ and capsctl/layers/routers/selfrouting.py.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from capsctl.layers.passes.layout import window_copy


def window_sites(
    t: Tensor, kernel: int, stride: int, *, child_major: bool = False
) -> tuple[Tensor, int, int]:
    """Grid tensor ``[b, H, W, n, *e]`` -> windows ``[B=(b,h,w), J=(k,l,n), *e]`` (``[J, B, *e]``
    with ``child_major``) and the output grid ``h, w`` (``e`` is ``(d,)`` for poses and ``()``
    for activations)."""
    h, w = (t.shape[1] - kernel) // stride + 1, (t.shape[2] - kernel) // stride + 1
    return window_copy(t, kernel, stride, child_major=child_major), h, w


class BaselineCapsules(nn.Module):
    """Weights, child sites and votes shared by the EM and self-routing capsule layers.

    A child pose is an ``a x x`` matrix (``a = 1`` for a vector), a weight ``x x c``, a vote
    ``a x c`` (``d = a*c``): ``V_ij = P_i W_ij``, as in ``capsctl.layers.capsules``. Weights
    ``W[n, x, m, c]`` (FC) or ``W[k, l, n, x, m, c]`` (conv, shared over positions).
    """

    def __init__(
        self,
        kind: str,
        in_types: int,
        in_dim: int,
        out_types: int,
        out_dim: int,
        *,
        rows: int,
        kernel: int = 1,
        stride: int = 1,
    ) -> None:
        super().__init__()
        if kind not in ("conv", "fc"):
            raise ValueError(f"unknown capsule layer kind {kind!r}")
        if in_dim % rows or out_dim % rows:
            raise ValueError(f"pose dims {in_dim} -> {out_dim} do not have {rows} rows")
        self.kind = kind
        self.in_types, self.in_dim = in_types, in_dim
        self.out_types, self.out_dim = out_types, out_dim
        self.rows, self.cols_in, self.cols_out = rows, in_dim // rows, out_dim // rows
        self.kernel, self.stride = kernel, stride
        self.fan = in_types * kernel * kernel if kind == "conv" else in_types  # J
        lead = (kernel, kernel, in_types) if kind == "conv" else (in_types,)
        self.weight = nn.Parameter(torch.empty(*lead, self.cols_in, out_types, self.cols_out))

    def out_size(self, size: int) -> int:
        return (size - self.kernel) // self.stride + 1

    def sites(self, child: Tensor) -> tuple[Tensor, tuple[int, ...]]:
        """Child poses ``[b, H, W, n, d_in]`` (conv) or ``[b, ..., d_in]`` (FC) ->
        ``X[B, J, d_in]`` and the site shape ``(b, h, w)`` or ``(b,)``."""
        b = child.shape[0]
        if self.kind == "conv":
            xs, h, w = window_sites(child, self.kernel, self.stride)  # [B, J, d_in]
            return xs, (b, h, w)
        xs = child.reshape(b, -1, self.in_dim)  # [b, n, d_in]; a grid flattens as (h, w, n)
        if xs.shape[1] != self.in_types:
            raise ValueError(
                f"FC capsule layer expects {self.in_types} child capsules, got {xs.shape[1]}"
                " (was the model built for another input size?)"
            )
        return xs, (b,)

    def child_sites(self, child: Tensor) -> tuple[Tensor, tuple[int, ...]]:
        """:meth:`sites` child-major: contiguous ``X[J, B, d_in]`` (one copy) and the site
        shape, the layout of a product per child over all sites."""
        if self.kind == "conv":
            xj, h, w = window_sites(
                child, self.kernel, self.stride, child_major=True
            )  # [J, B, d_in]
            return xj, (child.shape[0], h, w)
        xs, site = self.sites(child)  # [b, n, d_in]
        return xs.transpose(0, 1).contiguous(), site  # [n, b, d_in]

    def child_activations(self, act: Tensor) -> Tensor:
        """Child activations ``[b, H, W, n]`` (conv) or ``[b, ...]`` (FC) -> ``[B, J]``."""
        if self.kind == "conv":
            return window_sites(act, self.kernel, self.stride)[0]  # [B, J]
        return act.reshape(act.shape[0], -1)  # [b, n]

    def votes(self, xs: Tensor) -> Tensor:
        """``X[B, J, d_in]`` -> votes ``[B, m, J, d]`` with ``V = X W`` per pose row."""
        bsz, j = xs.shape[0], self.fan
        a, xd, m, c = self.rows, self.cols_in, self.out_types, self.cols_out
        xj = xs.view(bsz, j, a, xd).permute(1, 0, 2, 3).reshape(j, bsz * a, xd)  # [J, B*a, x]
        wj = self.weight.reshape(j, xd, m * c)  # [J, x, m*c]
        v = torch.bmm(xj, wj)  # [J, B*a, m*c]
        v = v.view(j, bsz, a, m, c).permute(1, 3, 0, 2, 4)  # [B, m, J, a, c]
        return v.reshape(bsz, m, j, a * c)  # [B, m, J, d]

    def unsite_coefficients(self, r: Tensor, site: tuple[int, ...]) -> Tensor:
        """``[B, m, J]`` -> ``[b, h, w, k, l, n, m]`` (conv) or ``[b, n, m]`` (FC)."""
        if self.kind == "conv":
            b, h, w = site
            k, n, m = self.kernel, self.in_types, self.out_types
            return r.view(b, h, w, m, k, k, n).permute(0, 1, 2, 4, 5, 6, 3)  # [b,h,w,k,l,n,m]
        return r.transpose(1, 2)  # [b, n, m]

    def unsite(self, t: Tensor, site: tuple[int, ...]) -> Tensor:
        """``[B, m, *e]`` -> ``[b, h, w, m, *e]`` (conv) or ``[b, m, *e]`` (FC)."""
        return t.reshape(*site, *t.shape[1:])  # [b, h, w, m, *e] or [b, m, *e]
