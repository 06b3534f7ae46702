"""Ctrl-C or SIGTERM during training: a flag checked between steps, and the error that ends the
run.

The first Ctrl-C (or SIGTERM, as sent by ``timeout``, SLURM and ``docker stop``) sets a flag;
the trainer checks it between set-up steps and between training
steps, writes a resumable checkpoint (mid-epoch if need be) and raises :class:`Interrupted`
(exit code 130). A second Ctrl-C interrupts at once.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

from capsctl.errors import CapsctlError

__all__ = ["STOP_SIGNALS", "Interrupted", "sigint_as_flag", "stop_exit_code"]


class Interrupted(CapsctlError):
    """Training stopped on Ctrl-C after saving a resumable checkpoint."""

    exit_code = 130


#: The signals turned into the stop flag.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def stop_exit_code(flag: dict[str, Any]) -> int:
    """The exit code of a run stopped by ``flag``: 143 after SIGTERM, else 130 (Ctrl-C)."""
    return 143 if flag.get("signal") == signal.SIGTERM else 130


@contextlib.contextmanager
def sigint_as_flag(enabled: bool) -> Iterator[dict[str, Any]]:
    """Turn Ctrl-C and SIGTERM into a flag checked between steps, so a checkpoint can be
    written cleanly. ``flag["signal"]`` is the signal that set it.

    A second signal interrupts at once.
    """
    flag: dict[str, Any] = {"stop": False, "signal": None}
    previous: dict[int, Any] = {}
    if enabled:
        for sig in STOP_SIGNALS:
            try:
                previous[sig] = signal.getsignal(sig)
            except ValueError:  # not the main thread
                previous.clear()
                break

    def handler(signum: int, frame: Any) -> None:
        if flag["stop"]:
            raise KeyboardInterrupt
        flag["stop"] = True
        flag["signal"] = signum

    installed = []
    try:
        for sig in previous:
            try:
                signal.signal(sig, handler)
                installed.append(sig)
            except (ValueError, OSError):
                break
        yield flag
    finally:
        for sig in installed:
            signal.signal(sig, previous[sig] if previous[sig] is not None else signal.SIG_DFL)
