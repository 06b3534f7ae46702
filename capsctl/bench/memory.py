"""Peak memory of the process while a model is measured.

``peak_rss_bytes`` is the peak resident set size of the *whole process* while a model was
measured: from just before it was built until its last timed step. A background thread
(:class:`RssSampler`) reads ``/proc/self/statm`` every ~2 ms. Before each model the previous
one is dropped and :func:`release_memory` runs ``gc.collect()`` and, on glibc,
``malloc_trim(0)``, which returns freed heap pages to the OS, so memory an earlier model freed
does not count. Without ``/proc`` (macOS, BSD) the value comes from
``resource.getrusage(RUSAGE_SELF).ru_maxrss``, which is the peak over the process's
*lifetime*, so later models also show earlier models' peaks.
"""

from __future__ import annotations

import gc
import os
import sys
import threading

from capsctl.memory import glibc

__all__ = ["RssSampler", "current_rss_bytes", "release_memory"]

_STATM = "/proc/self/statm"
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _statm_rss(fd: int) -> int:
    fields = os.pread(fd, 128, 0).split()
    return int(fields[1]) * _PAGE_SIZE


def _maxrss_bytes() -> int | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # kilobytes on Linux/BSD, bytes on macOS
    return int(value) if sys.platform == "darwin" else int(value) * 1024


def current_rss_bytes() -> int | None:
    """The process's resident memory now (``/proc/self/statm``), or None without ``/proc``."""
    try:
        fd = os.open(_STATM, os.O_RDONLY)
    except OSError:
        return None
    try:
        return _statm_rss(fd)
    finally:
        os.close(fd)


class RssSampler:
    """Peak resident memory of the whole process while the ``with`` block runs.

    A daemon thread reads ``/proc/self/statm`` every ``interval`` seconds (plus one reading on
    entry and one on exit). Where ``/proc`` is missing, :attr:`peak_bytes` is the process's
    lifetime peak from ``getrusage`` (``source == "ru_maxrss"``), or None where that is missing
    too. Spikes shorter than the interval (or than the time the sampler waits for the GIL) can
    be missed.
    """

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.peak_bytes: int | None = None
        self.samples = 0
        self.source: str | None = None
        self._fd: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        assert self._fd is not None
        rss = _statm_rss(self._fd)
        self.samples += 1
        if self.peak_bytes is None or rss > self.peak_bytes:
            self.peak_bytes = rss

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._sample()
            except OSError:  # pragma: no cover - /proc vanished
                return

    def __enter__(self) -> RssSampler:
        try:
            self._fd = os.open(_STATM, os.O_RDONLY)
            self._sample()
        except (OSError, ValueError, IndexError):
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self.source = "ru_maxrss"
            return self
        self.source = "statm"
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="capsctl-rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is None:
            self.peak_bytes = _maxrss_bytes()
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            self._sample()
        finally:
            os.close(self._fd)
            self._fd = None


def release_memory() -> None:
    """``gc.collect()``, then (glibc) ``malloc_trim(0)`` to return freed pages."""
    gc.collect()
    lib = glibc()
    if lib is not None:
        lib.malloc_trim(0)
