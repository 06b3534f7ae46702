"""Pictures of a suite report: accuracy against parameters and against GFLOPs, with error bars
(the standard deviation over seeds). Needs matplotlib (``capsctl[plot]``), imported only when a
picture is drawn; no global matplotlib state is touched. Files are checked before anything is
drawn (an existing one needs ``overwrite``) and written atomically."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capsctl.atomic import check_output, write_atomic
from capsctl.errors import CapsctlError, UsageError

__all__ = ["AXES", "Point", "check_plot_files", "plot_files", "points", "suite_plot"]

#: (report key, axis label) of each picture; both axes are logarithmic.
AXES = (("params", "parameters"), ("gflops", "GFLOPs per image"))


@dataclass(frozen=True)
class Point:
    label: str  # the member, and how its budget differed where it did
    x: float
    top1: float  # mean over seeds, in %
    std: float  # over seeds, in % (0 with one seed)


def plot_files(suite: str, folder: str | Path) -> list[Path]:
    """The pictures :func:`suite_plot` writes for the suite named ``suite``."""
    return [Path(folder) / f"{suite}-accuracy-vs-{key}.png" for key, _ in AXES]


def check_plot_files(suite: str, folder: str | Path, *, overwrite: bool = False) -> list[Path]:
    """:func:`plot_files`, refused (:class:`UsageError`) when ``folder`` is not a folder or a
    picture exists and not ``overwrite``: call it before the work whose result is drawn."""
    if Path(folder).exists() and not Path(folder).is_dir():
        raise UsageError(f"--png {folder}: not a folder; give a folder for the pictures")
    files = plot_files(suite, folder)
    for path in files:
        check_output(path, overwrite=overwrite)
    return files


def points(doc: dict[str, Any], key: str) -> list[Point]:
    """The measured members of a report (``SuiteReport.to_dict()``) on the first test file,
    against ``key``; a member trained under a matched wall time says so with its epochs."""
    test = doc["tests"][0]
    found = []
    for r in doc["rows"]:
        t = r["tests"][test]
        if t["top1_mean"] is None or r[key] is None:
            continue
        label = r["member"]
        if r.get("budget") == "matched" and r.get("epochs") is not None:
            label += f" ({r['epochs']:.1f} epochs, matched time)"
        found.append(Point(label, r[key], 100 * t["top1_mean"], 100 * (t["top1_std"] or 0.0)))
    return found


def _draw(doc: dict[str, Any], key: str, axis: str) -> bytes:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise CapsctlError(f"--png needs matplotlib ({e}); pip install 'capsctl[plot]'") from None
    fig = Figure(figsize=(6, 4.2), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    found = points(doc, key)
    for p in found:
        ax.errorbar(p.x, p.top1, yerr=p.std, fmt="o", capsize=4)
        ax.annotate(p.label, (p.x, p.top1), textcoords="offset points", xytext=(6, -3), fontsize=8)
    ax.set_xscale("log")
    if found:  # room on the right for the labels (about a decade on a log axis)
        xs = [p.x for p in found]
        ax.set_xlim(min(xs) / 1.6, max(xs) * (12 if max(xs) / min(xs) > 3 else 6))
    ax.set_xlabel(axis)
    ax.set_ylabel(f"top-1 % ({doc['tests'][0]})")
    ax.set_title(f"suite {doc['suite']}: mean ± std over seeds")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def suite_plot(doc: dict[str, Any], folder: str | Path, *, overwrite: bool = False) -> list[str]:
    """Accuracy against parameters and against GFLOPs, with error bars (std over seeds), one
    PNG each in ``folder`` (created if missing); returns the files written."""
    files = check_plot_files(doc["suite"], folder, overwrite=overwrite)
    Path(folder).mkdir(parents=True, exist_ok=True)
    for path, (key, axis) in zip(files, AXES, strict=True):
        write_atomic(path, _draw(doc, key, axis), overwrite=overwrite)
    return [str(p) for p in files]
