"""How the vote-sized passes are tiled: how much work one chunk holds, per kind of device, its
shape (:func:`tile_shape`) and the threads that share a pass's chunks; :func:`tile_plan` gives a
chunked pass all of it at once.

The vote-sized passes (capsctl/layers/passes/: routed.py, weighted.py, em_moments.py, gated.py)
never hold the vote tensor: they build it chunk by chunk, so that every pass over a chunk runs
at cache speed instead of memory speed, while each chunk stays large enough for its fixed cost
(some 20 kernel calls) not to dominate. On a CPU a chunk holds 1/16 of the last-level cache of
votes (:func:`vote_chunk_bytes`; 2 MiB with a 32 MiB L3), ``CAPSCTL_CHUNK_MIB`` overrides it.
The best size depends on the machine more than on the pass: on one 2-core virtual machine with
a 32 MiB L3 (AMD EPYC, 1 MiB L2 per core) training steps at batch 32 ran fastest with 2 MiB
chunks for the routed pass and for EM routing alike (1.3-1.6x faster than 8 MiB, and
1.2-1.4x faster than 1 MiB), while on an earlier 2-core machine, also with a 32 MiB L3, 8 MiB
chunks ran 11% faster than 2 MiB. 1/16 of the cache loses least on both.

On an accelerator the trade-off is different. Each chunk costs a handful of kernel launches
(about 5-10 us each), and memory bandwidth is three orders of magnitude higher than a CPU
core's: a 2 MiB chunk is read in about half a microsecond at the 4.8 TB/s of an H200, so small
chunks would leave the device idle between launches. A chunk must be a few tens of MiB before
its memory traffic outweighs the launch overhead; at :data:`DEVICE_CHUNK_BYTES` = 64 MiB it
takes about 14 us at that bandwidth (about as long as two launches), while the few
chunk-sized buffers stay a negligible share of the device's memory. Beyond that, larger
chunks only add memory: the passes are bandwidth-bound either way.

On a CPU with several threads, the chunks of parent sites of one pass are dealt to that many
worker threads (:func:`site_workers`, :func:`site_spans`, :func:`run_spans`), each running its
own chunks with single-threaded kernels into its own scratch buffers; every chunk writes only
its own sites' slices of the results, and a sum over sites (a weight gradient) gets one
accumulator per thread, added up in a fixed order, so results do not depend on timing.
"""

from __future__ import annotations

import contextvars
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from capsctl.devices import denormals_flushed
from capsctl.environment import positive

__all__ = [
    "CHUNK_BYTES",
    "CHUNK_ENV",
    "DEVICE_CHUNK_BYTES",
    "THREADS_ENV",
    "chunk_bytes",
    "last_level_cache",
    "run_spans",
    "site_spans",
    "site_workers",
    "tile_budget",
    "tile_plan",
    "tile_shape",
    "vote_chunk_bytes",
]

DEVICE_CHUNK_BYTES = 64 * 2**20
# Assumed last-level cache where the OS does not say (no Linux sysfs).
FALLBACK_CACHE_BYTES = 16 * 2**20
# Bounds of a CPU chunk: below 1 MiB the fixed cost per chunk dominates, and a cache far above
# 64 MiB is split between cores anyway.
MIN_CPU_CHUNK, MAX_CPU_CHUNK = 2**20, 16 * 2**20
# A CPU chunk's share of the last-level cache (see the module docstring).
CACHE_FRACTION = 16
#: Environment variable: MiB of votes per chunk on a CPU, instead of the cache's share.
CHUNK_ENV = "CAPSCTL_CHUNK_MIB"
#: Environment variable: threads that share a pass's chunks on a CPU (see site_workers).
THREADS_ENV = "CAPSCTL_ROUTING_THREADS"


def chunk_bytes(like: Tensor, cpu_bytes: int) -> int:
    """Bytes of votes per chunk for tensors on ``like``'s device: ``cpu_bytes`` on a CPU,
    :data:`DEVICE_CHUNK_BYTES` on an accelerator."""
    return cpu_bytes if like.device.type == "cpu" else DEVICE_CHUNK_BYTES


@functools.cache
def last_level_cache(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """Bytes of the CPU's last-level cache from Linux sysfs (the highest level listed under
    ``root``), :data:`FALLBACK_CACHE_BYTES` where it cannot be read."""
    best = (0, 0)
    for index in sorted(Path(root).glob("index*")):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip().upper()
        except (OSError, ValueError):
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
        digits = size.rstrip("KMG")
        if digits.isdigit():
            best = max(best, (level, int(digits) * scale))
    return best[1] or FALLBACK_CACHE_BYTES


def vote_chunk_bytes(like: Tensor, fixed: int = 0) -> int:
    """Bytes of votes per chunk of a vote-sized pass over tensors on ``like``'s device:
    ``fixed`` when > 0 on a CPU (a module's override); else ``CAPSCTL_CHUNK_MIB`` MiB when set,
    on every device; else on a CPU 1/16 of the last-level cache (between 1 and 16 MiB), on an
    accelerator :data:`DEVICE_CHUNK_BYTES`. Raises :class:`~capsctl.errors.UsageError` for a
    ``CAPSCTL_CHUNK_MIB`` that is not a positive number."""
    if fixed > 0 and like.device.type == "cpu":
        return fixed
    mib = positive(CHUNK_ENV)
    if mib is not None:
        return max(1, int(mib * 2**20))
    if like.device.type != "cpu":
        return DEVICE_CHUNK_BYTES
    share = last_level_cache() // CACHE_FRACTION
    return max(MIN_CPU_CHUNK, min(MAX_CPU_CHUNK, share))


# Bytes of votes per tile of the routed and weighted passes on a CPU; 0 (the default): by the
# cache (vote_chunk_bytes). Tests set it to get many tiles.
CHUNK_BYTES = 0


def tile_budget(x: Tensor) -> int:
    """Bytes of votes per tile of a pass over ``x``'s sites."""
    return vote_chunk_bytes(x, CHUNK_BYTES)


def tile_shape(
    j: int,
    bsz: int,
    m: int,
    d: int,
    itemsize: int,
    *,
    budget: int,
    sites: int | None = None,
    workers: int = 1,
) -> tuple[int, int]:
    """``(Jc, Bc)``: children and sites per chunk, so that a vote chunk fits in ``budget``
    bytes; ``sites``: ``Bc`` given, for tests; ``workers``: threads that will share the chunks
    of sites (at least that many chunks).

    Whole rows of sites come first: the votes of one child at many sites are one tall matrix
    product ``[Bc*a, x] @ [x, c*m]``, many times faster than many small products (``x`` is tiny).
    """
    per_site = max(1, m * d * itemsize)
    bc = max(1, min(bsz, sites or budget // per_site, -(-bsz // max(1, workers))))
    bc = -(-bsz // -(-bsz // bc))  # equal chunks of sites, no short last one
    jc = max(1, min(j, budget // (per_site * bc)))
    return jc, bc


def tile_plan(
    x: Tensor, m: int, d: int, sites: int | None = None
) -> tuple[int, int, list[tuple[int, int]]]:
    """``(Jc, Bc, spans)`` of a chunked pass over ``x[J, B, a, x]`` with ``m`` parents of
    ``d`` entries: the tile shape within :func:`tile_budget` and the runs of sites of the
    threads that share the tiles; ``sites``: ``Bc`` given
    (tests, ``dispatch.use("chunked", sites=...)``)."""
    j, bsz = x.shape[0], x.shape[1]
    workers = site_workers(x)
    budget = tile_budget(x)
    jc, bc = tile_shape(j, bsz, m, d, x.element_size(), budget=budget, sites=sites, workers=workers)
    return jc, bc, site_spans(bsz, bc, workers)


# -- sharing a pass's chunks of sites between threads -----------------------------------------

_POOL: dict[str, Any] = {"size": 0, "pool": None}
_POOL_LOCK = threading.Lock()
_WORKER = threading.local()


def _reset_pool() -> None:
    _POOL.update(size=0, pool=None)  # a forked child has no worker threads


os.register_at_fork(after_in_child=_reset_pool)


def site_workers(like: Tensor) -> int:
    """How many threads share the chunks of sites of one pass over ``like``'s sites.

    On a CPU: torch's intra-op thread count (``CAPSCTL_ROUTING_THREADS`` overrides it; ``1``
    runs every chunk in the calling thread, as torch would). Each thread runs its own chunks
    with single-threaded kernels. The kernels of a chunk (a matrix product with an inner
    dimension of 4 to 16, element-wise products and sums over a few MiB) are too short for
    torch's own threads to pay off: on 2 cores two threads ran them 0.9-1.7x as fast as one,
    while two threads each running its own kernels single-threaded did 1.9x the work of one in
    the same time. 1 on accelerators and inside a worker thread. Raises
    :class:`~capsctl.errors.UsageError` for a ``CAPSCTL_ROUTING_THREADS`` that is not a positive
    whole number.
    """
    if like.device.type != "cpu" or getattr(_WORKER, "active", False):
        return 1
    threads = positive(THREADS_ENV)
    return max(1, torch.get_num_threads()) if threads is None else int(threads)


def site_spans(bsz: int, bc: int, workers: int) -> list[tuple[int, int]]:
    """Sites ``[0, bsz)`` in chunks of ``bc``, dealt in contiguous runs of whole chunks to at
    most ``workers`` threads: one ``(start, stop)`` per thread."""
    starts = list(range(0, bsz, bc))
    n = min(workers, len(starts))
    spans = []
    for k in range(n):
        first, last = starts[k * len(starts) // n], starts[(k + 1) * len(starts) // n - 1]
        spans.append((first, min(bsz, last + bc)))
    return spans


def _single_threaded(ready: threading.Barrier) -> None:
    # This thread's lazy thread set-up runs first, so that it cannot undo the next line later.
    torch.get_num_threads()
    torch.set_num_threads(1)  # this thread's kernels only (OpenMP and MKL counts are per thread)
    _WORKER.active = True
    _WORKER.flush = denormals_flushed()
    ready.wait()


def _pool(size: int) -> ThreadPoolExecutor:
    with _POOL_LOCK:
        if _POOL["size"] != size:
            if _POOL["pool"] is not None:
                _POOL["pool"].shutdown(wait=False)
            threads = torch.get_num_threads()  # the caller's own count (and its set-up)
            ready = threading.Barrier(size + 1)
            pool = ThreadPoolExecutor(
                size,
                thread_name_prefix="capsctl-sites",
                initializer=_single_threaded,
                initargs=(ready,),
            )
            for _ in range(size):  # start every worker now (each waits in its initializer)
                pool.submit(int)
            ready.wait()
            # torch.set_num_threads(1) in a worker also set the count that threads started
            # later begin with: put the caller's back
            torch.set_num_threads(threads)
            _POOL.update(size=size, pool=pool)
        return _POOL["pool"]


def run_spans(part: Callable[[int, int, int], None], spans: list[tuple[int, int]]) -> None:
    """``part(i, start, stop)`` for each span ``i``: in the calling thread when there is one,
    else one span per worker thread (without autograd, in inference mode when the caller is),
    returning when all are done. ``part`` must write only to its own sites' slices and its
    own scratch buffers. Workers take the caller's flush-subnormals mode
    (:func:`capsctl.devices.flush_denormals`): it is per thread, and theirs outlive the caller's
    scopes."""
    if len(spans) == 1:
        part(0, *spans[0])
        return
    inference = torch.is_inference_mode_enabled()
    flush = denormals_flushed()

    def call(i: int, start: int, stop: int) -> None:
        if _WORKER.flush != flush:
            torch.set_flush_denormal(flush)
            _WORKER.flush = flush
        with torch.inference_mode() if inference else torch.no_grad():
            part(i, start, stop)

    pool = _pool(len(spans))
    # each worker runs in a copy of the caller's context: its dispatch.use() blocks hold there
    futures = [
        pool.submit(contextvars.copy_context().run, call, i, s0, s1)
        for i, (s0, s1) in enumerate(spans)
    ]
    wait(futures)
    for f in futures:
        f.result()  # re-raises a worker's exception
