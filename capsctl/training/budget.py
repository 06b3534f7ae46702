"""A run's wall-time budget (``train.time_limit``): the schedule fits the time, not the reverse.

Without a limit the schedule (learning rate, loss margins) follows the optimizer step:
``progress = step / total_steps``. With ``train.time_limit = L`` seconds it follows whichever is
further along, the steps or the clock, ``progress = max(step / total_steps, elapsed / (L -
reserve))``, and training stops when the clock's share reaches 1. So a 350-epoch recipe given
30 minutes warms up, decays and ends inside those 30 minutes, as budgeted training does (Li,
Yumer, Ramanan, "Budgeted Training: Rethinking Deep Neural Network Training Under Resource
Constraints", ICLR 2020), and a machine fast enough to finish the epochs first is unaffected.

``elapsed`` counts from the start of :func:`capsctl.training.fit` (data loading included) and
adds the seconds of earlier lives of a resumed run. ``reserve`` is the time kept for what comes
after the last step: the last validation and the test, estimated from the evaluation speed
measured so far (before any evaluation: three times the training speed, as a forward pass costs
about a third of a training step; the first step, which pays for warming up, is left out),
plus a margin for checkpoints and curves, and never more than a quarter of the limit. A run
under a time
limit is not bit-for-bit repeatable: its schedule depends on the machine's speed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["TimeBudget"]

# Kept after the last step besides the evaluations: checkpoints, results and curves (seconds).
END_MARGIN_S = 5.0
# Forward-only evaluation versus a training step, images per second, before any is measured.
EVAL_SPEEDUP_GUESS = 3.0
# The most of the limit kept for the end of the run, whatever the estimate says.
MAX_RESERVE_SHARE = 0.25


@dataclass
class TimeBudget:
    """The clock of one run. ``limit``: seconds or None; ``total_steps``: the schedule's length
    in optimizer steps; ``eval_images``: images evaluated after the last step (validation and
    test)."""

    limit: float | None
    total_steps: int
    eval_images: int = 0
    started: float = 0.0  # time.perf_counter() when this life of the run began
    before: float = 0.0  # seconds spent in earlier lives (resume)
    _train: tuple[int, float] = (0, 0.0)  # images, seconds of training steps (not the first)
    _first_step_seen: bool = False
    _eval: tuple[int, float] = (0, 0.0)  # images, seconds of evaluation

    def elapsed(self) -> float:
        """Seconds of the run so far, earlier lives included."""
        return self.before + time.perf_counter() - self.started

    def note_train(self, images: int, seconds: float) -> None:
        if not self._first_step_seen:  # warm-up: allocations, kernel choices, lazy imports
            self._first_step_seen = True
            return
        n, s = self._train
        self._train = (n + images, s + seconds)

    def note_eval(self, images: int, seconds: float) -> None:
        n, s = self._eval
        self._eval = (n + images, s + seconds)

    def reserve(self) -> float:
        """Seconds kept for the evaluations after the last step and the end of the run (at
        most a quarter of the limit)."""
        cap = MAX_RESERVE_SHARE * self.limit if self.limit is not None else float("inf")
        return min(self._estimate(), cap)

    def _estimate(self) -> float:
        if self.eval_images == 0:
            return END_MARGIN_S
        n, s = self._eval
        if n > 0 and s > 0:
            rate = n / s
        else:
            tn, ts = self._train
            if tn == 0 or ts <= 0:
                return END_MARGIN_S
            rate = EVAL_SPEEDUP_GUESS * tn / ts
        return self.eval_images / rate + END_MARGIN_S

    def time_fraction(self) -> float:
        """Share of the training time used (0 without a limit)."""
        if self.limit is None:
            return 0.0
        return self.elapsed() / max(self.limit - self.reserve(), 1e-9)

    def progress_steps(self, step: float) -> float:
        """The schedule's position in steps: ``step``, or further when the clock is ahead."""
        return max(float(step), min(self.time_fraction(), 1.0) * self.total_steps)

    def progress(self, step: float) -> float:
        """The schedule's position in [0, 1]."""
        return min(1.0, self.progress_steps(step) / max(self.total_steps, 1))

    def spent(self) -> bool:
        """True when the limit (less the reserve) is reached."""
        return self.limit is not None and self.time_fraction() >= 1.0
