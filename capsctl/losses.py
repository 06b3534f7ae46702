"""Losses and metrics: each model's own training loss, and how predictions are counted.

- cross-entropy (optionally label-smoothed) for one label per image; binary cross-entropy per
  class for multi-label data (DiverseMultiMNIST, Tsai et al. 2020, §5);
- the margin loss of dynamic routing (Sabour, Frosst, Hinton, NeurIPS 2017, eq. 4) on capsule
  lengths;
- the spread loss of EM routing (Hinton, Sabour, Frosst, ICLR 2018, §3.1) on class
  activations, its margin rising from 0.2 to 0.9;
- top-1 hits, and the paper's top-2 metric for multi-label data.

:func:`make_loss` is what training minimizes; :func:`eval_loss` is what evaluation reports
under the loss's name (never a cross-entropy of capsule lengths or activations).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from capsctl.config import Preset
from capsctl.errors import ConfigError

__all__ = [
    "EvalLoss",
    "count_correct",
    "default_eval_loss",
    "eval_loss",
    "loss_name",
    "make_loss",
    "margin_loss",
    "multi_hot",
    "spread_loss",
    "top2_correct",
]


EvalLoss = tuple[str, Callable[[Tensor, Tensor], Tensor]]


def loss_name(preset: Preset, multi_label: bool) -> str:
    """The loss a preset trains with: ``train.loss``, where ``auto`` means the model's own loss
    (the routing algorithm's: margin for dynamic routing, spread for EM routing; else
    cross-entropy, or binary cross-entropy for multi-label data)."""
    kind = preset.train.loss
    if kind != "auto":
        return kind
    if preset.model.arch == "capsnet":
        own = preset.model.algorithm().loss
        if own != "cross_entropy":
            return own
    return "bce" if multi_label else "cross_entropy"


def default_eval_loss(multi_label: bool, num_classes: int) -> EvalLoss:
    if multi_label:
        return "bce", lambda out, y: F.binary_cross_entropy_with_logits(
            out, multi_hot(y, num_classes)
        )
    return "cross_entropy", lambda out, y: F.cross_entropy(out, y)


def eval_loss(preset: Preset, multi_label: bool, num_classes: int) -> EvalLoss:
    """The model's own training loss for reporting: ``(name, fn(outputs, labels))``.

    Dynamic-routing models output capsule lengths and EM models class activations, not
    logits, so their loss is the margin or spread loss they train with (spread at its final
    margin, 0.9), never a cross-entropy on those outputs. Label smoothing is left out.
    """
    name = loss_name(preset, multi_label)
    unsmoothed = dataclasses.replace(
        preset, train=dataclasses.replace(preset.train, label_smoothing=0.0)
    )
    fn = make_loss(unsmoothed, multi_label, num_classes)
    return name, lambda out, y: fn(out, y, 1.0)


def make_loss(
    preset: Preset, multi_label: bool, num_classes: int
) -> Callable[[Tensor, Tensor, float], Tensor]:
    """``loss(logits, y, progress)``; ``progress`` in [0, 1] is the share of training done.

    The loss is :func:`loss_name`'s: ``cross_entropy`` (with label smoothing) for one label per
    image, ``bce`` (binary cross-entropy per class) for multi-label data, ``margin``: Sabour et
    al.'s margin loss on the model's outputs (capsule lengths), ``spread``: Hinton et al.'s
    spread loss on class activations, margin rising linearly from 0.2 to 0.9 over the first
    half of training.
    """
    kind = loss_name(preset, multi_label)
    smoothing = preset.train.label_smoothing
    if kind == "cross_entropy":
        if multi_label:
            raise ConfigError(
                "train.loss: cross_entropy needs one label per image; use bce or auto"
            )
        return lambda logits, y, progress: F.cross_entropy(logits, y, label_smoothing=smoothing)
    if kind == "bce":
        return lambda logits, y, progress: F.binary_cross_entropy_with_logits(
            logits, multi_hot(y, num_classes)
        )
    if kind == "margin":
        return lambda logits, y, progress: margin_loss(
            logits, multi_hot(y, num_classes) if multi_label else y
        )
    return lambda logits, y, progress: spread_loss(
        logits, multi_hot(y, num_classes) if multi_label else y, 0.2 + 0.7 * min(1.0, 2 * progress)
    )


def count_correct(logits: Tensor, y: Tensor) -> Tensor:
    """Top-1 hits, or the paper's top-2 metric for multi-label data."""
    if y.dim() == 2:
        return top2_correct(logits, y).sum()
    return (logits.argmax(1) == y).sum()


def _target_matrix(target: Tensor, scores: Tensor) -> Tensor:
    """Integer targets ``[b]`` or multi-hot targets ``[b, C]`` -> float ``[b, C]``."""
    if scores.dim() != 2:
        raise ValueError(f"expected scores [b, C], got shape {tuple(scores.shape)}")
    if target.dim() == 1 and target.shape[0] == scores.shape[0]:
        return F.one_hot(target.long(), scores.shape[1]).to(scores.dtype)
    if target.shape == scores.shape:
        return target.to(scores.dtype)
    raise ValueError(
        f"targets must be [b] class indices or [b, C] multi-hot, got {tuple(target.shape)}"
        f" for scores {tuple(scores.shape)}"
    )


def margin_loss(
    lengths: Tensor,
    target: Tensor,
    m_plus: float = 0.9,
    m_minus: float = 0.1,
    lam: float = 0.5,
) -> Tensor:
    """Margin loss of Sabour et al. 2017 (eq. 4), summed over classes, mean over the batch.

    ``L_k = T_k max(0, m+ - |v_k|)^2 + lam (1 - T_k) max(0, |v_k| - m-)^2``.
    """
    t = _target_matrix(target, lengths)  # [b, C]
    pos = t * F.relu(m_plus - lengths).pow(2)
    neg = lam * (1.0 - t) * F.relu(lengths - m_minus).pow(2)
    return (pos + neg).sum(-1).mean()


def spread_loss(activations: Tensor, target: Tensor, margin: float | Tensor) -> Tensor:
    """Spread loss of Hinton et al. 2018, summed over classes, mean over the batch.

    ``L = sum_{i != t} max(0, margin - (a_t - a_i))^2``; with multi-hot targets the sum runs over
    every (target ``t``, non-target ``i``) pair. The caller schedules ``margin`` (0.2 -> 0.9).
    """
    t = _target_matrix(target, activations)  # [b, C]
    gap = margin - (activations.unsqueeze(2) - activations.unsqueeze(1))  # [b, C(t), C(i)]
    pairs = t.unsqueeze(2) * (1.0 - t).unsqueeze(1)  # [b, C(t), C(i)]
    return (F.relu(gap).pow(2) * pairs).sum((1, 2)).mean()


def multi_hot(y: torch.Tensor, classes: int) -> torch.Tensor:
    """``[B, 2]`` labels (``-1`` = none) or ``[B]`` labels as a float multi-hot ``[B, classes]``."""
    if y.dim() == 1:
        return torch.nn.functional.one_hot(y, classes).float()
    hot = torch.zeros(y.shape[0], classes + 1, device=y.device)
    hot.scatter_(
        1, torch.where(y < 0, classes, y), 1.0
    )  # [B, classes + 1]: -1 goes to a spare slot
    return hot[:, :classes]


def top2_correct(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The paper's metric, per image: for a pair, the top-2 classes equal the two labels; for a
    single digit, the top-1 class equals the label. ``logits [B, C]``, ``y [B, 2]``."""
    top2 = logits.topk(2, dim=1).indices  # [B, 2]
    single = y[:, 1] < 0
    pair_ok = ((top2[:, :1] == y[:, :1]) | (top2[:, 1:] == y[:, :1])).squeeze(1) & (
        (top2[:, :1] == y[:, 1:]) | (top2[:, 1:] == y[:, 1:])
    ).squeeze(1)
    single_ok = top2[:, 0] == y[:, 0]
    return torch.where(single, single_ok, pair_ok)
