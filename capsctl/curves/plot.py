"""Drawing training curves of one or several runs with matplotlib's Agg canvas.

matplotlib (the ``plot`` extra) is imported only when a picture is drawn, never at import
time. One panel per kind of curve (loss, accuracy, learning rate, ...), epochs on the x axis.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from capsctl.atomic import check_output, write_atomic
from capsctl.curves.history import curve_points, metrics_path, read_history, run_name
from capsctl.errors import CapsctlError, UsageError
from capsctl.events import EventFn, emit
from capsctl.outputs import PDF, PNG, RUN_CURVES, SVG, OutputKind

__all__ = [
    "CURVES_FILE",
    "DEFAULT_METRICS",
    "PANELS",
    "PLOT_MISSING",
    "SERIES",
    "Panel",
    "Series",
    "known_metrics",
    "plot_runs",
    "resolve_metrics",
    "write_run_curves",
]

#: The picture :func:`write_run_curves` writes into a run folder.
CURVES_FILE = "curves.png"

PLOT_MISSING = "training curves need matplotlib: pip install 'capsctl[plot]'"


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
    "grad_norm": Panel("Gradient norm (before clipping)", "L2 norm"),
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
        Series("grad_norm_mean", "grad_norm", "mean", "-", True),
        Series("grad_norm_max", "grad_norm", "max", "--", True),
    )
}

#: What ``plot_runs`` draws without ``metrics``: three panels.
DEFAULT_METRICS = ("loss", "accuracy", "lr")

_FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}
_KINDS = {"png": PNG, "svg": SVG, "pdf": PDF}
_SERIES_COLORS = {"train": "C0", "val": "C1", "val top-5": "C2"}


def known_metrics() -> list[str]:
    """Names ``metrics`` accepts: the names of panels of several curves (``loss``,
    ``accuracy``, ``grad_norm``) and every curve's key."""
    return [*(p for p in PANELS if p not in SERIES), *SERIES]


def resolve_metrics(metrics: Sequence[str] | None = None) -> list[str]:
    """The curve keys to draw, in :data:`SERIES` order; UsageError on an unknown name.

    A panel name (``loss``, ``accuracy``, ``grad_norm``) stands for its default curves;
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


class _Matplotlib(NamedTuple):
    Figure: Any
    FigureCanvasAgg: Any
    Line2D: Any
    MaxNLocator: Any


def _load_matplotlib() -> _Matplotlib:
    """The matplotlib classes drawing needs, or CapsctlError with the pip hint."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise CapsctlError(PLOT_MISSING) from None
    return _Matplotlib(Figure, FigureCanvasAgg, Line2D, MaxNLocator)


def _labels(run_dirs: Sequence[str | Path]) -> list[str]:
    """Folder names; the paths as given where two runs share a folder name."""
    names = [run_name(r) for r in run_dirs]
    return [str(r) if names.count(n) > 1 else n for n, r in zip(names, run_dirs, strict=True)]


def plot_runs(
    run_dirs: Sequence[str | Path],
    out: str | Path | None = None,
    metrics: Sequence[str] | None = None,
    on_event: EventFn = None,
    *,
    overwrite: bool = False,
) -> Path:
    """Draw the curves of one or several runs on shared axes into ``out``; returns ``out``.

    Default ``out``: ``curves.png`` in the current folder (a run folder belongs to its run:
    :func:`write_run_curves` draws its own). ``out`` is checked before anything is drawn
    (:func:`capsctl.atomic.check_output`): an existing file is replaced only with ``overwrite``
    and only when it is a picture of the same format, and never a run's metrics file nor a path
    in a run or suite folder (:class:`UsageError`).

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
    out = Path(CURVES_FILE if out is None else out)
    return _plot(run_dirs, out, metrics, on_event, overwrite, None)


def _plot(
    run_dirs: Sequence[str | Path],
    out: Path,
    metrics: Sequence[str] | None,
    on_event: EventFn,
    overwrite: bool,
    kind: OutputKind | None,
) -> Path:
    """:func:`plot_runs` into ``out``, an output of ``kind`` (default: by its suffix)."""
    fmt = _FORMATS.get(out.suffix.lower())
    if fmt is None:
        raise UsageError(f"--out {out}: the picture must end in .png, .svg or .pdf")
    inputs = [metrics_path(r) for r in run_dirs]
    check_output(out, kind=kind or _KINDS[fmt], inputs=inputs, overwrite=overwrite)
    keys = resolve_metrics(metrics)
    mpl = _load_matplotlib()
    names = _labels(run_dirs)
    histories = _read_runs(run_dirs, names, on_event)
    present = [k for k in keys if any(curve_points(h, k)[0] for h in histories)]
    if not present:
        raise CapsctlError(
            f"no run records {', '.join(keys)}; runs without a validation split have no val_* "
            "metrics"
        )
    fig = _draw(mpl, names, histories, present)
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=100)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CapsctlError(f"cannot create the folder {out.parent}: {e.strerror or e}") from None
    write_atomic(out, buf.getvalue(), overwrite=overwrite)
    return out


def _read_runs(
    run_dirs: Sequence[str | Path], names: Sequence[str], on_event: EventFn
) -> list[list[dict[str, Any]]]:
    """The history of every run; CapsctlError for a run without a finished epoch."""
    histories = []
    for name, run_dir in zip(names, run_dirs, strict=True):
        history = read_history(run_dir)
        if not history:
            raise CapsctlError(
                f"{metrics_path(run_dir)} holds no finished epoch yet; plot it after one epoch"
            )
        histories.append(history)
        emit(on_event, "plot_run", name=name, path=str(run_dir), epochs=len(history))
    return histories


def _draw(
    mpl: _Matplotlib,
    names: Sequence[str],
    histories: Sequence[Sequence[dict[str, Any]]],
    present: Sequence[str],
) -> Any:
    """The figure: one panel per panel of the ``present`` curve keys, titles and legends."""
    panels = [p for p in PANELS if any(SERIES[k].panel == p for k in present)]
    several = len(histories) > 1
    marker = "o" if max(len(h) for h in histories) <= 25 else None
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = mpl.Figure(
        figsize=(4.6 * ncols, 3.6 * nrows + (0.5 if several else 0.0)), layout="constrained"
    )
    mpl.FigureCanvasAgg(fig)
    styles_used: dict[str, str] = {}  # label -> line style, a key to the styles
    for index, panel_key in enumerate(panels):
        ax = fig.add_subplot(nrows, ncols, index + 1)
        here = [k for k in present if SERIES[k].panel == panel_key]
        drawn = _draw_curves(ax, histories, here, PANELS[panel_key], marker, styles_used)
        _label_panel(ax, panel_key, here, mpl.MaxNLocator)
        if not several and drawn > 1:
            ax.legend(fontsize="small")
    if several:
        _figure_legend(fig, mpl.Line2D, names, styles_used)
    else:
        fig.suptitle(names[0])
    return fig


def _draw_curves(
    ax: Any,
    histories: Sequence[Sequence[dict[str, Any]]],
    keys: Sequence[str],
    panel: Panel,
    marker: str | None,
    styles_used: dict[str, str],
) -> int:
    """Plot the curves ``keys`` of every run into ``ax``; the number of lines drawn.

    One run: a colour per curve and each curve's own line style (a panel's curves never look
    alike). Several: a colour per run, a style per curve (recorded in ``styles_used`` when the
    panel holds several curves).
    """
    several = len(histories) > 1
    scale = 100.0 if panel.percent else 1.0
    drawn = 0
    for run_index, history in enumerate(histories):
        for key in keys:
            series = SERIES[key]
            xs, ys = curve_points(history, key)
            if not xs:
                continue
            own = _SERIES_COLORS.get(series.label, f"C{list(keys).index(key) % 10}")
            color = f"C{run_index % 10}" if several else own
            ax.plot(
                xs,
                [scale * y for y in ys],
                color=color,
                linestyle=series.style,
                marker=marker,
                markersize=3,
                linewidth=1.5,
                label=series.label,
            )
            if len(keys) > 1:
                styles_used.setdefault(series.label, series.style)
            drawn += 1
    return drawn


def _label_panel(ax: Any, panel_key: str, keys: Sequence[str], max_n_locator: Any) -> None:
    """Title (naming the one curve of a panel that can hold several), axis labels, grid."""
    panel = PANELS[panel_key]
    alone = len(keys) == 1 and sum(s.panel == panel_key for s in SERIES.values()) > 1
    ax.set_title(f"{panel.title} ({SERIES[keys[0]].label})" if alone else panel.title)
    ax.set_xlabel("epoch")
    ax.set_ylabel(panel.ylabel)
    ax.xaxis.set_major_locator(max_n_locator(integer=True))
    ax.grid(True, alpha=0.3)
    if panel_key == "lr":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))


def _figure_legend(
    fig: Any, line_2d: Any, names: Sequence[str], styles_used: dict[str, str]
) -> None:
    """Several runs: one legend for the figure (a colour per run, then the line styles)."""
    handles = [
        line_2d([], [], color=f"C{i % 10}", linewidth=2, label=name) for i, name in enumerate(names)
    ]
    handles += [
        line_2d([], [], color="0.35", linestyle=style, label=label)
        for label, style in styles_used.items()
    ]
    fig.legend(
        handles=handles, loc="outside lower center", ncol=min(len(handles), 6), fontsize="small"
    )
    fig.suptitle(" vs ".join(names) if len(names) <= 3 else f"{len(names)} runs")


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
    return _plot([run_dir], Path(run_dir) / CURVES_FILE, None, None, True, RUN_CURVES)
