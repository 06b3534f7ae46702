"""Robustness columns of a suite report: each finished run's FGSM and PGD accuracy at 8/255 and
its mean corruption accuracy (:func:`capsctl.robustness.robustness_summary`), cached in the run
folder's ``robustness.json`` with the settings they were measured under, and aggregated over
seeds like the clean accuracy."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from capsctl.atomic import write_text_atomic
from capsctl.events import EventFn, emit

__all__ = ["ROBUST_FILE", "ROBUST_METRICS", "RobustSettings", "run_robustness"]

ROBUST_FILE = "robustness.json"
#: Summary keys shown as report columns, with their column names.
ROBUST_METRICS = {
    "fgsm_8_255_accuracy": "FGSM 8/255",
    "pgd_8_255_accuracy": "PGD 8/255",
    "mean_corruption_accuracy": "corruptions",
}


@dataclass(frozen=True)
class RobustSettings:
    """How the columns are measured: test images attacked (``limit``), images per corruption
    (``corruption_limit``; None skips the corruptions), PGD steps and the seed."""

    limit: int | None = 1000
    corruption_limit: int | None = 1000
    steps: int = 10
    seed: int = 0


def run_robustness(
    folder: Path,
    settings: RobustSettings,
    *,
    data_dir: str | None = None,
    on_event: EventFn = None,
) -> dict[str, Any]:
    """The robustness summary of the finished run in ``folder``: read from ``robustness.json``
    when it was measured with ``settings``, else measured now and stored (atomically)."""
    from capsctl.robustness import robustness_summary

    path = folder / ROBUST_FILE
    key = asdict(settings)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        doc = {}
    if (
        isinstance(doc, dict)
        and doc.get("settings") == key
        and isinstance(doc.get("summary"), dict)
    ):
        return doc["summary"]
    emit(on_event, "suite_robustness", folder=str(folder))
    summary = robustness_summary(
        folder / "best.safetensors",
        limit=settings.limit,
        corruption_limit=settings.corruption_limit,
        steps=settings.steps,
        seed=settings.seed,
        data_dir=data_dir,
        on_event=on_event,
    )
    write_text_atomic(path, json.dumps({"settings": key, "summary": summary}, indent=2))
    return summary
