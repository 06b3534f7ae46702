"""Model configurations as plain data.

A model is described by a :class:`ModelConfig`; the registry maps names to configs and
:func:`capsctl.models.build_model_from_config` turns a config into a module. Presets embed the
same structure under their ``model:`` key, and checkpoints store it, so every model can be
rebuilt from data alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from capsctl.layers import PoseKind

Arch = Literal["capsnet", "cnn", "resnet18"]
Backbone = Literal["simple", "resnet", "fast"]
RoutingMode = Literal["concurrent", "sequential"]
#: The backbones whose output width is a setting (``model.backbone_width``).
WIDTH_BACKBONES: tuple[str, ...] = ("simple",)

#: The default router: the paper's, inverted dot-product attention, T=2 concurrent.
DEFAULT_ROUTER: dict[str, Any] = {"name": "idpa", "iterations": 2, "schedule": "concurrent"}
# Files written before routers were data: ``arch`` named the algorithm, and its settings were
# top-level fields. :meth:`ModelConfig.upgrade_mapping` turns them into ``router``.
_LEGACY_ARCH = {"capsnet-dynamic": "dynamic", "capsnet-em": "em"}
_LEGACY_EM = {
    "em_lambda": "lambda_inf",
    "em_assignment": "assignment",
    "em_standardize_costs": "standardize_costs",
}


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

    For ``arch: capsnet`` the network is: backbone -> primary capsules -> ``layers`` -> class
    capsules (an FC capsule layer with ``num_classes`` types and pose dim ``class_pose_dim``,
    default: the last layer's) -> the routing algorithm's read-out. ``router`` names the
    routing algorithm and its parameters (``{name: idpa, iterations: 2, schedule:
    concurrent}``, ``{name: dynamic, iterations: 3}``, ``{name: em, iterations: 3,
    lambda_inf: 0.02, assignment: parents}``, ``{name: self}``; see capsctl/layers/routers/).
    ``arch: cnn`` is a plain CNN with the same backbone and the same layer widths.
    ``arch: resnet18`` is torchvision's ResNet-18 with the CIFAR stem.

    ``backbone_width``: channels out of the backbone (``simple`` only; None: its default, 128).
    The primary capsules are a ``primary_kernel`` x ``primary_kernel`` convolution of stride
    ``primary_stride`` without padding (1 and 1: the paper's CIFAR models) to
    ``primary_types * primary_dim`` channels.

    Inverted dot-product attention only: ``dropout``, ``layer_norm``, ``agreement_scale`` and
    ``head`` (``shared``: one ``Linear(D, 1)`` for every class, the paper's; or ``per_class``).
    """

    arch: Arch = "capsnet"
    num_classes: int = 10
    in_channels: int = 3
    input_size: int = 32
    backbone: Backbone = "resnet"
    backbone_width: int | None = None
    primary_types: int = 32
    primary_dim: int = 16
    primary_kernel: int = 1
    primary_stride: int = 1
    layers: list[CapsLayerSpec] = field(default_factory=list)
    class_pose: PoseKind = "matrix"
    class_pose_dim: int | None = None
    router: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_ROUTER))
    dropout: float = 0.0
    layer_norm: bool = True
    agreement_scale: bool = True
    head: Literal["shared", "per_class"] = "shared"

    def __post_init__(self) -> None:
        from capsctl.layers import ROUTERS

        cls = ROUTERS.get(str(self.router.get("name")))
        if cls is not None:  # defaults filled in; unknown names are reported by validation
            self.router = {"name": cls.name, **_param_defaults(cls), **self.router}

    @property
    def iterations(self) -> int:
        """The router's T (1 for an algorithm without iterations)."""
        return int(self.router.get("iterations", 1))

    @property
    def routing(self) -> str:
        """The router's schedule (``sequential`` for algorithms that only have that one)."""
        return str(self.router.get("schedule", "sequential"))

    def algorithm(self) -> Any:
        """The :class:`~capsctl.layers.RoutingAlgorithm` of ``router``."""
        from capsctl.layers import make_router

        return make_router(self.router)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with ``changes``; ``iterations`` and ``routing`` (the schedule) go to the
        router."""
        router = dict(changes.pop("router", self.router))
        if "iterations" in changes:
            router["iterations"] = changes.pop("iterations")
        if "routing" in changes:
            router["schedule"] = changes.pop("routing")
        return dataclasses.replace(self, router=router, **changes)

    @classmethod
    def upgrade_mapping(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        """A mapping written before routers were data, as one of today: ``arch:
        capsnet-dynamic`` / ``capsnet-em`` become ``arch: capsnet`` with router ``dynamic`` /
        ``em``; top-level ``iterations``, ``routing`` and ``em_*`` move into ``router`` (they
        also override a router given as well, as ``--set model.iterations=3`` does). Settings
        the old models ignored (the schedule and EM knobs of other routers, any of them for
        ``cnn`` and ``resnet18``) are dropped."""
        out = dict(data)
        legacy = {k: out.pop(k) for k in ("iterations", "routing", *_LEGACY_EM) if k in out}
        arch = out.get("arch")
        if isinstance(arch, str) and arch in _LEGACY_ARCH:
            out["arch"], out["router"] = "capsnet", {"name": _LEGACY_ARCH[arch]}
        if not legacy or out.get("arch", "capsnet") != "capsnet":
            return out
        router = out.get("router")
        if not isinstance(router, Mapping):
            if router is not None:
                return out  # reported by validation
            router = {"name": "idpa"}
        router = dict(router)
        name = router.get("name")
        if "iterations" in legacy and name != "self":
            router["iterations"] = legacy["iterations"]
        if "routing" in legacy and (name == "idpa" or legacy["routing"] != "sequential"):
            router["schedule"] = legacy["routing"]
        if name == "em":
            router.update({_LEGACY_EM[k]: v for k, v in legacy.items() if k in _LEGACY_EM})
        out["router"] = router
        return out


def _param_defaults(cls: Any) -> dict[str, Any]:
    return dataclasses.asdict(cls.Params())
