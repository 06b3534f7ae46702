"""Ctrl-C during training: a flag checked between steps, and the error that ends the run.

The first Ctrl-C sets a flag; the trainer checks it between set-up steps and between training
steps, writes a resumable checkpoint (mid-epoch if need be) and raises :class:`Interrupted`
(exit code 130). A second Ctrl-C interrupts at once.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

from capsctl.errors import CapsctlError

__all__ = ["Interrupted", "sigint_as_flag"]


class Interrupted(CapsctlError):
    """Training stopped on Ctrl-C after saving a resumable checkpoint."""

    exit_code = 130


@contextlib.contextmanager
def sigint_as_flag(enabled: bool) -> Iterator[dict[str, bool]]:
    """Turn Ctrl-C into a flag checked between steps, so a checkpoint can be written cleanly.

    A second Ctrl-C interrupts at once.
    """
    flag = {"stop": False}
    try:
        previous = signal.getsignal(signal.SIGINT) if enabled else None
    except ValueError:  # not the main thread
        previous = None
    if previous is None:
        yield flag
        return

    def handler(signum: int, frame: Any) -> None:
        if flag["stop"]:
            raise KeyboardInterrupt
        flag["stop"] = True

    try:
        signal.signal(signal.SIGINT, handler)
    except ValueError:
        yield flag
        return
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)
