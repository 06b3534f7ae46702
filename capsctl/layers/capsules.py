"""Capsule layers of inverted dot-product attention routing (Tsai et al., ICLR 2020,
arXiv:2002.04764): convolutional and fully connected capsule layers (the primary capsules:
capsctl/layers/primary.py).

Pose layouts used throughout capsctl (letters as in capsctl/layers/passes/routed.py):

- grid poses ``[b, h, w, n, d]`` (capsule types last, channel-last like the authors' code),
- flat poses ``[b, n, d]`` (an FC layer flattens a grid as ``(h, w, n)``).

A pose of dim ``d`` is a vector, or for *matrix poses* an ``s x s`` matrix with ``d = s*s``
(capsctl/layers/poses.py). Votes: matrix poses use ``V = P @ W`` (the pose multiplied on the
right by an ``s x s`` weight, as the authors' code does; the paper writes the left product);
vector poses use ``v = W p``. Both are written as one product: a child pose is an ``a x x``
matrix (``a = s`` rows for matrix poses, ``a = 1`` for vectors), a weight is ``x x c``, a vote is
``a x c``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from capsctl.layers.passes.agreement import agreement_pass
from capsctl.layers.passes.layout import permute_rows, window_copy
from capsctl.layers.passes.pose_norm import pose_layer_norm
from capsctl.layers.passes.routed import routed_pass_under_autocast
from capsctl.layers.passes.rows_first import layout_layer_norm, to_rows, to_standard
from capsctl.layers.poses import PoseKind, pose_shape


class CapsuleLayer(nn.Module):
    """Common part of the FC and conv capsule layers: weights, init, dropout, LayerNorm.

    ``in_types`` (n) child types of dim ``in_dim``, ``out_types`` (m) parent types of dim
    ``out_dim``. ``fan`` is the number of child capsule types each parent sees per position
    (``n`` for FC layers over a flat input, ``n*k*k`` for conv layers), used by the init.
    """

    weight: Tensor

    def __init__(
        self,
        in_types: int,
        in_dim: int,
        out_types: int,
        out_dim: int,
        *,
        pose: PoseKind = "matrix",
        dropout: float = 0.0,
        layer_norm: bool = True,
        agreement_scale: bool = True,
        weight_shape: tuple[int, ...],
        fan: int,
    ) -> None:
        super().__init__()
        self.in_types, self.in_dim = in_types, in_dim
        self.out_types, self.out_dim = out_types, out_dim
        self.pose = pose
        self.rows, self.cols_in = pose_shape(in_dim, pose)
        if pose == "matrix":
            if in_dim != out_dim:
                raise ValueError(f"matrix poses keep their dim: got {in_dim} -> {out_dim}")
            self.cols_out = self.cols_in
        else:
            self.cols_out = out_dim
        self.scale = 1.0 / math.sqrt(out_dim) if agreement_scale else 1.0
        self.weight = nn.Parameter(torch.empty(weight_shape))
        # Authors' init: N(0, 1) * sqrt(M / (x * N)); x = s (matrix) or D_in (vector).
        self._init_std = math.sqrt(out_types / (self.cols_in * fan))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.norm: nn.Module = nn.LayerNorm(out_dim) if layer_norm else nn.Identity()
        self._memo: dict[str, Any] | None = None  # see same_children
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.normal_(0.0, self._init_std)
        if isinstance(self.norm, nn.LayerNorm):
            self.norm.reset_parameters()

    @contextlib.contextmanager
    def same_children(self) -> Iterator[None]:
        """Inside the block, routed passes of this layer over one child tensor share the
        layout copy of its children (conv layers: every window's poses, ``J*B*d`` numbers) and,
        in the backward pass, one gradient of it: for schedules that route a layer's children
        several times (sequential T >= 3, dynamic routing)."""
        self._memo = {}
        try:
            yield
        finally:
            self._memo = None

    def finish(self, s: Tensor) -> Tensor:
        """Dropout then LayerNorm over the pose entries (last dim)."""
        return pose_layer_norm(self.dropout(s), self.norm)

    def uniform_sum(self, child: Tensor) -> Tensor:
        raise NotImplementedError

    def routed_sum(self, child: Tensor, query: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def agreement(self, child: Tensor, iterations: int) -> tuple[list[Tensor], list[Tensor]] | None:
        return None

    def uniform(self, child: Tensor, *, rows_in: bool = False, rows_out: bool = False) -> Tensor:
        """First pass, every coefficient ``1/m``, then dropout and LayerNorm: parent poses.
        ``rows_in``/``rows_out``: the children are / the parents come back rows-first (4x4
        poses, capsctl/layers/passes/rows_first.py)."""
        s = self.uniform_sum(to_standard(child) if rows_in else child)
        return self.finish_layout(s, rows_in=False, rows_out=rows_out)

    def route(
        self, child: Tensor, parent: Tensor, *, rows_in: bool = False
    ) -> tuple[Tensor, Tensor]:
        """Routed pass against the parent poses of the previous iteration; returns the new
        parent poses (after dropout and LayerNorm) and the coefficients (``[b, n, m]`` for FC
        layers, ``[b, h, w, k, l, n, m]`` for conv layers). ``rows_in``: the children are
        rows-first."""
        s, r = self.routed_sum(to_standard(child) if rows_in else child, parent, self.scale)
        return self.finish(s), r

    def finish_layout(self, s: Tensor, *, rows_in: bool, rows_out: bool) -> Tensor:
        """:meth:`finish` of sums ``s`` rows-first if ``rows_in``; the poses rows-first if
        ``rows_out``."""
        if not rows_in and not rows_out:
            return self.finish(s)
        s = self.dropout(s)
        return layout_layer_norm(s, self.norm, rows_in=rows_in, rows_out=rows_out, rows=self.rows)


class FCCapsules(CapsuleLayer):
    """Every child capsule votes for every parent. Weights ``W[n, x, m, c]``."""

    kind = "fc"

    def __init__(
        self,
        in_caps: int,
        in_dim: int,
        out_types: int,
        out_dim: int,
        **kw: object,
    ) -> None:
        a, x = pose_shape(in_dim, kw.get("pose", "matrix"))  # type: ignore[arg-type]
        c = x if kw.get("pose", "matrix") == "matrix" else out_dim
        super().__init__(
            in_caps,
            in_dim,
            out_types,
            out_dim,
            weight_shape=(in_caps, x, out_types, c),
            fan=in_caps,
            **kw,  # type: ignore[arg-type]
        )

    def _children(self, child: Tensor) -> Tensor:
        b = child.shape[0]
        flat = child.reshape(b, -1, self.in_dim)  # [b, n, d_in] (a grid flattens as (h, w, n))
        self._check_count(flat.shape[1])
        return flat

    def _check_count(self, got: int) -> None:
        if got != self.in_types:
            raise ValueError(
                f"FC capsule layer expects {self.in_types} child capsules, got {got}"
                " (was the model built for another input size?)"
            )

    def _rows_children(self, child: Tensor) -> Tensor:
        """Rows-first children ``[b, a, *grid, n, x]`` as ``[b, a, n, x]`` (a view)."""
        b = child.shape[0]
        rows = child.reshape(b, self.rows, -1, self.cols_in)  # [b, a, n, x]
        self._check_count(rows.shape[2])
        return rows

    def uniform_sum(self, child: Tensor) -> Tensor:
        """``S = sum_i V_ij / m`` (every coefficient ``1/m``): one matrix product."""
        x = self._children(child)
        b = x.shape[0]
        xm = x.view(b, self.in_types, self.rows, self.cols_in).transpose(1, 2)  # [b, a, n, x]
        return self._uniform_rows(xm)

    def _uniform_rows(self, xm: Tensor) -> Tensor:
        """:meth:`uniform_sum` of the children ``xm[b, a, n, x]`` (any strides)."""
        b = xm.shape[0]
        n, m, a = self.in_types, self.out_types, self.rows
        wm = self.weight.reshape(n * self.cols_in, m * self.cols_out)  # [n*x, m*c]
        s = xm.reshape(b * a, n * self.cols_in) @ wm  # [b*a, n*x] @ [n*x, m*c] -> [b*a, m*c]
        s = s.view(b, a, m, self.cols_out).transpose(1, 2)  # [b, m, a, c]
        return s.reshape(b, m, self.out_dim) * (1.0 / m)  # [b, m, d]

    def uniform(self, child: Tensor, *, rows_in: bool = False, rows_out: bool = False) -> Tensor:
        if not rows_in:
            return super().uniform(child, rows_out=rows_out)
        s = self._uniform_rows(self._rows_children(child))  # [b, m, d]
        return self.finish_layout(s, rows_in=False, rows_out=rows_out)

    def route(
        self, child: Tensor, parent: Tensor, *, rows_in: bool = False
    ) -> tuple[Tensor, Tensor]:
        if not rows_in:
            return super().route(child, parent)
        xj = permute_rows(self._rows_children(child), (2, 0, 1, 3))  # [J=n, B=b, a, x]
        s, r = self._routed_children(xj, parent, self.scale)
        return self.finish(s), r

    def routed_sum(self, child: Tensor, query: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        """``S_j = sum_i R_ij V_ij`` with ``R_ij = softmax_j(scale * <V_ij, Q_j>)`` for queries
        ``Q[b, m, d]``: ``S[b, m, d]`` (no dropout, no LayerNorm) and ``R[b, n, m]``."""
        x = self._children(child)
        b = x.shape[0]
        xj = x.view(b, self.in_types, self.rows, self.cols_in)  # [b, n, a, x]
        xj = permute_rows(xj, (1, 0, 2, 3))  # [J=n, B=b, a, x]
        return self._routed_children(xj, query, scale)

    def _routed_children(self, xj: Tensor, query: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        """:meth:`routed_sum` of the children ``xj[J=n, B=b, a, x]`` (any strides)."""
        b, m, a = xj.shape[1], self.out_types, self.rows
        p = query.reshape(b, m, a, self.cols_out)  # [B=b, m, a, c]
        s, r = routed_pass_under_autocast(xj, self.weight, p, scale)  # [b, m, a, c], [n, b, m]
        return s.reshape(b, m, self.out_dim), r.permute(1, 0, 2)  # [b, m, d], [b, n, m]

    def agreement(self, child: Tensor, iterations: int) -> tuple[list[Tensor], list[Tensor]] | None:
        """Every iteration of routing by agreement in one pass (passes/agreement.py): the
        squashed poses ``[b, m, d]`` of each iteration and the coefficients ``[b, n, m]`` of
        iterations 2..T; None where the compiled loops do not run."""
        x = self._children(child)
        b, m = x.shape[0], self.out_types
        xj = x.view(b, self.in_types, self.rows, self.cols_in)  # [b, n, a, x]
        out = agreement_pass(permute_rows(xj, (1, 0, 2, 3)), self.weight, iterations)
        if out is None:
            return None
        v, r = out  # [T, B=b, m, a, c], [T-1, J=n, B=b, m]
        poses = [p.reshape(b, m, self.out_dim) for p in v.unbind(0)]  # [b, m, d] each
        return poses, [c.permute(1, 0, 2) for c in r.unbind(0)]  # [b, n, m] each

    def uniform_coefficients(self, child: Tensor) -> Tensor:
        """The first pass's coefficients ``1/m``, ``[b, n, m]`` (a broadcast view)."""
        b = child.shape[0]
        one = child.new_full((1, 1, 1), 1.0 / self.out_types)  # [1, 1, 1]
        return one.expand(b, self.in_types, self.out_types)  # [b, n, m]


class ConvCapsules(CapsuleLayer):
    """Parents on a grid; each sees the ``k x k`` window of all child types. No padding.

    Weights ``W[k, l, n, x, m, c]``, shared over positions. Coefficients are normalized over
    the parent types at each output position, separately for each window a child falls in
    (the authors' behaviour).
    """

    kind = "conv"

    def __init__(
        self,
        in_types: int,
        in_dim: int,
        out_types: int,
        out_dim: int,
        *,
        kernel: int = 3,
        stride: int = 1,
        **kw: object,
    ) -> None:
        pose = kw.get("pose", "matrix")
        a, x = pose_shape(in_dim, pose)  # type: ignore[arg-type]
        c = x if pose == "matrix" else out_dim
        self.kernel, self.stride = kernel, stride
        super().__init__(
            in_types,
            in_dim,
            out_types,
            out_dim,
            weight_shape=(kernel, kernel, in_types, x, out_types, c),
            fan=in_types * kernel * kernel,
            **kw,  # type: ignore[arg-type]
        )

    def out_size(self, size: int) -> int:
        return (size - self.kernel) // self.stride + 1

    def uniform_sum(self, child: Tensor) -> Tensor:
        """With every coefficient ``1/m`` the sum of votes is a convolution per pose row.

        Run channels-last: the input is one copy of the grid with the pose row moved next to
        the batch (``[b, a, H, W, n, x]``), the output in memory is ``[b, a, h, w, m, c]``, and
        the factor ``1/m`` is folded into the (small) weight. About a quarter faster on a CPU
        than the same convolution channels-first, which needs a larger copy on each side. Both
        copies move whole pose rows (passes/layout.py). The weight ``[k, l, n, x, m, c]`` is
        transposed once into the convolution's layout.
        """
        y = self._uniform_rows(to_rows(child, self.rows))  # [b, a, h, w, m, c]
        return to_standard(y)  # [b, h, w, m, d]

    def _uniform_rows(self, child: Tensor) -> Tensor:
        """:meth:`uniform_sum` rows-first: children ``[b, a, H, W, n, x]`` (contiguous) ->
        sums ``[b, a, h, w, m, c]``."""
        b, a, hh, ww, n, xd = child.shape
        m, c, k = self.out_types, self.cols_out, self.kernel
        inp = child.view(b * a, hh, ww, n * xd).permute(0, 3, 1, 2)  # [b*a, n*x, H, W] (NHWC)
        # the weight in the convolution's channels-last layout, [m*c, (k, l, n, x)] in memory: a
        # transposed copy, made once here (else the convolution copies it in the forward and
        # again in the backward pass, element by element: 12 ms each for a 3x3 layer of 512)
        wt = (self.weight.view(k * k * n * xd, m * c) * (1.0 / m)).t().contiguous()  # [m*c, K]
        wconv = wt.view(m * c, k, k, n * xd).permute(0, 3, 1, 2)  # [m*c, n*x, k, l] (NHWC)
        y = F.conv2d(inp, wconv, stride=self.stride)  # [b*a, m*c, h, w]
        h, w = y.shape[-2:]
        return y.permute(0, 2, 3, 1).reshape(b, a, h, w, m, c)  # [b, a, h, w, m, c]

    def uniform(self, child: Tensor, *, rows_in: bool = False, rows_out: bool = False) -> Tensor:
        """The uniform pass rows-first (:meth:`_uniform_rows`), its LayerNorm writing the
        parents in the layout asked for: no copy of the sums (passes/rows_first.py)."""
        rows = child if rows_in else to_rows(child, self.rows)  # [b, a, H, W, n, x]
        s = self._uniform_rows(rows.contiguous())  # [b, a, h, w, m, c]
        return self.finish_layout(s, rows_in=True, rows_out=rows_out)

    def _windows(self, child: Tensor) -> tuple[Tensor, int, int]:
        """Child poses of every window as ``X[J=(k,l,n), B=(b,h,w), a, x]`` (inside
        :meth:`same_children`, copied once per child tensor)."""
        memo = self._memo
        if memo is not None and memo.get("child") is child:
            return memo["windows"]
        windows = self._window_copy(child)
        if memo is not None:
            memo.update(child=child, windows=windows)
        return windows

    def _window_copy(self, child: Tensor) -> tuple[Tensor, int, int]:
        k, st = self.kernel, self.stride
        xj = window_copy(child, k, st, child_major=True)  # [J=(k,l,n), B=(b,h,w), d]
        h, w = self.out_size(child.shape[1]), self.out_size(child.shape[2])
        return xj.view(xj.shape[0], xj.shape[1], self.rows, self.cols_in), h, w  # [J, B, a, x]

    def routed_sum(self, child: Tensor, query: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        """``S_j = sum_i R_ij V_ij``, ``R_ij = softmax_j(scale * <V_ij, Q_j>)`` over the parent
        types of each window, for queries ``Q[b, h, w, m, d]``: ``S[b, h, w, m, d]`` (no dropout,
        no LayerNorm) and ``R[b, h, w, k, l, n, m]``."""
        b, n = child.shape[0], self.in_types
        k, m = self.kernel, self.out_types
        xj, h, w = self._windows(child)
        wj = self.weight.reshape(k * k * n, self.cols_in, m, self.cols_out)  # [J, x, m, c]
        p = query.reshape(b * h * w, m, self.rows, self.cols_out)  # [B, m, a, c]
        s, r = routed_pass_under_autocast(xj, wj, p, scale)  # [B, m, a, c], [J, B, m]
        coeffs = r.view(k, k, n, b, h, w, m).permute(3, 4, 5, 0, 1, 2, 6)  # [b, h, w, k, l, n, m]
        return s.reshape(b, h, w, m, self.out_dim), coeffs  # [b, h, w, m, d]

    def agreement(self, child: Tensor, iterations: int) -> tuple[list[Tensor], list[Tensor]] | None:
        """:meth:`FCCapsules.agreement` over every window: poses ``[b, h, w, m, d]``,
        coefficients ``[b, h, w, k, l, n, m]``."""
        b, n = child.shape[0], self.in_types
        k, m = self.kernel, self.out_types
        xj, h, w = self._windows(child)  # [J, B, a, x]
        wj = self.weight.reshape(k * k * n, self.cols_in, m, self.cols_out)  # [J, x, m, c]
        out = agreement_pass(xj, wj, iterations)
        if out is None:
            return None
        v, r = out  # [T, B, m, a, c], [T-1, J, B, m]
        poses = [p.reshape(b, h, w, m, self.out_dim) for p in v.unbind(0)]  # [b, h, w, m, d]
        coeffs = [
            c.view(k, k, n, b, h, w, m).permute(3, 4, 5, 0, 1, 2, 6)  # [b, h, w, k, l, n, m]
            for c in r.unbind(0)
        ]
        return poses, coeffs

    def uniform_coefficients(self, child: Tensor) -> Tensor:
        b, hh, ww = child.shape[:3]
        h, w = self.out_size(hh), self.out_size(ww)
        k, n, m = self.kernel, self.in_types, self.out_types
        one = child.new_full((1,) * 7, 1.0 / m)  # [1, 1, 1, 1, 1, 1, 1]
        return one.expand(b, h, w, k, k, n, m)  # [b, h, w, k, l, n, m] (a broadcast view)
