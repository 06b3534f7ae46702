"""A run folder and its files.

=========================  =====================================================================
``preset.yaml``            the resolved preset (defaults, flags and ``--set`` applied)
``metrics.jsonl``          one JSON line per finished epoch
``last.safetensors``       weights plus optimizer, scheduler, EMA and RNG state: resumable
``best.safetensors``       the epoch with the best validation accuracy, with its test result
``results.json``           the summary of the finished run
``curves.png``             loss, accuracy and learning rate against epochs (with matplotlib)
``events.out.tfevents.*``  the same scalars for TensorBoard (``log.tensorboard``)
=========================  =====================================================================

Every file is written atomically (a temporary file renamed into place), so a killed run leaves
each file whole: either the previous version or the new one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from capsctl.atomic import check_output, write_text_atomic
from capsctl.errors import CapsctlError, UsageError
from capsctl.events import EventFn, emit
from capsctl.outputs import RUN

__all__ = [
    "BEST",
    "CURVES",
    "LAST",
    "METRICS",
    "RESOLVED_PRESET",
    "RESULTS",
    "RUN_FILES",
    "check_out_dir",
    "draw_curves",
    "holds_run",
    "truncate_metrics",
    "write_metrics",
]

LAST = "last.safetensors"
BEST = "best.safetensors"
METRICS = "metrics.jsonl"
RESOLVED_PRESET = "preset.yaml"
RESULTS = "results.json"
CURVES = "curves.png"


def check_out_dir(out: Path, resume: bool, overwrite: bool) -> None:
    """Refuse an ``--out`` that is a file, a suite's folder or in another run's folder
    (:func:`capsctl.atomic.check_output`), or that holds a run when neither ``--resume`` nor
    ``--overwrite`` is given. Nothing is deleted here: ``--overwrite`` replaces the old run
    only once the new one has written its first checkpoint
    (:class:`capsctl.training.ownership.StagedReplace`)."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a folder; choose another path")
    check_output(out, kind=RUN)
    if holds_run(out) and not (resume or overwrite):
        if not (out / LAST).exists():  # killed between its first best and last checkpoints
            raise UsageError(
                f"--out {out}: already holds a run with no {LAST} to resume from; pass "
                "--overwrite to start it again, or choose another --out"
            )
        raise UsageError(
            f"--out {out}: already holds a run; pass --resume {out / LAST} to continue it, "
            "--overwrite to replace it, or choose another --out"
        )


#: The files of a run that ``--overwrite`` replaces (plus TensorBoard's event files).
RUN_FILES = (LAST, BEST, METRICS, RESOLVED_PRESET, RESULTS, CURVES)


def holds_run(out: Path) -> bool:
    """Whether ``out`` holds (part of) a run."""
    return out.is_dir() and any((out / f).exists() for f in (LAST, BEST, METRICS))


def truncate_metrics(path: Path, epochs_done: int) -> list[dict[str, Any]]:
    """Keep the metrics lines of the epochs a resumed run already has (drop later ones)."""
    if not path.exists():
        return []
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if isinstance(rec, dict) and rec.get("epoch", 10**9) <= epochs_done:
            kept.append(rec)
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
    return kept


def write_metrics(path: Path, history: list[dict[str, Any]]) -> None:
    """Rewrite ``metrics.jsonl`` with one line per epoch of ``history``."""
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in history))


def draw_curves(out: Path, on_event: EventFn) -> None:
    """``curves.png`` in the run folder when matplotlib is present; a drawing problem is a
    warning, never a failed run."""
    from capsctl.curves import write_run_curves

    try:
        path = write_run_curves(out)
    except CapsctlError as e:
        emit(on_event, "warning", message=f"curves.png not written: {e}")
        return
    if path is not None:
        emit(on_event, "curves", path=str(path))
