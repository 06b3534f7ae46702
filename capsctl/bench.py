"""Speed and memory benchmark of registered models, measured one after another in one process.

:func:`run_bench` builds each model, times training steps (forward, cross-entropy, backward,
SGD step) and inference passes (eval mode under :func:`torch.inference_mode`) on synthetic,
seeded inputs, and records the peak memory while the model was measured. It returns one
:class:`BenchRow` per model; speed ratios are relative to ``resnet18`` when it is among the
models. Nothing is printed: progress goes to an optional ``on_event`` callback as dicts.

Memory. ``peak_rss_bytes`` is the peak resident set size of the *whole process* while a model
was measured: from just before it was built until its last timed step. A background thread
(:class:`RssSampler`) reads ``/proc/self/statm`` every ~2 ms. Before each model the previous
one is dropped, ``gc.collect()`` runs and, on glibc, ``malloc_trim(0)`` returns freed heap pages
to the OS, so memory an earlier model freed does not count. Without ``/proc`` (macOS, BSD) the
value comes from ``resource.getrusage(RUSAGE_SELF).ru_maxrss``, which is the peak over the
process's *lifetime*, so later models also show earlier models' peaks. ``peak_device_bytes``
is ``torch.cuda.max_memory_allocated`` (tensors only, not the CUDA context) on cuda, else None.
"""

from __future__ import annotations

import csv
import ctypes
import dataclasses
import gc
import io
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from capsctl.devices import resolve_device
from capsctl.errors import UsageError
from capsctl.models import parameter_counts
from capsctl.models.spec import ModelConfig
from capsctl.registry import build_model, resolve_config

__all__ = [
    "REFERENCE_MODEL",
    "ROUTING_MODES",
    "BENCH_CSV_COLUMNS",
    "BenchRow",
    "RssSampler",
    "add_ratios",
    "current_rss_bytes",
    "rows_to_csv",
    "rows_to_json",
    "run_bench",
]

#: Name of the model the ratio columns are relative to.
REFERENCE_MODEL = "resnet18"
ROUTING_MODES = ("concurrent", "sequential")

EventFn = Callable[[dict], None]
ModelSpec = str | ModelConfig | Mapping[str, Any] | tuple[str, ModelConfig]


@dataclass
class BenchRow:
    """One model's measurements. Times are seconds; ``None`` means "not measured / n.a."."""

    name: str
    arch: str
    params: int
    batch_size: int
    device: str
    iterations: int | None  # routing iterations T; None for non-capsule models
    routing: str | None  # "concurrent" | "sequential"; None for non-capsule models
    train_step_s: float | None  # median timed training step
    train_step_min_s: float | None
    infer_images_per_s: float | None  # batch_size / median inference time
    peak_rss_bytes: int | None  # peak resident memory of the whole process during this model
    peak_device_bytes: int | None  # torch.cuda.max_memory_allocated on cuda, else None
    train_ratio: float | None = None  # train_step_s / resnet18's (same run)
    infer_ratio: float | None = None  # resnet18's images/s / this model's images/s
    input_size: int | None = None  # side of the square input images

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# Resident memory
# --------------------------------------------------------------------------------------------

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


_LIBC: Any = None


def release_memory() -> None:
    """``gc.collect()``, then (glibc, best effort) ``malloc_trim(0)`` to return freed pages."""
    global _LIBC
    gc.collect()
    if not sys.platform.startswith("linux"):
        return
    try:
        if _LIBC is None:
            _LIBC = ctypes.CDLL("libc.so.6")
        _LIBC.malloc_trim(0)
    except (OSError, AttributeError):  # musl or no libc.so.6
        _LIBC = False


# --------------------------------------------------------------------------------------------
# Devices, specs
# --------------------------------------------------------------------------------------------


def _label_and_config(spec: ModelSpec) -> tuple[str, ModelConfig]:
    if isinstance(spec, tuple):
        label, cfg = spec
        return str(label), resolve_config(cfg)
    if isinstance(spec, str):
        return spec, resolve_config(spec)
    cfg = resolve_config(spec)
    base = spec.get("base") if isinstance(spec, Mapping) else None
    return (f"{base} (custom)" if base else f"custom-{cfg.arch}"), cfg


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()


def _fork_devices(dev: torch.device) -> list[int]:
    if dev.type != "cuda":
        return []
    return [dev.index if dev.index is not None else torch.cuda.current_device()]


# --------------------------------------------------------------------------------------------
# Benchmark
# --------------------------------------------------------------------------------------------


def add_ratios(rows: Sequence[BenchRow], reference: BenchRow | None = None) -> None:
    """Fill ``train_ratio``/``infer_ratio`` in place, relative to ``reference``.

    ``reference`` defaults to the first row named ``resnet18``; without one the ratios are None.
    ``train_ratio`` = train step time / reference's; ``infer_ratio`` = reference's images/s /
    this row's images/s (both "times slower than the reference").
    """
    if reference is None:
        reference = next((r for r in rows if r.name == REFERENCE_MODEL), None)
    for row in rows:
        row.train_ratio = row.infer_ratio = None
        if reference is None:
            continue
        if row.train_step_s is not None and reference.train_step_s:
            row.train_ratio = row.train_step_s / reference.train_step_s
        if row.infer_images_per_s and reference.infer_images_per_s:
            row.infer_ratio = reference.infer_images_per_s / row.infer_images_per_s


def _emit(on_event: EventFn | None, **event: Any) -> None:
    if on_event is not None:
        on_event(event)


def _time_steps(
    step: Callable[[], None],
    dev: torch.device,
    *,
    name: str,
    phase: str,
    warmup: int,
    iters: int,
    on_event: EventFn | None,
) -> list[float]:
    times: list[float] = []
    total = warmup + iters
    for i in range(total):
        _sync(dev)
        t0 = time.perf_counter()
        step()
        _sync(dev)
        elapsed = time.perf_counter() - t0
        if i >= warmup:
            times.append(elapsed)
        _emit(
            on_event,
            event="bench_step",
            name=name,
            phase=phase,
            step=i + 1,
            total=total,
            warmup=i < warmup,
        )
    return times


def _measure(
    label: str,
    cfg: ModelConfig,
    dev: torch.device,
    *,
    batch_size: int,
    iters: int,
    warmup: int,
    train: bool,
    infer: bool,
    iterations: int | None,
    routing: str | None,
    seed: int,
    on_event: EventFn | None,
) -> BenchRow:
    """Build and measure one model. Memory tracking is the caller's job."""
    with torch.random.fork_rng(devices=_fork_devices(dev)):
        torch.manual_seed(seed)
        model: nn.Module = build_model(cfg)
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(batch_size, cfg.in_channels, cfg.input_size, cfg.input_size, generator=gen)
        y = torch.randint(0, cfg.num_classes, (batch_size,), generator=gen)
        model.to(dev)
        x, y = x.to(dev), y.to(dev)

        caps_iterations: int | None = None
        caps_routing: str | None = None
        set_routing = getattr(model, "set_routing", None)
        if callable(set_routing):
            if iterations is not None or routing is not None:
                set_routing(iterations, routing)
            caps_iterations = int(model.iterations)
            caps_routing = str(model.routing)

        train_s: list[float] = []
        if train:
            model.train()
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

            def train_step() -> None:
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()

            train_s = _time_steps(
                train_step,
                dev,
                name=label,
                phase="train",
                warmup=warmup,
                iters=iters,
                on_event=on_event,
            )
            opt.zero_grad(set_to_none=True)
            del opt

        infer_s: list[float] = []
        if infer:
            model.eval()

            def infer_step() -> None:
                with torch.inference_mode():
                    model(x)

            infer_s = _time_steps(
                infer_step,
                dev,
                name=label,
                phase="infer",
                warmup=warmup,
                iters=iters,
                on_event=on_event,
            )

    infer_median = statistics.median(infer_s) if infer_s else None
    return BenchRow(
        name=label,
        arch=cfg.arch,
        params=int(parameter_counts(model)["total"]),
        batch_size=batch_size,
        device=str(dev),
        iterations=caps_iterations,
        routing=caps_routing,
        train_step_s=statistics.median(train_s) if train_s else None,
        train_step_min_s=min(train_s) if train_s else None,
        infer_images_per_s=(batch_size / infer_median) if infer_median else None,
        peak_rss_bytes=None,
        peak_device_bytes=None,
        input_size=cfg.input_size,
    )


def run_bench(
    models: Sequence[ModelSpec],
    *,
    batch_size: int = 32,
    iters: int = 5,
    warmup: int = 1,
    train: bool = True,
    infer: bool = True,
    device: str = "cpu",
    iterations: int | None = None,
    routing: str | None = None,
    threads: int | None = None,
    seed: int = 0,
    on_event: EventFn | None = None,
) -> list[BenchRow]:
    """Measure ``models`` one after another in this process and return one row per model.

    ``models``: registered names, :class:`ModelConfig` objects, config mappings (``base: <name>``
    allowed) or ``(label, config)`` pairs. All are resolved before anything is measured, so an
    unknown name raises the registry's ConfigError up front. ``iters`` timed steps follow
    ``warmup`` untimed ones, for training (SGD lr 0.01, momentum 0.9, cross-entropy) and for
    inference; ``train=False`` / ``infer=False`` skip a phase (its columns are None).
    ``iterations``/``routing`` override the routing of capsule models (via ``set_routing``) and
    are ignored for the others. ``device``: cpu, cuda[:N], mps or auto. ``threads`` calls
    ``torch.set_num_threads`` (process-wide, left in place). ``seed`` fixes weights, inputs and
    labels (the global RNG state is restored afterwards).

    Events: ``{"event": "bench_model", "name", "index", "total"}`` before each model (index is
    0-based) and ``{"event": "bench_step", "name", "phase", "step", "total", "warmup"}`` after
    every step (warm-up steps included, ``step`` counts from 1 to warmup + iters).
    """
    if iters < 1:
        raise UsageError(f"--iters must be >= 1, got {iters}")
    if warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {warmup}")
    if batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {batch_size}")
    if iterations is not None and iterations < 1:
        raise UsageError(f"--iterations must be >= 1, got {iterations}")
    if routing is not None and routing not in ROUTING_MODES:
        raise UsageError(f"unknown routing {routing!r}; use {' or '.join(ROUTING_MODES)}")
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    dev = resolve_device(device)
    specs = [_label_and_config(m) for m in models]
    if threads is not None:
        torch.set_num_threads(threads)

    rows: list[BenchRow] = []
    for index, (label, cfg) in enumerate(specs):
        _emit(on_event, event="bench_model", name=label, index=index, total=len(specs))
        release_memory()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        with RssSampler() as sampler:
            row = _measure(
                label,
                cfg,
                dev,
                batch_size=batch_size,
                iters=iters,
                warmup=warmup,
                train=train,
                infer=infer,
                iterations=iterations,
                routing=routing,
                seed=seed,
                on_event=on_event,
            )
        row.peak_rss_bytes = sampler.peak_bytes
        if dev.type == "cuda":
            row.peak_device_bytes = int(torch.cuda.max_memory_allocated(dev))
        rows.append(row)
    release_memory()
    add_ratios(rows)
    return rows


def rows_to_json(rows: Sequence[BenchRow], meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A JSON-serializable report: run metadata plus ``rows`` (each :meth:`BenchRow.to_dict`).

    ``device`` and ``batch_size`` come from ``meta`` or else from the first row; ``torch`` and
    ``threads`` describe this process. Other ``meta`` keys (e.g. ``iters``) are kept.
    """
    meta = dict(meta or {})
    first = rows[0] if rows else None
    out: dict[str, Any] = {
        "device": meta.pop("device", first.device if first else None),
        "batch_size": meta.pop("batch_size", first.batch_size if first else None),
        "torch": meta.pop("torch", torch.__version__),
        "threads": meta.pop("threads", torch.get_num_threads()),
    }
    out.update(meta)
    out["rows"] = [r.to_dict() for r in rows]
    return out


#: ``capsctl bench --csv`` columns: timm's benchmark results (``model`` ... ``param_count``:
#: samples/s, step times in milliseconds, parameters in millions), then capsctl's own.
BENCH_CSV_COLUMNS = (
    "model",
    "infer_samples_per_sec",
    "infer_step_time",
    "infer_batch_size",
    "infer_img_size",
    "train_samples_per_sec",
    "train_step_time",
    "train_batch_size",
    "train_img_size",
    "param_count",
    "arch",
    "device",
    "iterations",
    "routing",
    "train_step_time_min",
    "train_ratio",
    "infer_ratio",
    "peak_rss_bytes",
    "peak_device_bytes",
    "params",
)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 3)


def _csv_row(row: BenchRow) -> dict[str, Any]:
    train = row.train_step_s is not None
    infer = row.infer_images_per_s is not None
    ips = row.infer_images_per_s
    return {
        "model": row.name,
        "infer_samples_per_sec": round(ips, 2) if ips else None,
        "infer_step_time": _ms(row.batch_size / ips) if ips else None,
        "infer_batch_size": row.batch_size if infer else None,
        "infer_img_size": row.input_size if infer else None,
        "train_samples_per_sec": (
            round(row.batch_size / row.train_step_s, 2) if row.train_step_s else None
        ),
        "train_step_time": _ms(row.train_step_s),
        "train_batch_size": row.batch_size if train else None,
        "train_img_size": row.input_size if train else None,
        "param_count": round(row.params / 1e6, 2),
        "arch": row.arch,
        "device": row.device,
        "iterations": row.iterations,
        "routing": row.routing,
        "train_step_time_min": _ms(row.train_step_min_s),
        "train_ratio": None if row.train_ratio is None else round(row.train_ratio, 4),
        "infer_ratio": None if row.infer_ratio is None else round(row.infer_ratio, 4),
        "peak_rss_bytes": row.peak_rss_bytes,
        "peak_device_bytes": row.peak_device_bytes,
        "params": row.params,
    }


def rows_to_csv(rows: Sequence[BenchRow]) -> str:
    """A header line (:data:`BENCH_CSV_COLUMNS`) and one line per row; empty cells for None.

    timm's names and units: ``*_samples_per_sec`` images per second, ``*_step_time`` the
    median step in milliseconds (inference: ``batch_size`` / ``infer_samples_per_sec``),
    ``*_batch_size``/``*_img_size`` empty for a phase that was not measured, ``param_count``
    in millions (2 decimals). Then capsctl's: exact ``params``, the fastest training step
    (``train_step_time_min``, ms), ratios to resnet18 and peak memory in bytes.
    """
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(BENCH_CSV_COLUMNS)
    for row in rows:
        cells = _csv_row(row)
        writer.writerow(["" if cells[c] is None else cells[c] for c in BENCH_CSV_COLUMNS])
    return buf.getvalue()
