"""Training curves of runs: read ``metrics.jsonl``, draw loss/accuracy/lr, log to TensorBoard.

* :func:`read_history` reads a run's ``metrics.jsonl`` (:mod:`capsctl.curves.history`);
* :func:`plot_runs` draws one or several runs on shared axes into a PNG (or SVG/PDF) with
  matplotlib's Agg canvas (the ``plot`` extra; imported only when drawing);
  :func:`write_run_curves` writes ``curves.png`` into a run folder, or returns None when
  matplotlib is missing or the run has no finished epoch (:mod:`capsctl.curves.plot`);
* :class:`TensorBoardLogger` writes the same scalars per epoch as TensorBoard event files
  (``torch.utils.tensorboard``; the ``tensorboard`` extra; :mod:`capsctl.curves.tensorboard`).

Nothing is printed: progress goes to an optional ``on_event`` callback (:mod:`capsctl.events`).
"""

from capsctl.curves.history import METRICS_FILE, metrics_path, read_history, run_name
from capsctl.curves.plot import (
    CURVES_FILE,
    DEFAULT_METRICS,
    PLOT_MISSING,
    SERIES,
    known_metrics,
    plot_runs,
    resolve_metrics,
    write_run_curves,
)
from capsctl.curves.tensorboard import TB_TAGS, TENSORBOARD_MISSING, TensorBoardLogger

__all__ = [
    "CURVES_FILE",
    "DEFAULT_METRICS",
    "METRICS_FILE",
    "PLOT_MISSING",
    "SERIES",
    "TB_TAGS",
    "TENSORBOARD_MISSING",
    "TensorBoardLogger",
    "known_metrics",
    "metrics_path",
    "plot_runs",
    "read_history",
    "resolve_metrics",
    "run_name",
    "write_run_curves",
]
