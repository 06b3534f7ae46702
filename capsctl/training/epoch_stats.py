"""The running sums of one training epoch: loss, correct predictions, images and the gradient's
norm, kept on the device (reading them waits for it) and stored in mid-epoch checkpoints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["EpochStats"]


@dataclass
class EpochStats:
    loss_sum: Tensor
    correct: Tensor
    # the total L2 norm of the gradient over all parameters, before any clipping: summed over
    # the epoch's steps and its largest, a trace of how hard each step pushes
    grad_norm_sum: Tensor
    grad_norm_max: Tensor
    steps: int = 0
    seen: int = 0
    resumed_seen: int = 0  # images done before an interruption (for the speed shown)
    # training seconds of the epoch before an interruption (None: a checkpoint older than this
    # record, whose speed is then that of the images after the resume)
    resumed_seconds: float | None = 0.0
    # on an accelerator: the first step whose loss was not finite (-1: none), read every
    # SYNC_EVERY steps instead of after each step (each read waits for the device)
    first_bad: Tensor | None = None

    @classmethod
    def start(cls, device: torch.device, partial: dict[str, Any] | None) -> EpochStats:
        """Zeroed sums, or those of ``partial`` (a mid-epoch checkpoint's) for a resumed epoch."""
        zero = torch.zeros((), device=device)
        stats = cls(
            zero.clone(),
            torch.zeros((), device=device, dtype=torch.int64),
            zero.clone(),
            zero.clone(),
        )
        if device.type != "cpu":
            stats.first_bad = torch.full((), -1, device=device, dtype=torch.int64)
        if partial:
            stats.loss_sum += float(partial["loss_sum"])
            stats.correct += int(partial["correct"])
            stats.seen = stats.resumed_seen = int(partial["seen"])
            seconds = partial.get("seconds")
            stats.resumed_seconds = None if seconds is None else float(seconds)
            # checkpoints older than the gradient trace have none: the epoch's trace then
            # covers the steps after the resume
            stats.grad_norm_sum += float(partial.get("grad_norm_sum", 0.0))
            stats.grad_norm_max += float(partial.get("grad_norm_max", 0.0))
            stats.steps = int(partial.get("grad_steps", 0))
        return stats

    def note_grad_norm(self, norm: Tensor) -> None:
        """Add one step's total gradient norm (a 0-d tensor, not read here)."""
        norm = norm.detach().float()
        self.grad_norm_sum += norm
        self.grad_norm_max = torch.maximum(self.grad_norm_max, norm)
        self.steps += 1

    def grad_record(self) -> dict[str, float]:
        """``grad_norm_mean`` and ``grad_norm_max`` of the epoch (none before its first step)."""
        if self.steps == 0:
            return {}
        return {
            "grad_norm_mean": float(self.grad_norm_sum) / self.steps,
            "grad_norm_max": float(self.grad_norm_max),
        }

    def seconds(self, piece: float) -> float:
        """The epoch's training seconds: ``piece`` (since this process started it or resumed
        it) and those before an interruption."""
        return piece + (self.resumed_seconds or 0.0)

    def images_per_s(self, piece: float) -> float:
        """Training images per second over the whole epoch, its pieces before interruptions
        included (for a checkpoint without their seconds: over the images after the resume)."""
        if self.resumed_seconds is None:
            return (self.seen - self.resumed_seen) / max(piece, 1e-9)
        return self.seen / max(self.seconds(piece), 1e-9)

    def partial(self, done: int, piece: float) -> dict[str, Any]:
        """What a mid-epoch checkpoint keeps after ``done`` steps, ``piece`` training seconds
        after this process started or resumed the epoch."""
        return {
            "step": done,
            "seconds": self.seconds(piece),
            "loss_sum": float(self.loss_sum),
            "correct": int(self.correct),
            "seen": self.seen,
            "grad_norm_sum": float(self.grad_norm_sum),
            "grad_norm_max": float(self.grad_norm_max),
            "grad_steps": self.steps,
        }
