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

__all__ = [
    "ROBUST_FILE",
    "ROBUST_METRICS",
    "RobustSettings",
    "cached_robustness",
    "run_robustness",
]

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


def cached_robustness(folder: Path, settings: RobustSettings) -> dict[str, Any] | None:
    """The summary in ``folder``'s ``robustness.json`` when it was measured with ``settings``,
    else None."""
    try:
        doc = json.loads((folder / ROBUST_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if (
        isinstance(doc, dict)
        and doc.get("settings") == asdict(settings)
        and isinstance(doc.get("summary"), dict)
    ):
        return doc["summary"]
    return None


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

    cached = cached_robustness(folder, settings)
    if cached is not None:
        return cached
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
    doc = {"settings": asdict(settings), "summary": summary}
    write_text_atomic(folder / ROBUST_FILE, json.dumps(doc, indent=2))
    return summary
