"""Model configurations as plain data.

A model is described by a :class:`ModelConfig`; the registry maps names to configs and
:func:`capsctl.models.build_model_from_config` turns a config into a module. Presets embed the
same structure under their ``model:`` key, and checkpoints store it, so every model can be
rebuilt from data alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from capsctl.layers.poses import PoseKind

Arch = Literal["capsnet", "capsnet-dynamic", "capsnet-em", "cnn", "resnet18"]
Backbone = Literal["simple", "resnet"]
RoutingMode = Literal["concurrent", "sequential"]


@dataclass
class CapsLayerSpec:
    """One capsule layer between the primary capsules and the class capsules.

    ``kind``: ``conv`` (parents on a grid, k x k windows, no padding) or ``fc`` (every child
    votes for every parent). ``types``: number of parent capsule types. ``pose_dim``: D of the
    parent poses (a perfect square for matrix poses).
    """

    kind: Literal["conv", "fc"] = "conv"
    types: int = 32
    pose_dim: int = 16
    kernel: int = 3
    stride: int = 1
    pose: PoseKind = "matrix"


@dataclass
class ModelConfig:
    """Everything needed to build a model.

    For ``arch: capsnet`` the network is: backbone -> primary capsules (1x1 conv, LayerNorm)
    -> ``layers`` -> class capsules (an FC capsule layer with ``num_classes`` types and pose
    dim ``class_pose_dim``, default: the last layer's) -> one shared ``Linear(D, 1)`` per class.
    ``arch: cnn`` is a plain CNN with the same backbone and the same layer widths.
    ``arch: resnet18`` is torchvision's ResNet-18 with the CIFAR stem.
    ``arch: capsnet-dynamic`` / ``capsnet-em`` use the same layer list with dynamic routing
    (Sabour et al. 2017) or EM routing (Hinton et al. 2018) instead.
    ``head``: ``shared`` (one ``Linear(D, 1)`` for every class, the paper's) or ``per_class``.

    EM routing only (``arch: capsnet-em``; see capsctl/layers/em_routing.py):
    ``em_lambda``: ``lambda_inf`` of the inverse-temperature schedule
    ``lambda_t = lambda_inf * (1 - 0.95^(t+1))`` of conv capsule layers (FC layers use a quarter
    of it); the default 0.02 is the authors' implementation's. ``em_assignment``: ``parents``
    (the paper's: a conv child's assignments are normalized over every parent it votes for) or
    ``window`` (each window routed on its own). ``em_standardize_costs``: standardize the costs
    over the parent types of each site (a stabilizer not in the paper; off by default).
    """

    arch: Arch = "capsnet"
    num_classes: int = 10
    in_channels: int = 3
    input_size: int = 32
    backbone: Backbone = "resnet"
    primary_types: int = 32
    primary_dim: int = 16
    layers: list[CapsLayerSpec] = field(default_factory=list)
    class_pose: PoseKind = "matrix"
    class_pose_dim: int | None = None
    iterations: int = 2
    routing: RoutingMode = "concurrent"
    dropout: float = 0.0
    layer_norm: bool = True
    agreement_scale: bool = True
    head: Literal["shared", "per_class"] = "shared"
    em_lambda: float = 0.02
    em_assignment: Literal["parents", "window"] = "parents"
    em_standardize_costs: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)
