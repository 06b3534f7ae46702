"""Benchmark results: :class:`BenchRow`, ratios to ResNet-18, JSON and timm-style CSV."""

from __future__ import annotations

import csv
import dataclasses
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BENCH_CSV_COLUMNS",
    "REFERENCE_MODEL",
    "BenchRow",
    "add_ratios",
    "rows_to_csv",
    "rows_to_json",
]

#: Name of the model the ratio columns are relative to.
REFERENCE_MODEL = "resnet18"


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
    amp: bool = False  # forward passes under bf16 autocast
    channels_last: bool = False  # model and inputs in channels_last memory format
    compiled: bool = False  # timed torch.compile(model)
    # the implementations the vote-sized passes ran (capsctl/layers/backend/dispatch.py:
    # "native", "triton", "chunked", "dense", joined by "+" when several); None: no routing
    routing_backend: str | None = None
    # the machine's 1-minute load average as the model's measurement ended, and its CPUs: a
    # load above the CPUs means other work shared the machine (None: no load average here)
    load_1m: float | None = None
    cpus: int | None = None

    def shared(self) -> bool:
        """Whether other work shared the machine while this model was measured."""
        return self.load_1m is not None and self.cpus is not None and self.load_1m > self.cpus

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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


def rows_to_json(rows: Sequence[BenchRow], meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A JSON-serializable report: run metadata plus ``rows`` (each :meth:`BenchRow.to_dict`).

    ``device`` and ``batch_size`` come from ``meta`` or else from the first row; ``torch``,
    ``threads`` and ``routing_kernels`` (what ran the routed passes on a CPU:
    capsctl/layers/native.py) describe this process. Other ``meta`` keys (e.g. ``iters``) are
    kept.
    """
    import torch

    from capsctl.layers import native_summary

    meta = dict(meta or {})
    first = rows[0] if rows else None
    out: dict[str, Any] = {
        "device": meta.pop("device", first.device if first else None),
        "batch_size": meta.pop("batch_size", first.batch_size if first else None),
        "torch": meta.pop("torch", torch.__version__),
        "threads": meta.pop("threads", torch.get_num_threads()),
        "routing_kernels": meta.pop("routing_kernels", native_summary()),
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
    "routing_backend",
    "load_1m",
    "cpus",
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
        "routing_backend": row.routing_backend,
        "load_1m": row.load_1m,
        "cpus": row.cpus,
    }


def rows_to_csv(rows: Sequence[BenchRow]) -> str:
    """A header line (:data:`BENCH_CSV_COLUMNS`) and one line per row; empty cells for None.

    timm's names and units: ``*_samples_per_sec`` images per second, ``*_step_time`` the
    median step in milliseconds (inference: ``batch_size`` / ``infer_samples_per_sec``),
    ``*_batch_size``/``*_img_size`` empty for a phase that was not measured, ``param_count``
    in millions (2 decimals). Then capsctl's: exact ``params``, the fastest training step
    (``train_step_time_min``, ms), ratios to resnet18, peak memory in bytes and the backend
    the routing's passes ran (``routing_backend``), and the machine's load as the model's
    measurement ended (``load_1m``, ``cpus``).
    """
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(BENCH_CSV_COLUMNS)
    for row in rows:
        cells = _csv_row(row)
        writer.writerow(["" if cells[c] is None else cells[c] for c in BENCH_CSV_COLUMNS])
    return buf.getvalue()
