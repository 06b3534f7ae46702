"""Training: the fit loop, the recipe, several processes, the run folder and resuming.

- :mod:`capsctl.training.trainer`: :func:`fit` (set up, restore, train an epoch, end an epoch,
  test once);
- :mod:`capsctl.training.recipe`: optimizer, LR schedule, EMA, seeding;
- :mod:`capsctl.training.distributed`: ``torchrun`` processes;
- :mod:`capsctl.training.run_folder`: the files of a run;
- :mod:`capsctl.training.resume`: what a resumed run may change;
- :mod:`capsctl.training.command`: :func:`train_from_preset`, what ``capsctl train`` calls.
"""

from __future__ import annotations

from capsctl.training.command import train_from_preset
from capsctl.training.recipe import lr_factor
from capsctl.training.run_folder import BEST, LAST, METRICS
from capsctl.training.trainer import FitResult, Interrupted, fit

__all__ = [
    "BEST",
    "LAST",
    "METRICS",
    "FitResult",
    "Interrupted",
    "fit",
    "lr_factor",
    "train_from_preset",
]
