"""Convolutional backbones that feed the primary capsules: the two of the authors' configs for
Tsai et al., "Capsules with Inverted Dot-Product Attention Routing" (ICLR 2020,
arXiv:2002.04764)."""

from __future__ import annotations

from torch import nn
from torchvision.models.resnet import BasicBlock


def simple_backbone(in_channels: int, width: int = 128) -> nn.Sequential:
    """Conv(in -> 128, k3, s2, p1) + ReLU: halves the grid."""
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


BACKBONE_CHANNELS = {"simple": 128, "resnet": 128}


def build_backbone(kind: str, in_channels: int) -> nn.Sequential:
    if kind == "simple":
        return simple_backbone(in_channels)
    if kind == "resnet":
        return resnet_backbone(in_channels)
    raise ValueError(f"unknown backbone {kind!r}")


def backbone_grid(kind: str, size: int) -> int:
    """Side of the feature grid for an input of side ``size`` (both backbones: stride 2, pad 1)."""
    return (size + 2 - 3) // 2 + 1
