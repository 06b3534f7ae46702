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
from capsctl.outputs import PNG

__all__ = [
    "AXES",
    "Point",
    "check_plot_files",
    "label_offsets",
    "plot_files",
    "points",
    "spread",
    "suite_plot",
]

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
        check_output(path, kind=PNG, overwrite=overwrite)
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


def spread(targets: list[float], gap: float) -> list[float]:
    """Positions as close as possible (least squares) to ``targets`` that keep their order and
    are at least ``gap`` apart: with ``u_i = p_i - i * gap`` over the sorted targets the
    constraint is ``u`` non-decreasing, solved by pooling adjacent violators."""
    order = sorted(range(len(targets)), key=lambda i: targets[i])
    blocks: list[list[float]] = []  # [mean of u, count]
    for rank, i in enumerate(order):
        blocks.append([targets[i] - rank * gap, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    placed = [m for m, n in blocks for _ in range(int(n))]
    out = [0.0] * len(targets)
    for rank, i in enumerate(order):
        out[i] = placed[rank] + rank * gap
    return out


def label_offsets(xy: list[tuple[float, float]], widths: list[float], gap: float) -> list[float]:
    """Vertical offsets (display units) that keep the labels at the points ``xy`` (display
    units, each label starting just right of its point and ``widths`` wide) at least ``gap``
    apart wherever one label reaches over the other's point horizontally."""
    group = list(range(len(xy)))  # union-find over points whose labels could touch

    def root(i: int) -> int:
        while group[i] != i:
            i = group[i]
        return i

    for i in range(len(xy)):
        for j in range(i):
            left = i if xy[i][0] <= xy[j][0] else j
            if abs(xy[i][0] - xy[j][0]) < widths[left]:
                group[root(i)] = root(j)
    offsets = [0.0] * len(xy)
    for r in {root(i) for i in range(len(xy))}:
        members = [i for i in range(len(xy)) if root(i) == r]
        moved = spread([xy[i][1] for i in members], gap)
        for i, y in zip(members, moved, strict=True):
            offsets[i] = y - xy[i][1]
    return offsets


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
    ax.set_xscale("log")
    if found:  # room on the right for the labels (about a decade on a log axis)
        xs = [p.x for p in found]
        ax.set_xlim(min(xs) / 1.6, max(xs) * (12 if max(xs) / min(xs) > 3 else 6))
    ax.set_xlabel(axis)
    ax.set_ylabel(f"top-1 % ({doc['tests'][0]})")
    ax.set_title(f"suite {doc['suite']}: mean ± std over seeds")
    ax.grid(alpha=0.3)
    fig.tight_layout()  # before the labels are placed: it moves the axes
    # In points (72 an inch): labels 8 pt high, at least 10 pt apart where one would reach over
    # another (a character of an 8 pt font is at most about 5 pt wide, plus the 8 pt offset).
    pt = fig.dpi / 72
    xy = [tuple(ax.transData.transform((p.x, p.top1))) for p in found]
    widths = [8.0 + 5.0 * len(p.label) for p in found]
    dys = label_offsets([(x / pt, y / pt) for x, y in xy], widths, gap=10.0)
    for p, dy in zip(found, dys, strict=True):
        line = {"arrowstyle": "-", "lw": 0.5, "color": "0.5"} if abs(dy) > 4 else None
        ax.annotate(p.label, (p.x, p.top1), textcoords="offset points", xytext=(8, dy - 3),
                    fontsize=8, arrowprops=line)  # fmt: skip
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
