"""The library call behind ``capsctl inspect-routing``: :func:`inspect_checkpoint`.

Reads a checkpoint, picks the images (capsctl/inspection/images.py), runs the routing
inspection (capsctl/inspection/trace.py) and optionally writes the raw coefficients
(capsctl/inspection/dump.py) and pictures (capsctl/inspection/pictures.py). The result holds,
as plain data, everything a view shows; nothing is printed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from capsctl.atomic import check_output
from capsctl.checkpoint import load_checkpoint, read_metadata, resolve_checkpoint
from capsctl.data.samples import SampleImages
from capsctl.devices import resolve_device
from capsctl.errors import UsageError
from capsctl.events import EventFn, emit
from capsctl.inspection.dump import check_folder
from capsctl.inspection.images import batches, check_random, random_batches, select_images
from capsctl.inspection.pictures import (
    figure_class,
    heatmap_name,
    images_hwc,
    layer_limits,
    make_folder,
    overlay_name,
    write_heatmap,
    write_overlay,
)
from capsctl.inspection.report import ImageRouting, LayerRouting, RoutingReport
from capsctl.inspection.statistics import spatial_map
from capsctl.inspection.stream import DumpWriter, RoutingTally
from capsctl.inspection.trace import inspect_routing
from capsctl.outputs import PNG, ROUTING_DUMP, OutputKind

__all__ = ["BATCH_SIZE", "InspectionResult", "inspect_checkpoint"]

#: Images per batch of :func:`inspect_checkpoint`.
BATCH_SIZE = 64


@dataclass
class InspectionResult:
    """Result of :func:`inspect_checkpoint`.

    ``checkpoint``: the path as given. ``inputs``: what the images are (e.g. ``"2 test images
    of mnist (indices [0, 5])"``). ``report``: the routing statistics, per-image class routing
    and the raw trace (see :class:`~capsctl.inspection.report.RoutingReport`). ``written``: the
    files written, the dump first, then the pictures. ``raw_images``: None from
    :func:`inspect_checkpoint`, which keeps no image beyond its batch (not part of
    :meth:`to_dict`).
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
    overwrite: bool = False,
    device: str = "cpu",
    seed: int = 0,
    batch_size: int = BATCH_SIZE,
    on_event: EventFn = None,
) -> InspectionResult:
    """Inspect the routing of the capsule network in checkpoint ``ckpt`` on a few images.

    Images: ``indices`` of ``split`` (a list or text like ``"0,3,10-12"``; default the first 8),
    or ``image_files``, or ``random`` seeded random images (``seed``); at most one of the three.
    ``data_dir``: where the dataset lives. ``iterations``/``routing``: override T and the
    schedule. ``top``: how many parents/children to list. ``dump``: write the raw coefficients
    to this safetensors file; ``png_dir``: write heatmaps and overlays there (needs matplotlib);
    an existing file is replaced only with ``overwrite``, the checkpoint never.
    ``device``: where the model runs (``auto``, ``cpu``, ``cuda[:N]``, ``mps``). The images
    run ``batch_size`` at a time: the statistics are added up and the dump and the overlays
    written batch by batch, so memory does not grow with the number of images (only the
    per-image summaries of the result do). Emits ``progress`` events (``task="pictures"``)
    while writing pictures. Raises :class:`UsageError` for a missing checkpoint, a model
    without routing, bad options or an output that exists (or is the checkpoint).
    """
    path = resolve_checkpoint(ckpt)  # a run folder: its best.safetensors; a shipped name
    if not path.exists():
        raise UsageError(f"{ckpt}: no such file; capsctl weights lists the shipped names")
    check_random(random)
    if batch_size < 1:
        raise UsageError(f"batch size must be >= 1, got {batch_size}")
    dump_path = None if dump is None else Path(dump)
    if dump_path is not None:
        _check_output("--dump", dump_path, path, overwrite, ROUTING_DUMP)
        check_folder(dump_path)
    if png_dir is not None:  # the folder before any work; each picture once its name is known
        _check_png_folder(Path(png_dir), path, overwrite)
    target = resolve_device(device)
    meta = read_metadata(path)
    if random is not None and not indices and not image_files:
        count, description = random, f"{random} random images (seed {seed})"
        parts: Iterator[SampleImages] = random_batches(meta, random, seed, batch_size)
    else:
        sample = select_images(
            meta,
            split=split,
            indices=indices,
            image_files=[Path(f) for f in image_files] if image_files else None,
            random=random,
            data_dir=data_dir,
            seed=seed,
        )
        count, description = sample.normalized.shape[0], sample.description
        parts = batches(sample, batch_size)
    model, meta = load_checkpoint(path, device=target)
    run = _Run(path, count, dump_path, png_dir, overwrite, top, on_event)
    try:
        for part in parts:
            report = inspect_routing(
                model,
                part.normalized,
                labels=part.labels,
                classes=list(meta["classes"]),
                iterations=iterations,
                routing=routing,
                top=top,
            )
            run.add(report, part.raw)
        report = run.finish()
    except BaseException:
        run.abort()
        raise
    return InspectionResult(str(ckpt), description, report, run.written, None)


def _check_output(option: str, out: Path, ckpt: Path, overwrite: bool, kind: OutputKind) -> None:
    """:class:`UsageError` where ``out`` is the checkpoint ``ckpt`` (replaced never), exists
    without ``overwrite``, or breaks :func:`check_output`'s rule for an output of ``kind`` (in a
    run or suite folder, or an existing file of another kind)."""
    if out.exists():
        if os.path.samefile(out, ckpt):
            raise UsageError(
                f"{option} {out}: is the checkpoint being inspected; choose another file"
            )
        if out.is_dir():
            raise UsageError(f"{option} {out}: is a folder; choose a file name")
        if not overwrite:
            raise UsageError(f"{option} {out}: exists; pass --overwrite to replace it")
    check_output(out, kind=kind, overwrite=overwrite)


def _check_png_folder(png: Path, ckpt: Path, overwrite: bool) -> None:
    """:class:`UsageError` where ``png`` is not a folder or its first picture may not be
    written (:func:`_check_output`)."""
    if png.exists() and not png.is_dir():
        raise UsageError(f"--png {png}: is not a folder; give a folder for the pictures")
    _check_output("--png", png / overlay_name(0), ckpt, overwrite, PNG)


class _Run:
    """One inspection's batches: the tally, the dump and the pictures (capsctl/inspection/
    stream.py, pictures.py); the output paths are checked before the first file is written."""

    def __init__(
        self,
        ckpt: Path,
        count: int,
        dump: Path | None,
        png_dir: str | os.PathLike[str] | None,
        overwrite: bool,
        top: int,
        on_event: EventFn,
    ) -> None:
        self.ckpt, self.count, self.overwrite, self.on_event = ckpt, count, overwrite, on_event
        self.tally = RoutingTally(top)
        self.dump = None if dump is None else DumpWriter(dump, count, overwrite=overwrite)
        self.png = None if png_dir is None else Path(png_dir)
        self.figure: Any = None
        self.pictures: list[Path] = []
        self.steps = 0

    def _check_pictures(self, report: RoutingReport) -> None:
        assert self.png is not None
        self.figure = figure_class()
        names = [heatmap_name(li, ti + 1) for li, per in enumerate(report.coefficients)
                 for ti in range(len(per))]  # fmt: skip
        self.steps = len(names) + self.count
        names += [overlay_name(i) for i in range(self.count)]
        for name in names:
            _check_output("--png", self.png / name, self.ckpt, self.overwrite, PNG)
        make_folder(self.png)

    def _picture(self, path: Path) -> None:
        self.pictures.append(path)
        emit(self.on_event, "progress", task="pictures", step=len(self.pictures), steps=self.steps)

    def add(self, report: RoutingReport, raw: Tensor) -> None:
        """One batch: its statistics, its coefficients into the dump, its overlays."""
        if self.tally.first is None and self.png is not None:
            self._check_pictures(report)
        offset = len(self.tally.images)
        self.tally.add(report)
        if self.dump is not None:
            self.dump.add(report)
        if self.png is not None:
            pictures = images_hwc(raw)  # [b, H, W, C]
            for i, record in enumerate(report.images):
                sm = spatial_map(report, i)  # [h, w]
                self._picture(
                    write_overlay(self.figure, record, sm, pictures[i], self.png, offset + i)
                )

    def finish(self) -> RoutingReport:
        """The whole report; the dump renamed into place, the heatmaps written."""
        report = self.tally.report()
        if self.dump is not None:
            self.dump.finish()
        if self.png is not None:
            for li, layer in enumerate(report.layers):
                matrices = [self.tally.mean_matrix(li, ti) for ti in range(len(layer.iterations))]
                limits = layer_limits(matrices)  # [n, m] each; one colour range per layer
                for ti, matrix in enumerate(matrices):
                    self._picture(
                        write_heatmap(self.figure, report, matrix, li, ti, self.png, limits)
                    )
        return report

    @property
    def written(self) -> list[str]:
        return ([str(self.dump.path)] if self.dump is not None else []) + list(
            map(str, self.pictures)
        )

    def abort(self) -> None:
        if self.dump is not None:
            self.dump.abort()
