"""The training recipe: optimizer, learning-rate schedule, EMA of the weights, seeding.

Everything here is a pure function of the preset's ``train`` section, so a resumed run rebuilds
exactly the same recipe and then loads its state.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch
from torch import Tensor, nn

from capsctl.config import Preset

__all__ = ["EMA", "lr_factor", "make_optimizer", "make_scheduler", "seed_everything"]


def make_optimizer(model: nn.Module, preset: Preset) -> torch.optim.Optimizer:
    t = preset.train
    params = [p for p in model.parameters() if p.requires_grad]
    if t.optimizer == "sgd":
        return torch.optim.SGD(
            params,
            lr=t.lr,
            momentum=t.momentum,
            nesterov=t.nesterov and t.momentum > 0,
            weight_decay=t.weight_decay,
        )
    return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)


def lr_factor(preset: Preset, step: float, steps_per_epoch: int) -> float:
    """Multiplier of the base LR at global optimizer step ``step`` (0-based; fractional when a
    time budget moves the schedule ahead of the steps).

    Linear warmup over ``warmup_epochs``, then: ``multistep`` (x gamma at each milestone epoch),
    ``cosine`` (to 0 at the end), ``onecycle`` (warmup from lr/25 over 30% of training unless
    ``warmup_epochs`` is set, then cosine down to lr/1e4), ``constant``.
    """
    t = preset.train
    total = max(1, t.epochs * steps_per_epoch)
    epoch = step / steps_per_epoch
    if t.schedule == "onecycle":
        warm = t.warmup_epochs * steps_per_epoch if t.warmup_epochs > 0 else 0.3 * total
        if step < warm:
            return 1 / 25 + (1 - 1 / 25) * step / warm
        frac = (step - warm) / max(1.0, total - warm)
        return 1e-4 + (1 - 1e-4) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    warm = t.warmup_epochs * steps_per_epoch
    if step < warm:
        return (step + 1) / warm
    if t.schedule == "multistep":
        return t.gamma ** sum(1 for m in t.milestones if epoch >= m)
    if t.schedule == "cosine":
        frac = (step - warm) / max(1.0, total - warm)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return 1.0


class EMA:
    """Exponential moving average of the parameters and buffers (used for evaluation)."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for k, v in model.state_dict().items():
            s = self.shadow[k]
            if v.dtype.is_floating_point:
                s.lerp_(v, 1 - self.decay)
            else:
                s.copy_(v)

    def state_dict(self) -> dict[str, Tensor]:
        return self.shadow

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        for k, v in state.items():
            self.shadow[k].copy_(v)


def seed_everything(seed: int, deterministic: bool) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    # fixed shapes: cuDNN picks its fastest convolution once per shape (not reproducibly)
    torch.backends.cudnn.benchmark = not deterministic
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def make_scheduler(
    optimizer: torch.optim.Optimizer,
    preset: Preset,
    steps_per_epoch: int,
    position: Callable[[int], float] | None = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A per-step scheduler following :func:`lr_factor` (its state is JSON-able: LambdaLR stores
    plain functions as None). ``position`` maps the optimizer step to the schedule's position
    in steps (a time budget moves it ahead; :mod:`capsctl.training.budget`)."""
    where = position if position is not None else float
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(preset, where(step), steps_per_epoch)
    )
