"""How long torch's OpenMP threads spin after a parallel region, on GNU OpenMP (Linux wheels).

torch runs a convolution on its OpenMP threads; capsctl's compiled loops (the routed passes, the
poses' LayerNorm) run on threads of their own (capsctl/layers/chunks.py). When a parallel region
ends, GNU OpenMP's idle threads busy-wait for the next one before they sleep: by default 300,000
rounds of a ``pause`` instruction, about 4 ms on this project's 2-core reference machine (13 ns a
``pause``, measured). A compiled loop that starts right after a convolution shares the cores with
those spinning threads for its first milliseconds: on a 2-core machine its two threads and the
spinning one take turns on two cores.

:func:`short_omp_spin` sets ``GOMP_SPINCOUNT`` to :data:`SPIN_COUNT` (about 0.13 ms of spinning),
still longer than the gaps between two of torch's operations in a training step (tens of
microseconds), so back-to-back parallel regions (ResNet-18's whole step) keep their threads
awake, while a thread left idle for a compiled loop sleeps almost at once. Measured on
this project's 2-core reference machine, batch 128 of ``cifar10-caps-simple``: see the README's
training-loop table.

GNU OpenMP reads the variable once, when torch loads it, so this must run before ``import
torch``: the ``capsctl`` command applies it at start (torch is imported inside commands) and so do
the benchmark scripts. A ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` of the user's is left alone,
as is everything when ``CAPSCTL_OMP_SPIN=0``; other OpenMP runtimes ignore the variable.
"""

from __future__ import annotations

import os
import sys

from capsctl.environment import switch

__all__ = ["ENV", "SPIN_COUNT", "short_omp_spin"]

#: Environment variable: ``0`` leaves GNU OpenMP's waiting as it is.
ENV = "CAPSCTL_OMP_SPIN"

#: Spin rounds of an idle OpenMP thread before it sleeps (GNU OpenMP's default: 300,000).
SPIN_COUNT = 10_000

_USER_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def short_omp_spin() -> bool:
    """Set ``GOMP_SPINCOUNT`` to :data:`SPIN_COUNT` for the OpenMP runtime torch will load.

    Returns True when set; False where ``CAPSCTL_OMP_SPIN=0``, where the user set
    ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY``, or where torch is already imported (too late: the
    runtime has read its settings)."""
    if not switch(ENV, default=True) or "torch" in sys.modules:
        return False
    if any(name in os.environ for name in _USER_SETTINGS):
        return False
    os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    return True
