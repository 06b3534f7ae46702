"""Primary capsules: a convolution of the backbone's features read as a grid of poses
``[b, h, w, n, d]`` (capsctl/layers/capsules.py's layouts), with a LayerNorm (inverted
dot-product attention, Tsai et al., ICLR 2020) or with one activation per capsule (EM routing,
self-routing)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from capsctl.layers.passes.layout import to_channels_last
from capsctl.layers.passes.pose_norm import pose_layer_norm
from capsctl.layers.passes.rows_first import layout_layer_norm

__all__ = ["PrimaryCapsules", "PrimaryCapsulesWithActivations"]


class PrimaryCapsules(nn.Module):
    """Convolution (``kernel`` x ``kernel``, ``stride``, no padding; 1x1 by default) to ``types *
    dim`` channels, read channel-last as capsules, LayerNorm."""

    def __init__(
        self,
        in_channels: int,
        types: int,
        dim: int,
        *,
        layer_norm: bool = True,
        kernel: int = 1,
        stride: int = 1,
    ) -> None:
        super().__init__()
        self.types, self.dim = types, dim
        self.conv = nn.Conv2d(in_channels, types * dim, kernel, stride=stride, bias=False)
        self.norm: nn.Module = nn.LayerNorm(dim) if layer_norm else nn.Identity()

    def forward(self, feats: Tensor) -> Tensor:
        """Channels-last convolution: its output ``[b, h, w, n*d]`` in memory already is the
        grid of poses, so reading it as capsules copies nothing (the features are smaller)."""
        return pose_layer_norm(self._poses(feats), self.norm)

    def _poses(self, feats: Tensor) -> Tensor:
        """The convolution's output as poses ``[b, h, w, n, d]`` (before the LayerNorm)."""
        y = self.conv(to_channels_last(feats))  # [b, n*d, h, w]
        b, _, h, w = y.shape
        return y.permute(0, 2, 3, 1).reshape(b, h, w, self.types, self.dim)  # [b, h, w, n, d]

    def rows_first(self, feats: Tensor, rows: int) -> Tensor:
        """The poses of :meth:`forward` rows-first, ``[b, a, h, w, n, x]`` for poses of ``a =
        rows`` rows (the LayerNorm writes them so, capsctl/layers/passes/rows_first.py)."""
        y = self._poses(feats)  # [b, h, w, n, d]
        return layout_layer_norm(y, self.norm, rows_in=False, rows_out=True, rows=rows)


class PrimaryCapsulesWithActivations(PrimaryCapsules):
    """Poses from a convolution (no LayerNorm) and one activation per capsule from a
    convolution of the same kernel and stride, with bias and a sigmoid (EM routing,
    self-routing); ``batch_norm=True`` adds BatchNorm on the pose channels and on the
    activation logits, as SR-CapsNet's published code does (``bn_pose``, ``bn_a``). Returns
    poses ``[b, h, w, n, d]``, activations ``[b, h, w, n]``."""

    def __init__(
        self,
        in_channels: int,
        types: int,
        dim: int,
        *,
        batch_norm: bool = False,
        kernel: int = 1,
        stride: int = 1,
    ) -> None:
        super().__init__(in_channels, types, dim, layer_norm=False, kernel=kernel, stride=stride)
        self.act = nn.Conv2d(in_channels, types, kernel, stride=stride)
        self.pose_bn: nn.Module = nn.BatchNorm2d(types * dim) if batch_norm else nn.Identity()
        self.act_bn: nn.Module = nn.BatchNorm2d(types) if batch_norm else nn.Identity()

    def _poses(self, feats: Tensor) -> Tensor:
        y = self.pose_bn(self.conv(to_channels_last(feats)))  # [b, n*d, h, w]
        b, _, h, w = y.shape
        return y.permute(0, 2, 3, 1).reshape(b, h, w, self.types, self.dim)  # [b, h, w, n, d]

    def forward(self, feats: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        logits = self.act_bn(self.act(feats))  # [b, n, h, w]
        act = torch.sigmoid(logits).permute(0, 2, 3, 1)  # [b, n, h, w] -> [b, h, w, n]
        return super().forward(feats), act
