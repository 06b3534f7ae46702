"""One device resolver for every command.

``auto`` picks CUDA when available, then Apple's MPS, then the CPU. Explicit names are checked:
``cpu``, ``cuda``, ``cuda:N`` (N must exist) and ``mps``; anything else, or a device this machine
does not have, is a :class:`~capsctl.errors.UsageError` that says what to use instead.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from capsctl.errors import UsageError

__all__ = ["autocast", "resolve_device"]


def resolve_device(name: str) -> torch.device:
    """``auto``, ``cpu``, ``cuda[:N]`` or ``mps`` -> a usable :class:`torch.device`."""
    text = name.strip().lower()
    if text == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {name}: unknown; use auto, cpu, cuda, cuda:N or mps") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {name}: no CUDA device is available here; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(
                f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                "use cuda:0 or a lower index"
            )
        return dev
    if dev.type == "mps":
        if not _mps_available():
            raise UsageError(f"--device {name}: no MPS device is available here; use --device cpu")
        return dev
    raise UsageError(f"--device {name}: unknown; use auto, cpu, cuda, cuda:N or mps")


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def autocast(device: torch.device, amp: bool) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on ``device`` when ``amp``, else nothing."""
    if not amp:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
