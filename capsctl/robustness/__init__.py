"""Robustness of a trained model: white-box attacks, shifted test sets and common corruptions.

:func:`robustness_checkpoint` is what ``capsctl robustness`` calls for each checkpoint;
:func:`robustness_summary` is its short form for suite reports; :func:`plot_robustness` draws
accuracy against eps and against the shift's magnitude (matplotlib, imported when drawing).
"""

from __future__ import annotations

from capsctl.robustness.api import (
    DEFAULT_EPS,
    AttackPoint,
    CorruptionRow,
    RobustnessResult,
    ShiftPoint,
    robustness_checkpoint,
    robustness_summary,
)
from capsctl.robustness.plot import plot_robustness

__all__ = [
    "DEFAULT_EPS",
    "AttackPoint",
    "CorruptionRow",
    "RobustnessResult",
    "ShiftPoint",
    "plot_robustness",
    "robustness_checkpoint",
    "robustness_summary",
]
