"""Registered models: a name maps to a function that makes its :class:`ModelConfig`.

This module imports only :mod:`capsctl.models.spec` (never :mod:`capsctl.config`). Models given
as mappings (``base: <name>`` plus fields) and building networks from names, configs or
mappings are :func:`capsctl.config.resolve_config` and :func:`capsctl.config.build_model`.
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from capsctl.errors import ConfigError, did_you_mean, some_names
from capsctl.models.spec import CapsLayerSpec, ModelConfig


@dataclass(frozen=True)
class Entry:
    name: str
    description: str
    make: Callable[[], ModelConfig]


_REGISTRY: dict[str, Entry] = {}


def register(
    name: str, description: str
) -> Callable[[Callable[[], ModelConfig]], Callable[[], ModelConfig]]:
    def deco(fn: Callable[[], ModelConfig]) -> Callable[[], ModelConfig]:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} registered twice")
        _REGISTRY[name] = Entry(name, description, fn)
        return fn

    return deco


def _cifar_layers(dim: int) -> list[CapsLayerSpec]:
    return [
        CapsLayerSpec(kind="conv", types=32, pose_dim=dim, kernel=3, stride=2),
        CapsLayerSpec(kind="conv", types=32, pose_dim=dim, kernel=3, stride=1),
    ]


def _caps10(backbone: str, arch: str = "capsnet", router: str = "idpa") -> ModelConfig:
    return ModelConfig(
        arch=arch,  # type: ignore[arg-type]
        num_classes=10,
        backbone=backbone,  # type: ignore[arg-type]
        primary_dim=16,
        layers=_cifar_layers(16),
        router=_ROUTERS[router],
    )


def _caps100(backbone: str, arch: str = "capsnet", router: str = "idpa") -> ModelConfig:
    layers = _cifar_layers(36) + [CapsLayerSpec(kind="fc", types=20, pose_dim=36)]
    return ModelConfig(
        arch=arch,  # type: ignore[arg-type]
        num_classes=100,
        backbone=backbone,  # type: ignore[arg-type]
        primary_dim=36,
        layers=layers,
        router=_ROUTERS[router],
    )


# Each algorithm as its paper runs it: dynamic and EM routing 3 iterations, layer by layer
# (Sabour et al., NeurIPS 2017, arXiv:1710.09829; Hinton et al., ICLR 2018); self-routing in
# one pass (Hahn et al., NeurIPS 2019); inverted dot-product attention T=2 concurrent (Tsai
# et al., ICLR 2020).
_ROUTERS: dict[str, dict[str, Any]] = {
    "idpa": {"name": "idpa", "iterations": 2, "schedule": "concurrent"},
    "dynamic": {"name": "dynamic", "iterations": 3},
    "em": {"name": "em", "iterations": 3},
    "self": {"name": "self"},
}
_ROUTER_TEXT = {
    "dynamic": "dynamic routing (Sabour et al. 2017), T=3 sequential",
    "em": "EM routing (Hinton et al. 2018), T=3 sequential",
    "self": "self-routing (Hahn et al. 2019), one pass",
}

for _bb, _suffix in (("resnet", ""), ("simple", "-simple")):
    register(
        f"cifar10-caps{_suffix}", f"CIFAR-10 capsule net, {_bb} backbone, 4x4 poses, T=2 concurrent"
    )(lambda _bb=_bb: _caps10(_bb))
    register(
        f"cifar100-caps{_suffix}",
        f"CIFAR-100 capsule net, {_bb} backbone, 6x6 poses, T=2 concurrent",
    )(lambda _bb=_bb: _caps100(_bb))
    for _router, _text in _ROUTER_TEXT.items():
        register(f"cifar10-{_router}{_suffix}", f"cifar10-caps{_suffix} with {_text}")(
            lambda _bb=_bb, _router=_router: _caps10(_bb, router=_router)
        )
        register(f"cifar100-{_router}{_suffix}", f"cifar100-caps{_suffix} with {_text}")(
            lambda _bb=_bb, _router=_router: _caps100(_bb, router=_router)
        )
    register(f"cifar10-cnn{_suffix}", f"CNN as wide as cifar10-caps{_suffix} ({_bb} backbone)")(
        lambda _bb=_bb: _caps10(_bb, "cnn")
    )
    register(f"cifar100-cnn{_suffix}", f"CNN as wide as cifar100-caps{_suffix} ({_bb} backbone)")(
        lambda _bb=_bb: _caps100(_bb, "cnn")
    )


def _caps10_fast(arch: str = "capsnet") -> ModelConfig:
    """Primary capsules (32 types, 4x4 poses) on the fast backbone's 4x4 grid route straight
    to the class capsules: 512 children, 10 parents."""
    return ModelConfig(
        arch=arch,  # type: ignore[arg-type]
        num_classes=10,
        backbone="fast",
        primary_dim=16,
        router=_ROUTERS["idpa"],
    )


register(
    "cifar10-caps-fast",
    "CIFAR-10 capsule net for time-budgeted training: fast backbone, primary 32x16 on 4x4, "
    "class capsules, T=2 concurrent",
)(_caps10_fast)
register("cifar10-cnn-fast", "CNN as wide as cifar10-caps-fast (fast backbone)")(
    lambda: _caps10_fast("cnn")
)


@register("resnet18", "ResNet-18 with the CIFAR stem (3x3 stride-1 conv, no max-pool)")
def _resnet18() -> ModelConfig:
    return ModelConfig(arch="resnet18", num_classes=10)


@register("mnist-caps", "small capsule net for 28x28 grayscale digits (simple backbone)")
def _mnist_caps() -> ModelConfig:
    return ModelConfig(
        arch="capsnet",
        num_classes=10,
        in_channels=1,
        input_size=28,
        backbone="simple",
        primary_types=16,
        primary_dim=16,
        layers=[CapsLayerSpec(kind="conv", types=16, pose_dim=16, kernel=3, stride=2)],
    )


@register("mnist-cnn", "CNN as wide as mnist-caps")
def _mnist_cnn() -> ModelConfig:
    return _mnist_caps().replace(arch="cnn")


@register(
    "multimnist-caps",
    "capsule net for 36x36 DiverseMultiMNIST (simple backbone, two conv capsule layers)",
)
def _multimnist_caps() -> ModelConfig:
    return ModelConfig(
        arch="capsnet",
        num_classes=10,
        in_channels=1,
        input_size=36,
        backbone="simple",
        primary_types=16,
        primary_dim=16,
        layers=[
            CapsLayerSpec(kind="conv", types=16, pose_dim=16, kernel=3, stride=2),
            CapsLayerSpec(kind="conv", types=16, pose_dim=16, kernel=3, stride=1),
        ],
    )


@register(
    "multimnist-caps-full",
    "DiverseMultiMNIST capsule net at the authors' full width: simple backbone of 1,024 "
    "channels, primary 16x64 k3s2, conv 16x64 k3s1, fc 10x64, class capsules",
)
def _multimnist_caps_full() -> ModelConfig:
    """The authors' DiverseMultiMNIST configuration (``resnet_backbone_diversemultimnist.py`` of
    the code published with Tsai et al., ICLR 2020): a k3 s2 convolution to 1,024 channels
    (18x18), primary capsules from a k3 s2 convolution (8x8 grid, 16 types of 8x8 poses), a conv
    capsule layer (k3 s1, 6x6) and an FC capsule layer of 10 types before the 10 class
    capsules, every pose 8x8."""
    return ModelConfig(
        arch="capsnet",
        num_classes=10,
        in_channels=1,
        input_size=36,
        backbone="simple",
        backbone_width=1024,
        primary_types=16,
        primary_dim=64,
        primary_kernel=3,
        primary_stride=2,
        layers=[
            CapsLayerSpec(kind="conv", types=16, pose_dim=64, kernel=3, stride=1),
            CapsLayerSpec(kind="fc", types=10, pose_dim=64),
        ],
    )


@register("multimnist-cnn", "CNN with the layers and widths of multimnist-caps")
def _multimnist_cnn() -> ModelConfig:
    return _multimnist_caps().replace(arch="cnn")


def list_models(pattern: str = "*") -> list[str]:
    """Registered model names matching a shell-style pattern, sorted."""
    return sorted(n for n in _REGISTRY if fnmatch.fnmatch(n, pattern))


def describe_model(name: str) -> str:
    return _entry(name).description


def _entry(name: str) -> Entry:
    try:
        return _REGISTRY[name]
    except KeyError:
        names = list_models()
        hint, known = did_you_mean(names, name), some_names(names, name, "capsctl models")
        raise ConfigError(f"unknown model {name!r}{hint}; registered models: {known}") from None


def get_config(name: str, num_classes: int | None = None) -> ModelConfig:
    """A fresh copy of a registered model's configuration."""
    cfg = copy.deepcopy(_entry(name).make())
    if num_classes is not None:
        cfg = cfg.replace(num_classes=num_classes)
    return cfg


def model_summaries(pattern: str = "*") -> list[dict[str, Any]]:
    """What ``capsctl models`` lists: name, description, structure and parameter counts of each
    registered model matching the shell-style ``pattern`` (each model is built once)."""
    from capsctl.models import build_model_from_config, parameter_counts
    from capsctl.models.capsnet import architecture_summary

    rows = []
    for name in list_models(pattern):
        cfg = get_config(name)
        rows.append(
            {
                "name": name,
                "description": describe_model(name),
                "arch": cfg.arch,
                "structure": architecture_summary(cfg) if cfg.arch == "capsnet" else cfg.arch,
                "params": parameter_counts(build_model_from_config(cfg)),
                "num_classes": cfg.num_classes,
                "input": [cfg.in_channels, cfg.input_size, cfg.input_size],
            }
        )
    return rows
