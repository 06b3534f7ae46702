"""capsctl's environment variables, read one way: switches (:func:`switch`), positive numbers
(:func:`positive`) and folders; a bad value is one :class:`~capsctl.errors.UsageError` line
naming the variable. The ``capsctl`` command checks them all at start
(:func:`check_environment`), so a bad value is refused before any work whatever else is set
(``CAPSCTL_CHUNK_MIB`` is read only by the torch code, which ``CAPSCTL_NATIVE=1`` may not run).

An empty or unset variable takes its default.
"""

from __future__ import annotations

import math
import os

from capsctl.errors import UsageError

__all__ = ["FOLDERS", "KNOWN", "NUMBERS", "SWITCHES", "check_environment", "positive", "switch"]

#: On/off variables and their defaults.
SWITCHES: dict[str, bool] = {
    "CAPSCTL_NATIVE": True,  # the compiled routing loops (capsctl/layers/backend/native.py)
    "CAPSCTL_TRITON": True,  # the Triton kernels on GPUs (capsctl/layers/backend/dispatch.py)
    "CAPSCTL_OMP_SPIN": True,  # short OpenMP spinning (capsctl/threads.py)
    "CAPSCTL_KEEP_MEMORY": True,  # freed memory kept for reuse (capsctl/memory.py)
    "CAPSCTL_DEBUG": False,  # tracebacks instead of one-line errors (capsctl/cli/app.py)
}
#: Positive numbers: (whole numbers only, unit, largest value).
NUMBERS: dict[str, tuple[bool, str, float]] = {
    "CAPSCTL_CHUNK_MIB": (False, "MiB", 65_536),  # votes per chunk (layers/backend/chunks.py)
    "CAPSCTL_ROUTING_THREADS": (True, "threads", 4096),  # threads per pass (the same)
    "CAPSCTL_DENSE_BUDGET_MB": (False, "MiB", 1 << 20),  # dense votes on CUDA (backend/cost.py)
}
#: Folders (any path; used as given).
FOLDERS = ("CAPSCTL_DATA", "CAPSCTL_CACHE")
KNOWN = (*SWITCHES, *NUMBERS, *FOLDERS)

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def switch(name: str, default: bool) -> bool:
    """The variable ``name`` as on or off: ``1``/``true``/``yes``/``on`` or
    ``0``/``false``/``no``/``off`` in any case; ``default`` when empty or unset; UsageError
    for anything else."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if raw.lower() in _ON:
        return True
    if raw.lower() in _OFF:
        return False
    shown = raw if raw.isprintable() and len(raw) <= 40 else repr(raw[:40])
    raise UsageError(
        f"{name}={shown}: expected 0 or 1 (also false/true, no/yes, off/on); unset it for "
        f"the default ({'1' if default else '0'})"
    )


def positive(name: str) -> float | None:
    """The variable ``name`` of :data:`NUMBERS` as a number in ``(0, largest]`` (whole where
    it must be); None when empty or unset; UsageError for anything else."""
    whole, unit, largest = NUMBERS[name]
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(int(raw)) if whole else float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= largest):
        kind = "whole number" if whole else "number"
        raise UsageError(
            f"{name} must be a positive {kind} of {unit} (at most {largest:g}), got {raw!r}"
        )
    return value


def check_environment() -> None:
    """UsageError for the first variable of :data:`SWITCHES` or :data:`NUMBERS` that is set
    to a bad value."""
    for name, default in SWITCHES.items():
        switch(name, default)
    for name in NUMBERS:
        positive(name)
