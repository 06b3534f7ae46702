"""Convolutional backbones that feed the primary capsules: the two of the authors' configs for
Tsai et al., "Capsules with Inverted Dot-Product Attention Routing" (ICLR 2020,
arXiv:2002.04764), and ``fast``, a short, wide-late network for time-budgeted training."""

from __future__ import annotations

from torch import nn
from torchvision.models.resnet import BasicBlock

from capsctl.models.spec import WIDTH_BACKBONES


def simple_backbone(in_channels: int, width: int = 128) -> nn.Sequential:
    """Conv(in -> width, k3, s2, p1) + ReLU: halves the grid. The authors' configs use 128
    channels for CIFAR and 1,024 for DiverseMultiMNIST."""
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, stride=2, padding=1), nn.ReLU(inplace=True)
    )


def resnet_backbone(in_channels: int) -> nn.Sequential:
    """Conv(in -> 64, k3, s1, p1, no bias) + BN + ReLU, 3 BasicBlocks of 64, then 4 BasicBlocks
    of 128, the first with stride 2: halves the grid, 128 channels out."""
    layers: list[nn.Module] = [
        nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
    ]
    layers += [BasicBlock(64, 64) for _ in range(3)]
    down = nn.Sequential(nn.Conv2d(64, 128, 1, stride=2, bias=False), nn.BatchNorm2d(128))
    layers.append(BasicBlock(64, 128, stride=2, downsample=down))
    layers += [BasicBlock(128, 128) for _ in range(3)]
    return nn.Sequential(*layers)


#: Channels of the ``fast`` backbone: the stem, then each of its three stages.
FAST_WIDTHS = (24, 48, 96, 192)


def _fast_stage(c_in: int, c_out: int) -> nn.Sequential:
    """Conv(k3, p1) -> MaxPool(2) -> BN -> GELU -> Conv(k3, p1) -> BN -> GELU: halves the grid.
    Pooling right after the first conv runs the second at a quarter of the sites."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
        nn.MaxPool2d(2),
        nn.BatchNorm2d(c_out),
        nn.GELU(),
        nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.GELU(),
    )


def fast_backbone(in_channels: int) -> nn.Sequential:
    """A stem Conv(in -> 24, k2, no padding) + BN + GELU, then three stages
    (:func:`_fast_stage`) of 48, 96 and 192 channels: a 32x32 input leaves a 3x3 grid of 192
    channels. The 2x2 stem sees every pixel of its patch at full resolution for little cost.

    The layout (few layers, channels growing as the grid shrinks, pooling inside each stage,
    GELU) follows the fast CIFAR-10 training literature: Page's "How to train your ResNet"
    (2018) and Jordan's airbench (arXiv:2404.00498, 2024). It costs about 0.08 GFLOP per 32x32
    image forward, a fifteenth of the ``resnet`` backbone.
    """
    stem, *stages = FAST_WIDTHS
    layers: list[nn.Module] = [
        nn.Conv2d(in_channels, stem, 2, bias=False),
        nn.BatchNorm2d(stem),
        nn.GELU(),
    ]
    c_in = stem
    for c_out in stages:
        layers.append(_fast_stage(c_in, c_out))
        c_in = c_out
    return nn.Sequential(*layers)


BACKBONE_CHANNELS = {"simple": 128, "resnet": 128, "fast": FAST_WIDTHS[-1]}


def backbone_channels(kind: str, width: int | None = None) -> int:
    """Channels out of backbone ``kind``: ``width`` where it has one, else its default."""
    return BACKBONE_CHANNELS[kind] if width is None else width


def build_backbone(kind: str, in_channels: int, width: int | None = None) -> nn.Sequential:
    """Backbone ``kind``; ``width`` (channels out) only for :data:`WIDTH_BACKBONES`."""
    if width is not None and kind not in WIDTH_BACKBONES:
        raise ValueError(f"backbone {kind!r} has no width setting")
    if kind == "simple":
        return simple_backbone(in_channels, backbone_channels(kind, width))
    if kind == "resnet":
        return resnet_backbone(in_channels)
    if kind == "fast":
        return fast_backbone(in_channels)
    raise ValueError(f"unknown backbone {kind!r}")


def backbone_grid(kind: str, size: int) -> int:
    """Side of the feature grid for an input of side ``size`` (``simple`` and ``resnet``: one
    k3 s2 p1 conv; ``fast``: a k2 conv, then three 2x2 max-pools)."""
    if kind == "fast":
        return (size - 1) // 2 // 2 // 2
    return (size + 2 - 3) // 2 + 1
