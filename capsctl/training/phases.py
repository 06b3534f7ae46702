"""Where an epoch's training time goes: seconds per phase of the step, in each metrics line.

The phases of a training step, in order: ``data`` (the loader's batch: gather, augmentation,
conversion), ``forward`` (model and loss, and the check that the loss is finite), ``backward``,
``optimizer`` (gradient clipping, the optimizer and LR-schedule steps, the EMA update) and
``other`` (running sums, progress events, the time-limit and Ctrl-C checks). Their sum is the
epoch's ``epoch_seconds``; validation is timed apart (``val_seconds``).

Host wall time from :func:`time.perf_counter`. On a CPU that is where the work happens; on an
accelerator kernels run asynchronously, so a phase shows the time its kernels were queued and
the wait lands in the phase that first needs a result (the finiteness check: ``forward``).
"""

from __future__ import annotations

import time

__all__ = ["PHASES", "PhaseClock"]

PHASES = ("data", "forward", "backward", "optimizer", "other")


class PhaseClock:
    """A lap timer: :meth:`lap` charges the time since the previous lap to a phase."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._t = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] += now - self._t
        self._t = now

    def record(self) -> dict[str, float]:
        """``{"data_seconds": ..., ..., "other_seconds": ...}`` for a metrics line."""
        return {f"{p}_seconds": round(s, 4) for p, s in self.seconds.items()}
