"""An inspection of any number of images in bounded memory, batch by batch.

:class:`RoutingTally` adds up, batch by batch, what capsctl/inspection/statistics.py computes
over all images at once (the means of the per-child statistics, the routing each parent type
receives, the heatmaps' mean coefficient matrices) and keeps each image's small summary; no
per-image tensor outlives its batch. :class:`DumpWriter` writes the raw coefficients of each
batch into their place in a safetensors file (the format of capsctl/inspection/dump.py), under
a temporary name renamed at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import struct
from pathlib import Path
from typing import BinaryIO

import torch
from torch import Tensor

from capsctl.atomic import fsync_dir, temp_path
from capsctl.errors import CapsctlError, UsageError
from capsctl.inspection.dump import dump_metadata, dump_tensors
from capsctl.inspection.pictures import matrix_sum
from capsctl.inspection.report import ImageRouting, IterationStats, LayerRouting, RoutingReport
from capsctl.inspection.statistics import (
    changed_children,
    max_coefficient,
    normalized_entropy,
    pose_cosines,
)

__all__ = ["DumpWriter", "RoutingTally"]

_EXISTS = "--dump {}: exists; pass --overwrite to replace it"


class _Mean:
    """A running mean that is exact when all values are equal (shifted by the first value,
    as ``statistics._exact_mean``)."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.total, self.count = 0.0, 0

    def add(self, values: Tensor) -> None:
        flat = values.reshape(-1).double()  # [values]
        if self.first is None:
            self.first = float(flat[0])
        self.total += float((flat - self.first).sum())
        self.count += flat.numel()

    def value(self) -> float:
        assert self.first is not None
        return self.first + self.total / self.count


@dataclasses.dataclass
class _IterationTally:
    entropy: _Mean = dataclasses.field(default_factory=_Mean)
    top: _Mean = dataclasses.field(default_factory=_Mean)
    changed: _Mean = dataclasses.field(default_factory=_Mean)
    stability: _Mean = dataclasses.field(default_factory=_Mean)
    matrix: Tensor | None = None  # [n, m] sum of the heatmap's rows
    rows: int = 0


class RoutingTally:
    """The statistics of many batches' :class:`RoutingReport` as if of one (:meth:`add` each
    batch in order, then :meth:`report`); ``top`` as in ``inspect_routing``."""

    def __init__(self, top: int) -> None:
        self.top = top
        self.first: RoutingReport | None = None  # a batch's report without its tensors
        self.layers: list[list[_IterationTally]] = []
        self.received: list[Tensor] = []  # per layer [m]: coefficients summed over children
        self.images: list[ImageRouting] = []

    def add(self, report: RoutingReport) -> None:
        """Fold in the next batch (its images are numbered after those already added)."""
        if self.first is None:
            self.first = dataclasses.replace(report, coefficients=[], poses=[], activations=[])
            self.first.logits = None
            self.layers = [[_IterationTally() for _ in per] for per in report.coefficients]
            m = [per[-1].shape[-1] for per in report.coefficients]
            self.received = [torch.zeros(n, dtype=torch.float64) for n in m]  # [m] per layer
        for li, coeffs in enumerate(report.coefficients):
            for ti in range(len(coeffs)):
                self._add_iteration(report, li, ti)
            last = coeffs[-1]
            self.received[li] += last.reshape(-1, last.shape[-1]).double().sum(0)  # [m]
        offset = len(self.images)
        self.images += [dataclasses.replace(im, index=offset + im.index) for im in report.images]

    def _add_iteration(self, report: RoutingReport, li: int, ti: int) -> None:
        tally, c = self.layers[li][ti], report.coefficients[li][ti]
        tally.entropy.add(normalized_entropy(c))
        tally.top.add(max_coefficient(c))
        if ti > 0:
            tally.changed.add(changed_children(report.coefficients[li][ti - 1], c))
            tally.stability.add(pose_cosines(report.poses[li][ti - 1], report.poses[li][ti]))
        total, rows = matrix_sum(c, report.kinds[li], report.child_grids[li])  # [n, m]
        tally.matrix = total if tally.matrix is None else tally.matrix + total
        tally.rows += rows

    def mean_matrix(self, li: int, ti: int) -> Tensor:
        """The heatmap of layer ``li`` at iteration ``ti + 1``: ``[child types, parent types]``."""
        tally = self.layers[li][ti]
        assert tally.matrix is not None
        return tally.matrix / tally.rows

    def _layer(self, li: int, template: LayerRouting) -> LayerRouting:
        stats = [
            IterationStats(
                iteration=ti + 1,
                mean_entropy=t.entropy.value(),
                mean_max=t.top.value(),
                top_changed=None if ti == 0 else t.changed.value(),
                pose_stability=None if ti == 0 else t.stability.value(),
            )
            for ti, t in enumerate(self.layers[li])
        ]
        shares = self.received[li] / self.received[li].sum()  # [m]
        values, index = shares.topk(min(self.top, shares.numel()))
        parents = [(int(j), float(v)) for v, j in zip(values, index, strict=True)]
        return dataclasses.replace(template, iterations=stats, parents_receiving=parents)

    def report(self) -> RoutingReport:
        """The report of all images added: statistics, per-image routing; no raw tensors."""
        assert self.first is not None, "no batch added"
        layers = [self._layer(li, layer) for li, layer in enumerate(self.first.layers)]
        return dataclasses.replace(self.first, layers=layers, images=list(self.images))


def _publish_new(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` to ``path`` unless a file is there (FileExistsError), also one that
    appeared meanwhile: a hard link fails on an existing name (a rename would replace it)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:  # no hard links on this file system: the check, then the rename
        if path.exists():
            raise FileExistsError(str(path)) from None
        os.replace(tmp, path)
        return
    os.unlink(tmp)


class DumpWriter:
    """The raw coefficients of ``count`` images, batch by batch, into the safetensors file
    ``path`` (the format of capsctl/inspection/dump.py): the first batch fixes the header,
    each batch is written at its place in a temporary file next to ``path``, :meth:`finish`
    renames it to ``path`` (refusing an existing file unless ``overwrite``)."""

    def __init__(self, path: Path, count: int, *, overwrite: bool) -> None:
        self.path, self.count, self.overwrite = path, count, overwrite
        self.tmp = temp_path(path)
        self.file: BinaryIO | None = None
        self.places: dict[str, tuple[int, int]] = {}  # key -> (start in the file, bytes/image)
        self.done = 0

    def _start(self, report: RoutingReport, tensors: dict[str, Tensor]) -> None:
        header: dict[str, object] = {"__metadata__": dump_metadata(report)}
        start = 0
        for key, t in tensors.items():
            row = t[0].numel() * 4  # float32 bytes per image
            header[key] = {
                "dtype": "F32",
                "shape": [self.count, *t.shape[1:]],
                "data_offsets": [start, start + row * self.count],
            }
            self.places[key] = (start, row)
            start += row * self.count
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data aligned to 8 bytes, as safetensors writes it
        base = 8 + len(text)
        self.places = {k: (base + s, row) for k, (s, row) in self.places.items()}
        try:
            self.file = open(self.tmp, "xb")  # noqa: SIM115 (closed in finish/abort)
            self.file.write(struct.pack("<Q", len(text)) + text)
            self.file.truncate(base + start)
        except OSError as e:
            self.abort()
            raise CapsctlError(f"cannot write {self.path}: {e.strerror or e}") from None

    def add(self, report: RoutingReport) -> None:
        """Write the next batch's coefficients (and activations) at their place."""
        tensors = dump_tensors(report)
        if self.file is None:
            self._start(report, tensors)
        n = len(report.images)
        assert self.file is not None
        try:
            for key, t in tensors.items():
                start, row = self.places[key]
                self.file.seek(start + self.done * row)
                self.file.write(t.numpy().tobytes())
        except OSError as e:
            self.abort()
            raise CapsctlError(f"cannot write {self.path}: {e.strerror or e}") from None
        self.done += n

    def finish(self) -> None:
        """fsync and rename the finished file to ``path``."""
        assert self.file is not None and self.done == self.count
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            if self.overwrite:
                os.replace(self.tmp, self.path)
            else:
                _publish_new(self.tmp, self.path)
        except FileExistsError:
            self.abort()
            raise UsageError(
                f"--dump {self.path}: exists; pass --overwrite to replace it"
            ) from None
        except OSError as e:
            self.abort()
            raise CapsctlError(f"cannot write {self.path}: {e.strerror or e}") from None
        fsync_dir(self.path.parent)

    def abort(self) -> None:
        """Remove the temporary file (the target is untouched)."""
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()
        with contextlib.suppress(OSError):
            os.unlink(self.tmp)
