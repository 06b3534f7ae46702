"""Reading a run's ``metrics.jsonl``: one JSON object per finished epoch.

A run folder written by ``capsctl train`` holds ``metrics.jsonl`` with ``epoch``,
``train_loss``, ``train_accuracy``, ``lr``, ``epoch_seconds``, ``images_per_s``, ``best``, the
epoch's training time by phase (``data_seconds``, ``forward_seconds``, ``backward_seconds``,
``optimizer_seconds``, ``other_seconds``; capsctl/training/phases.py) and, with a validation
split, ``val_loss``, ``val_accuracy``, ``val_top5`` and ``val_seconds`` (accuracies are
fractions). A last line cut short by a kill is skipped.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from capsctl.errors import CapsctlError, UsageError

__all__ = ["METRICS_FILE", "curve_points", "metrics_path", "read_history", "run_name"]

#: The per-epoch metrics file of a run folder (the same name as
#: ``capsctl.training.run_folder.METRICS``).
METRICS_FILE = "metrics.jsonl"


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


def _read_text(path: Path) -> str:
    if not path.exists():
        folder = path.parent
        if not folder.exists():
            raise UsageError(
                f"{folder}: no such folder; pass a run folder written by capsctl train"
            )
        raise CapsctlError(
            f"{folder} has no {METRICS_FILE}; train it first (capsctl train --preset NAME "
            f"--out {shlex.quote(str(folder))}) or pass another run folder"
        )
    if not path.is_file():  # reading a named pipe would wait for a writer
        raise UsageError(
            f"{path}: not a regular file (a named pipe, socket or device); pass a run folder "
            "written by capsctl train"
        )
    try:
        return path.read_bytes().decode("utf-8", errors="replace")
    except OSError as e:
        raise CapsctlError(f"cannot read {path}: {e.strerror or e}") from None


def read_history(run_dir: str | Path) -> list[dict[str, Any]]:
    """The epoch records of a run folder (or of a ``metrics.jsonl`` path), sorted by epoch.

    A last line that is not valid JSON (the write was cut short) is skipped; a bad line
    elsewhere raises :class:`CapsctlError` naming the file and line. If an epoch appears twice
    the later line wins. A missing folder is a :class:`UsageError`; a folder without
    ``metrics.jsonl`` a :class:`CapsctlError` that says to train it first.
    """
    path = metrics_path(run_dir)
    text = _read_text(path)
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


def curve_points(history: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
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
