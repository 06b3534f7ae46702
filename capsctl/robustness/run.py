"""What ``capsctl robustness`` calls: every checkpoint scored, then the pictures drawn."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capsctl.atomic import check_output, same_file
from capsctl.errors import UsageError
from capsctl.events import EventFn
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
    ``options``), and with ``png`` the pictures in that folder. Output files that exist are
    refused before any work unless ``overwrite``. With ``resume_file``, finished settings are
    kept there and taken from there (:mod:`capsctl.robustness.store`)."""
    if not paths:
        raise UsageError("give at least one checkpoint or model folder")
    for p in paths:
        if not Path(p).exists():
            raise UsageError(f"{p}: no such file or folder")
    if png is not None:
        folder = Path(png)
        names = []
        if options.get("attacks", ("fgsm", "pgd")):
            names.append("accuracy-vs-eps.png")
        if options.get("shift"):
            names.append(f"accuracy-vs-{options['shift']}.png")
        for name in names:
            check_output(folder / name, inputs=paths, overwrite=overwrite)
    store = None
    if resume_file is not None:
        for p in paths:
            if same_file(resume_file, p):
                raise UsageError(
                    f"--resume-file {resume_file} is the input {p}; pick another file name"
                )
        store = PointStore(resume_file)
    results = [robustness_checkpoint(p, on_event=on_event, store=store, **options) for p in paths]
    pictures = plot_robustness(results, png, overwrite=overwrite) if png is not None else []
    return RobustnessRun(results, pictures, provenance())
