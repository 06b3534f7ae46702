"""What ``capsctl robustness`` calls: every checkpoint scored, then the pictures drawn."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capsctl.atomic import check_output
from capsctl.checkpoint import resolve_checkpoint
from capsctl.errors import UsageError
from capsctl.events import EventFn
from capsctl.outputs import PNG, ROBUSTNESS_SETTINGS
from capsctl.provenance import provenance
from capsctl.robustness.api import robustness_checkpoint
from capsctl.robustness.plot import plot_robustness
from capsctl.robustness.results import RobustnessResult
from capsctl.robustness.store import PointStore

__all__ = ["RobustnessRun", "run_robustness"]


@dataclass
class RobustnessRun:
    results: list[RobustnessResult]
    pictures: list[Path] = field(default_factory=list)
    # where it was measured: capsctl commit and version, torch, CPU, cores, device
    provenance: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "results": [r.to_dict() for r in self.results],
            "pictures": [str(p) for p in self.pictures],
            "provenance": self.provenance,
        }


def run_robustness(
    paths: Sequence[str | Path],
    *,
    png: str | Path | None = None,
    overwrite: bool = False,
    resume_file: str | Path | None = None,
    on_event: EventFn = None,
    **options: Any,
) -> RobustnessRun:
    """:func:`~capsctl.robustness.api.robustness_checkpoint` for each of ``paths`` (with
    ``options``), and with ``png`` the pictures in that folder. Output paths are checked
    before any work (:func:`check_output`): an existing picture is replaced only with
    ``overwrite`` and only when it is a PNG, and nothing is written in a run or suite folder.
    With ``resume_file``, finished settings are kept there and taken from there
    (:mod:`capsctl.robustness.store`)."""
    if not paths:
        raise UsageError("give at least one checkpoint or model folder")
    for p in paths:
        if not resolve_checkpoint(p).exists():  # also a shipped name (capsctl weights)
            raise UsageError(f"{p}: no such file or folder, nor a shipped name (capsctl weights)")
    if png is not None:
        folder = Path(png)
        if folder.exists() and not folder.is_dir():
            raise UsageError(f"--png {folder}: not a folder; give a folder for the pictures")
        names = []
        if options.get("attacks", ("fgsm", "pgd")):
            names.append("accuracy-vs-eps.png")
        if options.get("shift"):
            names.append(f"accuracy-vs-{options['shift']}.png")
        if options.get("corruptions"):
            names.append("accuracy-vs-severity.png")
        if not names:
            raise UsageError(
                f"--png {folder}: nothing to draw (no attack, shift or corruption is measured); "
                "drop --png or add --attack, --shift or --corruptions"
            )
        for name in names:
            check_output(folder / name, kind=PNG, inputs=paths, overwrite=overwrite)
    store = None
    if resume_file is not None:  # an existing file of settings is resumed, never replaced
        check_output(resume_file, kind=ROBUSTNESS_SETTINGS, inputs=paths, overwrite=True)
        store = PointStore(resume_file)
    results = [robustness_checkpoint(p, on_event=on_event, store=store, **options) for p in paths]
    pictures = plot_robustness(results, png, overwrite=overwrite) if png is not None else []
    return RobustnessRun(results, pictures, provenance())
