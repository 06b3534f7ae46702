"""How the process gets memory for tensors on the CPU.

A training step frees and allocates the same large tensors again every step (activations,
gradients, layout copies: up to ~70 MB each at batch 128). glibc's ``malloc`` serves blocks
above its mmap threshold (at most 32 MiB) with fresh ``mmap`` pages and gives them back to the
OS on ``free``, so every step page-faults all of them in again: the kernel zeroes each page on
its first touch. On this project's 2-core reference machine that was about 30% of a
``cifar10-caps-simple`` training step (1.03 s -> 0.73 s at batch 128 with the setting below) and
of ResNet-18's (1.29 s -> 0.90 s at batch 32), the same for every model in kind.

:func:`keep_freed_memory` makes glibc serve every block from its heap (``M_MMAP_MAX = 0``) and
keep freed memory there for the next allocation (``M_TRIM_THRESHOLD``: up to 2 GiB free at the
heap's top before it trims), so a step reuses the pages of the previous one. The price is peak
resident memory: blocks of different sizes do not always fit the holes earlier ones left, so the
heap settles a little above the step's true peak and stays there (``cifar10-caps-simple``,
batch 128: 1.14 GB -> 1.56 GB peak, steady over a run, measured on the same machine). Freed
memory goes back to the OS when the process ends or ``malloc_trim`` is called (capsctl's
benchmarks call it between models). PyTorch's CPU tuning guides reach the same end by
preloading jemalloc or tcmalloc; this needs no extra library.

The ``capsctl`` command applies it at start; ``CAPSCTL_KEEP_MEMORY=0`` leaves the allocator as
it is. Other allocators (musl, macOS, Windows, a preloaded jemalloc) are left alone.
"""

from __future__ import annotations

import ctypes
import sys

from capsctl.environment import switch

__all__ = ["ENV", "glibc", "keep_freed_memory"]

#: Environment variable: ``0`` keeps the C library's default allocator behaviour.
ENV = "CAPSCTL_KEEP_MEMORY"

# mallopt parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_TRIM_BYTES = 2**31 - 1  # mallopt takes an int: the largest free heap top kept, ~2 GiB

_GLIBC: list[ctypes.CDLL | None] = []  # the looked-up library, once


def glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc (None on musl, macOS, Windows...)."""
    if not _GLIBC:
        lib: ctypes.CDLL | None = None
        if sys.platform.startswith("linux"):
            try:
                lib = ctypes.CDLL(None)
                version = lib.gnu_get_libc_version  # glibc only: musl has no such symbol
                version.restype = ctypes.c_char_p
                lib = lib if version() else None
            except (OSError, AttributeError):
                lib = None
        _GLIBC.append(lib)
    return _GLIBC[0]


def keep_freed_memory() -> bool:
    """On glibc, serve tensors from the heap and keep freed memory for reuse (see the module
    docstring). Returns True when applied; False where ``CAPSCTL_KEEP_MEMORY=0``, on other C
    libraries or when glibc refuses. Process-wide; applying it twice is harmless."""
    lib = glibc()
    if not switch(ENV, default=True) or lib is None:
        return False
    mallopt = lib.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_BYTES))
