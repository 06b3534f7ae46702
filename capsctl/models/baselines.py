"""Baselines: ResNet-18 with the CIFAR stem, and a plain CNN as wide as a capsule head."""

from __future__ import annotations

from torch import Tensor, nn
from torchvision.models import resnet18

from capsctl.devices import in_float32
from capsctl.models.backbones import backbone_channels, build_backbone
from capsctl.models.capsnet import plan_layers
from capsctl.models.spec import CapsLayerSpec, ModelConfig


def cifar_resnet18(num_classes: int = 10, in_channels: int = 3) -> nn.Module:
    """torchvision's ResNet-18 with a 3x3 stride-1 first conv and no max-pool.

    Parameter names stay torchvision's, so its tools and state dicts line up.
    """
    model = resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()  # type: ignore[assignment]
    return model


class CNNBaseline(nn.Module):
    """The capsule network's layers with convolutions in place of routing.

    Same backbone; a conv as wide as the primary capsules (``types * D`` channels, their kernel
    and stride); one conv (same kernel and stride) per conv capsule layer and one linear layer
    per FC capsule layer, each as wide as the capsule layer it replaces (``types * D`` units per
    position); class layer with ``classes * D`` units and the same shared ``Linear(D, 1)`` head.
    BatchNorm + ReLU between layers. This is the paper's "same number of layers and neurons"
    comparison.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.backbone = build_backbone(cfg.backbone, cfg.in_channels, cfg.backbone_width)
        width = cfg.primary_types * cfg.primary_dim
        channels = backbone_channels(cfg.backbone, cfg.backbone_width)
        k, stride = cfg.primary_kernel, cfg.primary_stride
        self.primary = nn.Sequential(
            nn.Conv2d(channels, width, k, stride=stride, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        )
        convs: list[nn.Module] = []
        fcs: list[nn.Module] = []
        plan = plan_layers(cfg)
        for item in plan:
            spec: CapsLayerSpec = item["spec"]  # type: ignore[assignment]
            out = spec.types * spec.pose_dim
            if spec.kind == "conv":
                convs += [
                    nn.Conv2d(width, out, spec.kernel, stride=spec.stride, bias=False),
                    nn.BatchNorm2d(out),
                    nn.ReLU(inplace=True),
                ]
                width = out
            else:
                grid = item["in_grid"]
                n_in = width * grid * grid if grid is not None and not fcs else width  # type: ignore[operator]
                fcs += [nn.Linear(n_in, out), nn.BatchNorm1d(out), nn.ReLU(inplace=True)]
                width = out
        self.convs = nn.Sequential(*convs)
        # the class layer's ReLU is dropped: the head reads its D features per class directly
        self.fcs = nn.Sequential(*fcs[:-2])
        self.dim = plan[-1]["spec"].pose_dim  # type: ignore[union-attr]
        self.num_classes = cfg.num_classes
        self.head = nn.Linear(self.dim, 1)

    def forward(self, x: Tensor) -> Tensor:
        y = self.convs(self.primary(self.backbone(x)))  # [b, C, h, w]
        y = y.permute(0, 2, 3, 1).flatten(1)  # [b, h*w*C] (channel-last, as capsules flatten)
        y = self.fcs(y).view(-1, self.num_classes, self.dim)  # [b, classes, d]
        return in_float32(self.head, y).squeeze(-1)  # [b, classes, 1] -> [b, classes], float32

    def parameter_counts(self) -> dict[str, int]:
        backbone = sum(p.numel() for p in self.backbone.parameters())
        total = sum(p.numel() for p in self.parameters())
        return {"total": total, "backbone": backbone, "capsules": total - backbone}
