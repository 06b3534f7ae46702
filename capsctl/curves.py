"""Training curves of runs: read ``metrics.jsonl``, draw loss/accuracy/lr, log to TensorBoard.

A run folder written by ``capsctl train`` holds ``metrics.jsonl``: one JSON object per finished
epoch with ``epoch``, ``train_loss``, ``train_accuracy``, ``lr``, ``epoch_seconds``,
``images_per_s``, ``best`` and, with a validation split, ``val_loss``, ``val_accuracy`` and
``val_top5`` (accuracies are fractions).

* :func:`read_history` reads that file (a last line cut short by a kill is skipped);
* :func:`plot_runs` draws one or several runs on shared axes into a PNG (or SVG/PDF) with
  matplotlib's Agg canvas (the ``plot`` extra; imported only here, never at import time);
* :func:`write_run_curves` writes ``curves.png`` into a run folder, or returns None when
  matplotlib is missing or the run has no finished epoch;
* :class:`TensorBoardLogger` writes the same scalars per epoch as TensorBoard event files
  (``torch.utils.tensorboard``; the ``tensorboard`` extra).

Nothing is printed: progress goes to an optional ``on_event`` callback as dicts.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capsctl.atomic import write_atomic
from capsctl.errors import CapsctlError, UsageError

__all__ = [
    "CURVES_FILE",
    "DEFAULT_METRICS",
    "METRICS_FILE",
    "SERIES",
    "TB_TAGS",
    "TensorBoardLogger",
    "known_metrics",
    "plot_runs",
    "read_history",
    "resolve_metrics",
    "write_run_curves",
]

EventFn = Callable[[dict], None] | None

#: The per-epoch metrics file of a run folder (the same name as ``capsctl.engine.METRICS``).
METRICS_FILE = "metrics.jsonl"
#: The picture :func:`write_run_curves` writes into a run folder.
CURVES_FILE = "curves.png"

PLOT_MISSING = "training curves need matplotlib: pip install 'capsctl[plot]'"
TENSORBOARD_MISSING = "TensorBoard logging needs tensorboard: pip install 'capsctl[tensorboard]'"


@dataclass(frozen=True)
class Series:
    """One curve: a ``metrics.jsonl`` key, the panel it is drawn in and its legend label."""

    key: str
    panel: str
    label: str
    style: str  # matplotlib line style
    default: bool  # drawn when the panel is chosen by its name (or by default)


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    percent: bool = False  # values are fractions, drawn as percent


#: Panels in drawing order.
PANELS: dict[str, Panel] = {
    "loss": Panel("Loss", "loss"),
    "accuracy": Panel("Accuracy", "accuracy (%)", percent=True),
    "lr": Panel("Learning rate", "learning rate"),
    "images_per_s": Panel("Training throughput", "images / s"),
    "epoch_seconds": Panel("Epoch time", "seconds"),
}

#: Every curve that can be drawn, by ``metrics.jsonl`` key.
SERIES: dict[str, Series] = {
    s.key: s
    for s in (
        Series("train_loss", "loss", "train", "--", True),
        Series("val_loss", "loss", "val", "-", True),
        Series("train_accuracy", "accuracy", "train", "--", True),
        Series("val_accuracy", "accuracy", "val", "-", True),
        Series("val_top5", "accuracy", "val top-5", ":", False),
        Series("lr", "lr", "lr", "-", True),
        Series("images_per_s", "images_per_s", "images/s", "-", True),
        Series("epoch_seconds", "epoch_seconds", "seconds", "-", True),
    )
}

#: What ``plot_runs`` draws without ``metrics``: three panels.
DEFAULT_METRICS = ("loss", "accuracy", "lr")

#: TensorBoard tag of each ``metrics.jsonl`` key (the first part groups charts in TensorBoard).
TB_TAGS: dict[str, str] = {
    "train_loss": "loss/train",
    "val_loss": "loss/val",
    "train_accuracy": "accuracy/train",
    "val_accuracy": "accuracy/val",
    "val_top5": "accuracy/val_top5",
    "lr": "lr",
    "images_per_s": "speed/images_per_s",
    "epoch_seconds": "speed/epoch_seconds",
}


def known_metrics() -> list[str]:
    """Names ``metrics`` accepts: panel names (``loss``, ``accuracy``) and every curve's key."""
    return ["loss", "accuracy", *SERIES]


def resolve_metrics(metrics: Sequence[str] | None = None) -> list[str]:
    """The curve keys to draw, in :data:`SERIES` order; UsageError on an unknown name.

    A panel name (``loss``, ``accuracy``) stands for its default curves (train and val);
    a curve key (``val_accuracy``, ``val_top5``, ``lr``...) for itself. Commas separate names
    too (``val_accuracy,lr``). None or empty: :data:`DEFAULT_METRICS`.
    """
    names = [n.strip() for m in (metrics or DEFAULT_METRICS) for n in str(m).split(",")]
    names = [n for n in names if n] or list(DEFAULT_METRICS)
    chosen: set[str] = set()
    for name in names:
        if name in SERIES:
            chosen.add(name)
        elif name in PANELS:
            chosen.update(s.key for s in SERIES.values() if s.panel == name and s.default)
        else:
            raise UsageError(f"unknown metric {name!r}; choose from {', '.join(known_metrics())}")
    return [key for key in SERIES if key in chosen]


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def metrics_path(run_dir: str | Path) -> Path:
    """``run_dir/metrics.jsonl``, or ``run_dir`` itself when it names a ``.jsonl`` file."""
    path = Path(run_dir)
    return path if path.suffix == ".jsonl" or path.is_file() else path / METRICS_FILE


def run_name(run_dir: str | Path) -> str:
    """The label of a run: its folder's name."""
    path = Path(run_dir)
    if path.suffix == ".jsonl" or path.is_file():
        path = path.parent
    return path.resolve().name or str(run_dir)


def read_history(run_dir: str | Path) -> list[dict[str, Any]]:
    """The epoch records of a run folder (or of a ``metrics.jsonl`` path), sorted by epoch.

    A last line that is not valid JSON (the write was cut short) is skipped; a bad line
    elsewhere raises :class:`CapsctlError` naming the file and line. If an epoch appears twice
    the later line wins. A missing folder is a :class:`UsageError`; a folder without
    ``metrics.jsonl`` a :class:`CapsctlError` that says to train it first.
    """
    path = metrics_path(run_dir)
    if not path.exists():
        folder = path.parent
        if not folder.exists():
            raise UsageError(
                f"{folder}: no such folder; pass a run folder written by capsctl train"
            )
        raise CapsctlError(
            f"{folder} has no {METRICS_FILE}; train it first (capsctl train --preset NAME "
            f"--out {folder}) or pass another run folder"
        )
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError as e:
        raise CapsctlError(f"cannot read {path}: {e.strerror or e}") from None
    lines = [(i + 1, line) for i, line in enumerate(text.splitlines()) if line.strip()]
    by_epoch: dict[int, dict[str, Any]] = {}
    for pos, (number, line) in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if pos == len(lines) - 1:
                break  # the last line was cut short by a kill
            raise CapsctlError(
                f"{path}: line {number} is not JSON ({e.msg}); the file is damaged"
            ) from None
        epoch = record.get("epoch") if isinstance(record, dict) else None
        if not isinstance(epoch, int) or isinstance(epoch, bool):
            raise CapsctlError(
                f"{path}: line {number} is not an epoch record (a JSON object with an integer "
                "'epoch'); is this a capsctl metrics file?"
            )
        by_epoch[epoch] = record
    return [by_epoch[e] for e in sorted(by_epoch)]


def _points(history: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(epochs, values) of one curve; records without a finite number for ``key`` are left out."""
    xs: list[int] = []
    ys: list[float] = []
    for record in history:
        value = record.get(key)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and math.isfinite(value):
            xs.append(int(record["epoch"]))
            ys.append(float(value))
    return xs, ys


# --------------------------------------------------------------------------------------------
# Drawing
# --------------------------------------------------------------------------------------------

_FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}
_SERIES_COLORS = {"train": "C0", "val": "C1", "val top-5": "C2"}


def _load_matplotlib() -> tuple[Any, Any, Any, Any]:
    """(Figure, FigureCanvasAgg, Line2D, MaxNLocator), or CapsctlError with the pip hint."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise CapsctlError(PLOT_MISSING) from None
    return Figure, FigureCanvasAgg, Line2D, MaxNLocator


def _labels(run_dirs: Sequence[str | Path]) -> list[str]:
    """Folder names; the paths as given where two runs share a folder name."""
    names = [run_name(r) for r in run_dirs]
    return [str(r) if names.count(n) > 1 else n for n, r in zip(names, run_dirs, strict=True)]


def plot_runs(
    run_dirs: Sequence[str | Path],
    out: str | Path,
    metrics: Sequence[str] | None = None,
    on_event: EventFn = None,
) -> Path:
    """Draw the curves of one or several runs on shared axes into ``out``; returns ``out``.

    One panel per chosen panel (see :func:`resolve_metrics`; default: loss, accuracy, lr),
    epochs on the x axis, accuracy in percent. One run: colours tell the curves apart and the
    run's name is the title. Several runs: one colour per run (labelled by folder name), line
    style per curve (train dashed, val solid, val top-5 dotted) and one legend for the figure.
    A curve no run has is left out; a chosen name no run has at all is a CapsctlError.
    ``out``: ``.png``, ``.svg`` or ``.pdf`` (its folder is created), written atomically.

    Events: ``{"event": "plot_run", "name", "path", "epochs"}`` per run read.
    """
    if isinstance(run_dirs, (str, Path)):
        run_dirs = [run_dirs]
    if not run_dirs:
        raise UsageError("nothing to plot; pass at least one run folder")
    out = Path(out)
    fmt = _FORMATS.get(out.suffix.lower())
    if fmt is None:
        raise UsageError(f"--out {out}: the picture must end in .png, .svg or .pdf")
    keys = resolve_metrics(metrics)
    Figure, FigureCanvasAgg, Line2D, MaxNLocator = _load_matplotlib()

    names = _labels(run_dirs)
    histories = []
    for name, run_dir in zip(names, run_dirs, strict=True):
        history = read_history(run_dir)
        if not history:
            raise CapsctlError(
                f"{metrics_path(run_dir)} holds no finished epoch yet; plot it after one epoch"
            )
        histories.append(history)
        if on_event is not None:
            on_event(
                {"event": "plot_run", "name": name, "path": str(run_dir), "epochs": len(history)}
            )

    present = [k for k in keys if any(_points(h, k)[0] for h in histories)]
    if not present:
        raise CapsctlError(
            f"no run records {', '.join(keys)}; runs without a validation split have no val_* "
            "metrics"
        )
    panels = [p for p in PANELS if any(SERIES[k].panel == p for k in present)]
    several = len(histories) > 1
    max_epochs = max(len(h) for h in histories)
    marker = "o" if max_epochs <= 25 else None

    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(
        figsize=(4.6 * ncols, 3.6 * nrows + (0.5 if several else 0.0)), layout="constrained"
    )
    FigureCanvasAgg(fig)
    styles_used: dict[str, str] = {}
    for index, panel_key in enumerate(panels):
        panel = PANELS[panel_key]
        ax = fig.add_subplot(nrows, ncols, index + 1)
        scale = 100.0 if panel.percent else 1.0
        here = [k for k in present if SERIES[k].panel == panel_key]
        drawn = 0
        for run_index, history in enumerate(histories):
            for key in here:
                series = SERIES[key]
                xs, ys = _points(history, key)
                if not xs:
                    continue
                color = f"C{run_index % 10}" if several else _SERIES_COLORS.get(series.label, "C0")
                ax.plot(
                    xs,
                    [scale * y for y in ys],
                    color=color,
                    linestyle=series.style if several else "-",
                    marker=marker,
                    markersize=3,
                    linewidth=1.5,
                    label=series.label,
                )
                if len(here) > 1:
                    styles_used.setdefault(series.label, series.style)  # a key to the styles
                drawn += 1
        alone = len(here) == 1 and sum(s.panel == panel_key for s in SERIES.values()) > 1
        ax.set_title(f"{panel.title} ({SERIES[here[0]].label})" if alone else panel.title)
        ax.set_xlabel("epoch")
        ax.set_ylabel(panel.ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        if panel_key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        if not several and drawn > 1:
            ax.legend(fontsize="small")
    if several:
        handles = [
            Line2D([], [], color=f"C{i % 10}", linewidth=2, label=name)
            for i, name in enumerate(names)
        ]
        if styles_used:
            handles += [
                Line2D([], [], color="0.35", linestyle=style, label=label)
                for label, style in styles_used.items()
            ]
        fig.legend(
            handles=handles, loc="outside lower center", ncol=min(len(handles), 6), fontsize="small"
        )
        fig.suptitle(" vs ".join(names) if len(names) <= 3 else f"{len(names)} runs")
    else:
        fig.suptitle(names[0])

    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=100)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CapsctlError(f"cannot create the folder {out.parent}: {e.strerror or e}") from None
    write_atomic(out, buf.getvalue())
    return out


def write_run_curves(run_dir: str | Path) -> Path | None:
    """Write ``curves.png`` (default panels) into ``run_dir``; returns its path.

    None, and nothing written, when matplotlib is missing or the run has no finished epoch
    (no ``metrics.jsonl`` or an empty one). Other problems (a damaged metrics file, a folder
    that cannot be written) raise :class:`CapsctlError`.
    """
    try:
        _load_matplotlib()
    except CapsctlError:
        return None
    path = metrics_path(run_dir)
    if not path.exists() or not read_history(run_dir):
        return None
    return plot_runs([run_dir], Path(run_dir) / CURVES_FILE)


# --------------------------------------------------------------------------------------------
# TensorBoard
# --------------------------------------------------------------------------------------------


class TensorBoardLogger:
    """Per-epoch scalars as TensorBoard event files in ``run_dir`` (``tensorboard --logdir``).

    The event files go straight into the run folder, so ``tensorboard --logdir runs`` shows
    each run folder as one run. :meth:`log_epoch` takes a ``metrics.jsonl`` record and writes
    every number it knows (:data:`TB_TAGS`, accuracies as fractions) at step = epoch, then
    flushes. ``resume_epoch``: the epochs already done; events an earlier process wrote for
    later epochs (or, with 0, for any epoch, as after ``--overwrite``) are hidden by
    TensorBoard (a purge marker at step ``resume_epoch + 1``). Needs the ``tensorboard``
    package (CapsctlError with the pip hint otherwise).
    """

    def __init__(self, run_dir: str | Path, *, resume_epoch: int = 0) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise CapsctlError(TENSORBOARD_MISSING) from None
        self.run_dir = Path(run_dir)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CapsctlError(
                f"cannot create the folder {self.run_dir}: {e.strerror or e}"
            ) from None
        self._writer: Any = SummaryWriter(
            log_dir=str(self.run_dir), purge_step=int(resume_epoch) + 1
        )

    def log_epoch(self, record: dict[str, Any]) -> None:
        """Write the numbers of one epoch record (keys of :data:`TB_TAGS`; others ignored)."""
        if self._writer is None:
            raise CapsctlError(f"the TensorBoard log of {self.run_dir} is already closed")
        step = int(record["epoch"])
        for key, tag in TB_TAGS.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(tag, float(value), step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (a second call does nothing)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> TensorBoardLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
