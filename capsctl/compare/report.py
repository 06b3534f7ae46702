"""The result of ``compare``: one :class:`CompareRow` per model and, when a ResNet-18 is among
them, one :class:`ReferenceRatios` per other model (how it compares with that ResNet-18).

Everything here is data (``to_dict`` for JSON, :meth:`CompareReport.to_csv` for CSV); the
words a terminal shows are the front end's.
"""

from __future__ import annotations

import csv
import dataclasses
import io
from dataclasses import dataclass, field
from typing import Any

from capsctl.compare.flops import FLOPS_NOTE

__all__ = [
    "CSV_COLUMNS",
    "PARAMS_ABOUT_EQUAL",
    "CompareReport",
    "CompareRow",
    "ReferenceRatios",
    "reference_ratios",
]

#: Parameter counts within this factor of each other count as "about as many".
PARAMS_ABOUT_EQUAL = 1.005


@dataclass
class CompareRow:
    """One compared model. ``None`` means "not known / not measured / not applicable".

    ``source``: ``model`` (registered), ``preset`` or ``checkpoint``. ``input``: ``[C, H, W]``.
    ``gflops``: per image, one forward pass of our implementation; ``gflops_all_passes``: the
    same with every routing pass computed (capsule nets only). ``accuracy``: top-1 test (or
    validation, as ``accuracy_source`` says) accuracy of a checkpoint. ``reference_accuracy``:
    the published number measured on this configuration
    (:func:`capsctl.compare.published.published_result`), and ``reference_source`` its
    citation (source, table, setting). Speed: median training step (seconds), inference images
    per second and peak memory (device bytes on cuda, else the peak resident memory of the
    process) from :func:`capsctl.bench.run_bench`.
    """

    name: str
    source: str
    arch: str
    num_classes: int
    input: list[int]
    params: dict[str, int]
    gflops: float
    routing: str | None
    iterations: int | None
    accuracy: float | None
    accuracy_source: str | None
    reference_accuracy: float | None
    reference_source: str | None
    gflops_all_passes: float | None = None
    train_step_s: float | None = None
    infer_images_per_s: float | None = None
    peak_memory_bytes: int | None = None
    measured: dict[str, Any] | None = None  # from a suite (capsctl/compare/measured.py)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class ReferenceRatios:
    """How one model compares with the reference model (``reference``, the ResNet-18 row).

    Every ratio is this model's figure over the reference's, so above 1 means more parameters,
    more FLOPs or slower; None means that side was not measured or does not apply.

    - ``params``: total parameters / the reference's; ``params_about_equal``: the two counts
      are within :data:`PARAMS_ABOUT_EQUAL` of each other.
    - ``gflops``: GFLOPs / the reference's (None when the reference counts none);
      ``gflops_all_passes``: this model's every-routing-pass GFLOPs / the reference's GFLOPs
      (None unless that count exists and differs from ``gflops``).
    - ``train_step``: training step time / the reference's (above 1: slower).
    - ``inference``: the reference's images per second / this model's, i.e. time per image
      over the reference's (above 1: slower).
    """

    name: str
    reference: str
    params: float
    params_about_equal: bool
    gflops: float | None
    gflops_all_passes: float | None
    train_step: float | None
    inference: float | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def reference_ratios(row: CompareRow, ref: CompareRow) -> ReferenceRatios:
    """``row`` against the reference row ``ref`` (see :class:`ReferenceRatios`)."""
    mine, theirs = row.params["total"], ref.params["total"]
    gflops = all_passes = None
    if ref.gflops > 0:
        gflops = row.gflops / ref.gflops
        if row.gflops_all_passes is not None and row.gflops_all_passes != row.gflops:
            all_passes = row.gflops_all_passes / ref.gflops
    train_step = inference = None
    if row.train_step_s and ref.train_step_s:
        train_step = row.train_step_s / ref.train_step_s
    if row.infer_images_per_s and ref.infer_images_per_s:
        inference = ref.infer_images_per_s / row.infer_images_per_s
    return ReferenceRatios(
        name=row.name,
        reference=ref.name,
        params=mine / theirs,
        params_about_equal=max(mine, theirs) < PARAMS_ABOUT_EQUAL * min(mine, theirs),
        gflops=gflops,
        gflops_all_passes=all_passes,
        train_step=train_step,
        inference=inference,
    )


#: Columns of :meth:`CompareReport.to_csv`, in order.
CSV_COLUMNS = (
    "name",
    "source",
    "arch",
    "num_classes",
    "input",
    "params_total",
    "params_backbone",
    "params_capsules",
    "gflops",
    "gflops_all_passes",
    "routing",
    "iterations",
    "accuracy",
    "accuracy_source",
    "reference_accuracy",
    "reference_source",
    "train_step_s",
    "infer_images_per_s",
    "peak_memory_bytes",
    "measured_top1_mean",
    "measured_top1_std",
    "measured_seeds",
    "measured_source",
)


def _csv_value(value: Any) -> Any:
    return "" if value is None else value


@dataclass
class CompareReport:
    """Rows, the name of the ResNet-18 row the ratios refer to, and the ratios of every other
    row to it (empty without a ResNet-18 row)."""

    rows: list[CompareRow]
    reference: str | None
    ratios: list[ReferenceRatios]
    flops_note: str = field(default=FLOPS_NOTE)

    def to_dict(self) -> dict[str, Any]:
        return {
            "models": [row.to_dict() for row in self.rows],
            "reference": self.reference,
            "ratios": [r.to_dict() for r in self.ratios],
            "flops_note": self.flops_note,
        }

    def to_csv(self) -> str:
        """A header line and one line per row; ``input`` as ``CxHxW``, empty cells for None."""
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(CSV_COLUMNS)
        for row in self.rows:
            flat = row.to_dict()
            params = flat.pop("params")
            flat["input"] = "x".join(str(v) for v in row.input)
            flat["params_total"] = params.get("total")
            flat["params_backbone"] = params.get("backbone")
            flat["params_capsules"] = params.get("capsules")
            measured = flat.pop("measured") or {}
            for key in ("top1_mean", "top1_std", "seeds", "source"):
                flat[f"measured_{key}"] = measured.get(key)
            writer.writerow([_csv_value(flat.get(col)) for col in CSV_COLUMNS])
        return buf.getvalue()
