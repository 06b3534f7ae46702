"""Evaluation: accuracy, the model's own loss, per-class accuracy and the confusion matrix.

:func:`evaluate` runs a model over a dataset; :func:`evaluate_checkpoint` (what ``capsctl eval``
calls) rebuilds the model and its data from a checkpoint alone. Accuracy is micro top-1 (the
share of images), the figure papers report; for multi-label data (DiverseMultiMNIST) it is the
paper's top-2 metric. The loss is the one the model trains with (see :mod:`capsctl.losses`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from capsctl.checkpoint import load_checkpoint, resolve_checkpoint, stored_preset
from capsctl.data.prepare import prepare_data
from capsctl.devices import autocast, resolve_device
from capsctl.errors import CapsctlError, UsageError
from capsctl.events import EventFn, emit
from capsctl.losses import EvalLoss, default_eval_loss, eval_loss, multi_hot, top2_correct

__all__ = ["EvalResult", "evaluate", "evaluate_checkpoint"]


@dataclass
class EvalResult:
    split: str
    dataset: str
    count: int
    loss: float
    accuracy: float  # top-1, micro (fraction of images)
    top5: float
    per_class: list[float]
    confusion: list[list[int]]  # rows: true class, columns: predicted class
    classes: list[str]
    images_per_s: float
    seconds: float
    metric: str = "top-1"
    loss_name: str = "cross_entropy"  # the model's own training loss: cross_entropy, bce, ...
    flip: bool = False  # outputs averaged with those on the mirror images

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class _SingleLabelTally:
    """Top-1 (through the confusion matrix) and top-5 hits for one label per image."""

    metric = "top-1"

    def __init__(self, n_cls: int) -> None:
        self.n_cls = n_cls
        self.confusion = torch.zeros(n_cls, n_cls, dtype=torch.int64)
        self.top5_hits = 0

    def add(self, logits: Tensor, y: Tensor) -> None:
        n = self.n_cls
        k = min(5, n)
        self.top5_hits += int((logits.topk(k, 1).indices == y[:, None]).any(1).sum())
        cells = torch.bincount((y * n + logits.argmax(1)).cpu(), minlength=n * n)  # [n*n]
        self.confusion += cells.view(n, n)  # [true, predicted]

    def summary(self, count: int) -> dict[str, Any]:
        correct = self.confusion.diag()
        per_class = correct.double() / self.confusion.sum(1).clamp(min=1).double()
        return {
            "accuracy": float(correct.sum()) / max(count, 1),
            "top5": self.top5_hits / max(count, 1),
            "per_class": per_class.tolist(),
            "confusion": self.confusion.tolist(),
        }


class _MultiLabelTally:
    """Multi-label data (DiverseMultiMNIST): the paper's metric — for two digits the top-2
    classes equal the two labels, for one digit the top-1 class equals it. ``per_class`` is the
    recall of each class (share of its appearances found among the top-k, k = digits in the
    image); ``top5``: share of images whose labels are all among the top 5."""

    metric = "top-2 exact match (DiverseMultiMNIST)"

    def __init__(self, n_cls: int) -> None:
        self.n_cls = n_cls
        self.hits = torch.zeros(n_cls, dtype=torch.int64)
        self.seen = torch.zeros(n_cls, dtype=torch.int64)
        self.correct = 0
        self.top5_hits = 0

    def add(self, logits: Tensor, y: Tensor) -> None:
        target = multi_hot(y, self.n_cls)  # [b, classes]
        self.correct += int(top2_correct(logits, y).sum())
        pair = (y >= 0).sum(1) == 2  # [b]: two digits in the image
        top2 = logits.topk(2, 1).indices  # [b, 2]
        found = torch.zeros_like(target).scatter_(1, top2[:, :1], 1.0)  # [b, classes]
        found[pair] = found[pair].scatter(1, top2[pair], 1.0)
        self.hits += (found * target).sum(0).long().cpu()
        self.seen += target.sum(0).long().cpu()
        top5 = torch.zeros_like(target).scatter_(1, logits.topk(min(5, self.n_cls), 1).indices, 1.0)
        self.top5_hits += int(((top5 * target).sum(1) == target.sum(1)).sum())

    def summary(self, count: int) -> dict[str, Any]:
        return {
            "accuracy": self.correct / max(count, 1),
            "top5": self.top5_hits / max(count, 1),
            "per_class": (self.hits.double() / self.seen.clamp(min=1).double()).tolist(),
            "confusion": [],
        }


@torch.no_grad()
def evaluate(
    model: nn.Module,
    ds: Any,
    *,
    batch_size: int,
    device: torch.device,
    mean: list[float],
    std: list[float],
    classes: list[str],
    split: str = "test",
    amp: bool = False,
    loss: EvalLoss | None = None,
    flip: bool = False,
    on_event: EventFn = None,
) -> EvalResult:
    """Accuracy, top-5, the loss, per-class accuracy and the confusion matrix over ``ds``.

    ``flip``: the outputs on each image and on its left-right mirror are averaged.

    ``loss`` is the model's own loss as ``(name, fn(outputs, labels) -> batch mean)`` (see
    :func:`capsctl.losses.eval_loss`); by default cross-entropy, or binary cross-entropy for
    multi-label data.
    """
    from capsctl.data import Loader

    loader = Loader(ds, batch_size, shuffle=False, device=device, mean=mean, std=std)
    model.eval()
    multi_label = ds.labels.dim() == 2
    loss_name, loss_fn = loss or default_eval_loss(multi_label, len(classes))
    tally = _MultiLabelTally(len(classes)) if multi_label else _SingleLabelTally(len(classes))
    loss_sum, count = 0.0, 0
    t0 = time.perf_counter()
    for step, (x, y) in enumerate(loader):
        with autocast(device, amp):
            logits = model(x)
            if flip:
                logits = (logits.float() + model(x.flip(-1)).float()) / 2  # [b, classes]
        logits = logits.float()
        loss_sum += float(loss_fn(logits, y)) * int(y.shape[0])
        tally.add(logits, y)
        count += int(y.shape[0])
        emit(on_event, "eval_step", split=split, step=step + 1, steps=len(loader))
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return EvalResult(
        split=split,
        dataset=getattr(ds, "name", "?"),
        count=count,
        loss=loss_sum / max(count, 1),
        classes=list(classes),
        images_per_s=count / max(seconds, 1e-9),
        seconds=seconds,
        metric=tally.metric,
        loss_name=loss_name,
        flip=flip,
        **tally.summary(count),
    )


def evaluate_checkpoint(
    path: str | Path,
    *,
    data_dir: str | None = None,
    split: str = "test",
    batch_size: int | None = None,
    device: str = "auto",
    test_file: str | None = None,
    on_event: EventFn = None,
) -> tuple[EvalResult, dict[str, Any]]:
    """Rebuild the model and its data from a checkpoint (a model folder, or a run folder: its
    best.safetensors) alone and evaluate one split; returns the result and the checkpoint's
    metadata. ``split="test"`` reads only the test images; ``"val"`` reads the training images
    to hold out the validation split. The data lives in ``data_dir``, else ``$CAPSCTL_DATA``,
    else the user cache, never in the stored ``data.data_dir``; the stored class names and
    normalization are used, as ``predict`` uses them. A ``batch_size`` below 1 is a
    :class:`UsageError`."""
    if split not in ("val", "test"):
        raise UsageError(f"--split {split}: expected val or test")
    if batch_size is not None and batch_size < 1:
        raise UsageError(f"--batch-size {batch_size}: must be >= 1")
    dev = resolve_device(device)
    path = resolve_checkpoint(path)  # a run folder: its best.safetensors
    model, meta = load_checkpoint(path, device=dev)
    preset = stored_preset(meta, path)
    if data_dir is not None:
        preset.data.data_dir = data_dir
    if test_file is not None:
        preset.data.test_file = test_file
    if split == "val" and preset.data.val_size == 0:
        raise UsageError(
            f"{path}: this run had no validation split (data.val_size = 0); use --split test"
        )
    data = prepare_data(preset, on_event, need_train=split != "test")
    stored = meta.get("dataset_fingerprint")
    if stored and data.fingerprint is not None and stored != data.fingerprint:
        emit(
            on_event,
            "warning",
            message=(
                f"the training data differs from the data {Path(path).name} was trained on "
                f"(fingerprint {data.fingerprint} != {stored}); the validation split may overlap "
                "training"
            ),
        )
    ds = data.val if split == "val" else data.test
    result = evaluate(
        model,
        ds,
        batch_size=batch_size or preset.train.eval_batch_size,
        device=dev,
        **_stored_preprocessing(meta, data.classes, data.mean, data.std),
        split=split,
        loss=eval_loss(preset, ds.labels.dim() == 2, len(data.classes)),
        flip=preset.data.augment.test_flip,
        on_event=on_event,
    )
    _check_finite(result, path)
    return result, meta


def _stored_preprocessing(
    meta: dict[str, Any], classes: list[str], mean: list[float], std: list[float]
) -> dict[str, Any]:
    """``classes``, ``mean`` and ``std`` as the checkpoint stores them (what ``predict`` uses;
    checked when the metadata was read), else the dataset's ``classes``, ``mean`` and ``std``:
    the model is scored on the preprocessing it was trained with."""
    norm = meta.get("normalization") or {}

    def per_channel(key: str, default: list[float]) -> list[float]:
        values = [float(v) for v in norm.get(key) or default]
        return values * len(default) if len(values) == 1 else values

    return {
        "classes": [str(c) for c in meta.get("classes") or classes],
        "mean": per_channel("mean", mean),
        "std": per_channel("std", std),
    }


def _check_finite(result: EvalResult, path: str | Path) -> None:
    """:class:`CapsctlError` naming the loss or metrics that came out NaN or infinite."""
    values = {"loss": result.loss, "accuracy": result.accuracy, "top5": result.top5}
    bad = [name for name, v in values.items() if not math.isfinite(v)]
    bad += [] if all(map(math.isfinite, result.per_class)) else ["per-class accuracy"]
    if bad:
        raise CapsctlError(
            f"{path}: the {' and '.join(bad)} on the {result.split} split are not finite (the "
            "model gives NaN or infinite outputs); check the checkpoint, or rerun with "
            "CAPSCTL_NATIVE=0 to rule out the compiled routing loops"
        )
