"""``capsctl bench`` and ``capsctl compare``: speed, memory, size and accuracy side by side."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from capsctl.views.common import (
    fmt_bytes,
    fmt_int,
    fmt_pct,
    fmt_ratio,
    fmt_s,
    footnote,
    out,
    table,
)

__all__ = ["footer_line", "footer_lines", "print_bench", "print_compare"]


def print_bench(rows: Sequence[Any], batch_size: int, iters: int) -> None:
    import torch

    from capsctl.layers import native_summary

    ref = any(r.name == "resnet18" for r in rows)
    cols = ["model", "params", "T", "routing", "passes", "train step", "min", "infer img/s"]
    cols.append("peak mem")
    if ref:
        cols += ["train vs resnet18", "infer vs resnet18"]
    body = []
    for r in rows:
        mem = r.peak_device_bytes if r.peak_device_bytes is not None else r.peak_rss_bytes
        row = [
            r.name,
            fmt_int(r.params),
            r.iterations or "-",
            r.routing or "-",
            r.routing_backend or "-",
            fmt_s(r.train_step_s),
            fmt_s(r.train_step_min_s),
            "-" if r.infer_images_per_s is None else f"{r.infer_images_per_s:.1f}",
            fmt_bytes(mem),
        ]
        if ref:
            row += [fmt_ratio(r.train_ratio), fmt_ratio(r.infer_ratio)]
        body.append(row)
    first = rows[0]
    modes = [
        m
        for m, on in (
            ("bf16 autocast", first.amp),
            ("channels_last", first.channels_last),
            ("compiled", first.compiled),
        )
        if on
    ]
    title = (
        f"capsctl bench  device {first.device}  batch {batch_size}  {iters} timed steps  "
        f"{torch.get_num_threads()} threads  torch {torch.__version__}"
        + "".join(f"  {m}" for m in modes)
        + (f"  routing: {native_summary()}" if first.device == "cpu" else "")
    )
    out.print(table(title, cols, body, right=(1, 2, 5, 6, 7, 8, 9, 10)))
    footnote(
        "peak mem: resident memory of the whole process while the model ran (device memory on GPU)"
    )
    shared = [r.name for r in rows if r.shared()]
    if shared:
        footnote(
            f"shared machine: the load average passed the {rows[0].cpus} CPUs while "
            f"{', '.join(shared)} ran; their times are upper bounds"
        )
    footnote(
        "passes: what ran the routing's vote-sized passes (native: compiled CPU loops, triton: "
        "fused GPU kernels, chunked: torch code, dense: one expression; CAPSCTL_DEBUG says why)"
    )


def _times(r: float) -> str:
    return f"{r:.2f}x" if r < 2 else f"{r:.1f}x"


def _slower(r: float) -> str:
    return f"{_times(r)} slower" if r >= 1 else f"{_times(1 / r)} faster"


def footer_line(r: Any) -> str:
    """One sentence from a :class:`capsctl.compare.ReferenceRatios`."""
    if r.params_about_equal:
        parts = [f"about as many parameters as {r.reference}"]
    elif r.params < 1:
        parts = [f"{_times(1 / r.params)} fewer parameters than {r.reference}"]
    else:
        parts = [f"{_times(r.params)} the parameters of {r.reference}"]
    if r.gflops is not None:
        flops = f"{_times(r.gflops)} the FLOPs"
        if r.gflops_all_passes is not None:
            flops += f" ({_times(r.gflops_all_passes)} with every routing pass)"
        parts.append(flops)
    if r.train_step is not None:
        parts.append(f"training step {_slower(r.train_step)}")
    if r.inference is not None:
        parts.append(f"inference {_slower(r.inference)}")
    return f"{r.name}: {', '.join(parts)}"


def footer_lines(report: Any) -> list[str]:
    return [footer_line(r) for r in report.ratios]


def _compare_row(r: Any, speed: bool, measured: bool = False, scored: bool = True) -> list[Any]:
    row = [
        r.name,
        fmt_int(r.params["total"]),
        fmt_int(r.params["backbone"]),
        fmt_int(r.params["capsules"]),
        f"{r.gflops:.3f}",
        "-" if r.gflops_all_passes is None else f"{r.gflops_all_passes:.3f}",
        "-" if r.iterations is None else f"{r.iterations} {r.routing}",
    ]
    if speed:
        row += [
            fmt_s(r.train_step_s),
            "-" if r.infer_images_per_s is None else f"{r.infer_images_per_s:.1f}",
            fmt_bytes(r.peak_memory_bytes),
        ]
    if scored:
        row += [fmt_pct(r.accuracy)]
    if measured:
        m = r.measured
        if m is None or m.get("top1_mean") is None:
            row.append("-")
        else:
            std = m.get("top1_std")
            spread = f" ± {100 * std:.2f}" if std is not None else ""
            epochs = "" if m.get("epochs") is None else f", {m['epochs']:.1f} ep"
            mark = "†" if m.get("budget") == "matched" else ""
            row.append(f"{100 * m['top1_mean']:.2f}{spread} ({m['seeds']}){epochs}{mark}")
    return row + [fmt_pct(r.reference_accuracy)]


def print_compare(report: Any, speed: bool) -> None:
    cols = ["model", "params", "backbone", "capsules", "GFLOPs", "all passes", "T"]
    if speed:
        cols += ["train step", "infer img/s", "peak mem"]
    measured = any(r.measured for r in report.rows)
    # A checkpoint's accuracy: its column is left out where no row has one and a suite's
    # measured column is there instead (a column of "-" reads as "not measured").
    scored = not measured or any(r.accuracy is not None for r in report.rows)
    cols += [
        *(["accuracy"] if scored else []),
        *(["measured % (seeds), epochs"] if measured else []),
    ]
    cols += ["published"]
    body = [_compare_row(r, speed, measured, scored) for r in report.rows]
    out.print(table("capsctl compare", cols, body, right=tuple(range(1, len(cols)))))
    for line in footer_lines(report):
        out.print(line)
    footnote(report.flops_note)
    for r in report.rows:
        if r.reference_source:
            footnote(f"published ({r.name}): {r.reference_source}")
    sources = {
        (m["source"], m["test_set"], m.get("test_images"), m.get("metric") or "top-1")
        for m in _measured(report)
    }
    for src, test, n, metric in sorted(sources, key=str):
        images = f", {n:,} images" if n else ""
        footnote(f"measured: {src} ({metric} on {test}{images}; mean ± std over seeds)")
    for r in report.rows:
        if r.measured and r.measured.get("budget") == "matched":
            epochs = r.measured.get("epochs")
            trained = "" if epochs is None else f" ({epochs:.1f} epochs)"
            footnote(
                f"† {r.name}: trained under the other members' median wall time{trained}, "
                "not for the same epochs"
            )
    for src in sorted({r.accuracy_source for r in report.rows if r.accuracy_source}):
        footnote(f"accuracy source: {src}")


def _measured(report: Any) -> list[dict[str, Any]]:
    return [
        r.measured for r in report.rows if r.measured and r.measured.get("top1_mean") is not None
    ]
