"""The library call behind ``capsctl inspect-routing``: :func:`inspect_checkpoint`.

Reads a checkpoint, picks the images (capsctl/inspection/images.py), runs the routing
inspection (capsctl/inspection/trace.py) and optionally writes the raw coefficients
(capsctl/inspection/dump.py) and pictures (capsctl/inspection/pictures.py). The result holds,
as plain data, everything a view shows; nothing is printed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from capsctl.checkpoint import load_checkpoint, read_metadata
from capsctl.devices import resolve_device
from capsctl.errors import UsageError
from capsctl.events import EventFn
from capsctl.inspection.dump import dump_coefficients
from capsctl.inspection.images import select_images
from capsctl.inspection.pictures import write_pngs
from capsctl.inspection.report import ImageRouting, LayerRouting, RoutingReport
from capsctl.inspection.trace import inspect_routing

__all__ = ["InspectionResult", "inspect_checkpoint"]


@dataclass
class InspectionResult:
    """Result of :func:`inspect_checkpoint`.

    ``checkpoint``: the path as given. ``inputs``: what the images are (e.g. ``"2 test images
    of mnist (indices [0, 5])"``). ``report``: the routing statistics, per-image class routing
    and the raw trace (see :class:`~capsctl.inspection.report.RoutingReport`). ``written``: the
    files written, the dump first, then the pictures. ``raw_images``: the un-normalized inputs,
    uint8 ``[N, C, H, W]``, for pictures made later (not part of :meth:`to_dict`).
    ``iterations``, ``routing``, ``classes``, ``layers`` and ``images`` are the report's.
    """

    checkpoint: str
    inputs: str
    report: RoutingReport
    written: list[str] = field(default_factory=list)
    raw_images: Tensor | None = field(default=None, repr=False)

    @property
    def iterations(self) -> int:
        """The number of routing iterations T used."""
        return self.report.iterations

    @property
    def routing(self) -> str:
        """The routing schedule used: ``concurrent`` or ``sequential``."""
        return self.report.routing

    @property
    def algorithm(self) -> str:
        """The routing algorithm's title, e.g. ``self-routing``."""
        return self.report.algorithm_title

    @property
    def coefficient_name(self) -> str:
        """What the algorithm's coefficients are, e.g. ``gating weights``."""
        return self.report.coefficient_name

    @property
    def classes(self) -> list[str]:
        """Class names, one per logit."""
        return self.report.classes

    @property
    def layers(self) -> list[LayerRouting]:
        """Per capsule layer: shape, statistics per iteration, parents receiving most routing."""
        return self.report.layers

    @property
    def images(self) -> list[ImageRouting]:
        """Per image: prediction, probability, label and children routing into the prediction."""
        return self.report.images

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` document: checkpoint, inputs, the report's summary, files written."""
        return {
            "checkpoint": self.checkpoint,
            "inputs": self.inputs,
            **self.report.to_dict(),
            "written": list(self.written),
        }


def inspect_checkpoint(
    ckpt: str | os.PathLike[str],
    *,
    split: str = "test",
    indices: str | Sequence[int] | None = None,
    image_files: Sequence[str | os.PathLike[str]] | None = None,
    random: int | None = None,
    data_dir: str | None = None,
    iterations: int | None = None,
    routing: str | None = None,
    top: int = 5,
    dump: str | os.PathLike[str] | None = None,
    png_dir: str | os.PathLike[str] | None = None,
    device: str = "cpu",
    seed: int = 0,
    on_event: EventFn = None,
) -> InspectionResult:
    """Inspect the routing of the capsule network in checkpoint ``ckpt`` on a few images.

    Images: ``indices`` of ``split`` (a list or text like ``"0,3,10-12"``; default the first 8),
    or ``image_files``, or ``random`` seeded random images (``seed``); at most one of the three.
    ``data_dir``: where the dataset lives. ``iterations``/``routing``: override T and the
    schedule. ``top``: how many parents/children to list. ``dump``: write the raw coefficients
    to this safetensors file; ``png_dir``: write heatmaps and overlays there (needs matplotlib).
    ``device``: where the model runs (``auto``, ``cpu``, ``cuda[:N]``, ``mps``). Emits
    ``progress`` events (``task="pictures"``) while writing pictures. Raises
    :class:`UsageError` for a missing checkpoint, a model without routing or bad options.
    """
    path = Path(ckpt)
    if not path.exists():
        raise UsageError(f"{ckpt}: no such file")
    target = resolve_device(device)
    sample = select_images(
        read_metadata(path),
        split=split,
        indices=indices,
        image_files=[Path(f) for f in image_files] if image_files else None,
        random=random,
        data_dir=data_dir,
        seed=seed,
    )
    model, meta = load_checkpoint(path, device=target)
    report = inspect_routing(
        model,
        sample.normalized,
        labels=sample.labels,
        classes=list(meta["classes"]),
        iterations=iterations,
        routing=routing,
        top=top,
    )
    written: list[str] = []
    if dump is not None:
        dump_coefficients(report, dump)
        written.append(str(dump))
    if png_dir is not None:
        written += [str(p) for p in write_pngs(report, sample.raw, png_dir, on_event=on_event)]
    return InspectionResult(str(ckpt), sample.description, report, written, sample.raw)
