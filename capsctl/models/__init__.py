"""Models built from :class:`~capsctl.models.spec.ModelConfig` data."""

from __future__ import annotations

from torch import nn

from capsctl.models.spec import CapsLayerSpec, ModelConfig

__all__ = [
    "CapsLayerSpec",
    "ModelConfig",
    "build_model_from_config",
    "parameter_counts",
    "to_channels_last",
]


def build_model_from_config(cfg: ModelConfig) -> nn.Module:
    """Build a fresh (randomly initialized) model from its configuration."""
    if cfg.arch == "capsnet":
        from capsctl.models.capsnet import CapsNet

        return CapsNet(cfg)
    if cfg.arch == "cnn":
        from capsctl.models.baselines import CNNBaseline

        return CNNBaseline(cfg)
    if cfg.arch == "resnet18":
        from capsctl.models.baselines import cifar_resnet18

        model = cifar_resnet18(cfg.num_classes, cfg.in_channels)
        model.config = cfg  # type: ignore[assignment]
        return model
    raise ValueError(f"unknown arch {cfg.arch!r}")


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Total parameters, and the backbone/capsule split where the model has one."""
    fn = getattr(model, "parameter_counts", None)
    if callable(fn):
        return fn()
    total = sum(p.numel() for p in model.parameters())
    return {"total": total, "backbone": total, "capsules": 0}


def to_channels_last(model: nn.Module) -> nn.Module:
    """``model`` with its 4-d parameters and buffers (convolution weights) in channels_last
    memory, in place. ``model.to(memory_format=torch.channels_last)`` refuses a model with a
    5-d parameter (self-routing's capsule weights); those keep their layout here."""
    import torch

    for module in model.modules():
        for tensors in (module._parameters, module._buffers):  # noqa: SLF001
            for t in tensors.values():
                if t is not None and t.dim() == 4:
                    t.data = t.data.to(memory_format=torch.channels_last)
    return model
