"""Classify image files with a checkpoint: top-k classes and scores per image.

:func:`predict_images` expands files, folders and glob patterns, decodes every image the way
the checkpoint's preprocessing says (:mod:`capsctl.data.images`: the model's channels and input
size, shorter side resized with antialiasing, center crop; then the stored normalization
``(x / 255 - mean) / std``, computed as :class:`capsctl.data.Loader` computes it for
``capsctl eval``), runs the model in eval mode under ``torch.no_grad`` in batches and returns a
:class:`PredictResult`. It never prints; skipped files are reported as ``warning`` events.

Which score is shown depends on what the model outputs (its routing algorithm's
``output_kind``, see capsctl/layers/routers/) and on whether it was trained for several labels
per image (DiverseMultiMNIST, or ``train.loss: bce``):

=============================  =====================  =====================================
model                          one label per image    several labels per image
=============================  =====================  =====================================
cnn, resnet18; capsnet with    ``softmax`` of logits  ``sigmoid`` of each logit
router idpa or self
capsnet, router dynamic        ``length-share``:      ``length``: each class capsule's length
                               lengths / their sum    (Sabour et al. 2017: the probability
                                                      that the class is present)
capsnet, router em             ``activation-share``:  ``activation``: each class activation
                               activations / sum      (Hinton et al. 2018), in (0, 1)
=============================  =====================  =====================================

Every score is a monotone function of the model's output, so the top-1 class is the output's
argmax: the class ``capsctl eval`` counts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from capsctl.errors import CapsctlError, CheckpointError, DataError, UsageError
from capsctl.events import EventFn, emit

if TYPE_CHECKING:  # pragma: no cover
    from capsctl.data.images import LoadedImage

__all__ = [
    "MULTI_LABEL_DATASETS",
    "Prediction",
    "PredictResult",
    "Skipped",
    "is_multi_label",
    "predict_images",
    "score_kind",
    "scores_from_outputs",
]

#: Datasets whose images carry several labels (labels are ``[N, k]`` pairs).
MULTI_LABEL_DATASETS = ("diverse-multimnist",)

_SCORE_TEXT = {
    "softmax": "softmax probability",
    "sigmoid": "sigmoid score per class (multi-label model; scores need not sum to 1)",
    "length-share": "class capsule length / sum of lengths (dynamic routing outputs lengths)",
    "length": "class capsule length, in [0, 1) (multi-label; scores need not sum to 1)",
    "activation-share": "class activation / sum of activations (EM routing outputs activations)",
    "activation": "class activation, in (0, 1) (multi-label; scores need not sum to 1)",
}


@dataclass
class Prediction:
    """The top-k classes of one image file, best first."""

    path: str
    input: str  # what was done to the file, e.g. "PNG RGBA 64x48 -> gray (alpha on black), ..."
    classes: list[str]
    indices: list[int]
    scores: list[float]

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "input": self.input,
            "top": [
                {"class": c, "index": i, "score": s}
                for c, i, s in zip(self.classes, self.indices, self.scores, strict=True)
            ],
        }


@dataclass
class Skipped:
    """A file left out with ``skip_bad=True``, and why."""

    path: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PredictResult:
    checkpoint: str
    arch: str
    num_classes: int
    multi_label: bool
    score: str  # softmax, sigmoid, length-share, length, activation-share, activation
    score_description: str
    preprocessing: str
    top_k: int
    device: str
    seconds: float
    predictions: list[Prediction] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "arch": self.arch,
            "num_classes": self.num_classes,
            "multi_label": self.multi_label,
            "score": self.score,
            "score_description": self.score_description,
            "preprocessing": self.preprocessing,
            "top_k": self.top_k,
            "device": self.device,
            "seconds": self.seconds,
            "images": [p.to_dict() for p in self.predictions],
            "skipped": [s.to_dict() for s in self.skipped],
        }


def is_multi_label(meta: dict[str, Any]) -> bool:
    """Whether the checkpoint was trained for several labels per image."""
    preset = meta.get("preset")
    preset = preset if isinstance(preset, dict) else {}
    data = preset.get("data") if isinstance(preset.get("data"), dict) else {}
    train = preset.get("train") if isinstance(preset.get("train"), dict) else {}
    dataset = str(data.get("dataset") or meta.get("dataset") or "")
    base = dataset.split("[", 1)[0]
    return base in MULTI_LABEL_DATASETS or train.get("loss") == "bce"


def score_kind(router: str | None, multi_label: bool) -> str:
    """The score shown for a model's outputs (see the module docstring's table); ``router``:
    the capsule network's routing algorithm, None for other models."""
    if router is not None:
        from capsctl.layers.routers import get_router

        return get_router(router).scores[1 if multi_label else 0]
    return "sigmoid" if multi_label else "softmax"


def scores_from_outputs(outputs: Tensor, kind: str, model: nn.Module | None = None) -> Tensor:
    """Model outputs ``[b, classes]`` -> scores ``[b, classes]`` of ``kind`` (float32)."""
    out = outputs.float()
    if kind == "softmax":
        return out.softmax(1)
    if kind == "sigmoid":
        return out.sigmoid()
    if kind == "length":  # the read-out multiplies the lengths by logit_scale (1 by default)
        head = getattr(model, "head", None)
        return out / float(getattr(head, "logit_scale", 1.0) or 1.0)
    if kind == "activation":
        return out
    if kind in ("length-share", "activation-share"):
        positive = out.clamp_min(0)  # lengths and activations are >= 0 already
        return positive / positive.sum(1, keepdim=True).clamp_min(1e-12)
    raise ValueError(f"unknown score kind {kind!r}")


def _normalization(
    meta: dict[str, Any], channels: int, path: Path
) -> tuple[list[float], list[float]]:
    norm = meta.get("normalization")
    norm = norm if isinstance(norm, dict) else {}
    mean = [float(v) for v in norm.get("mean") or [0.0]]
    std = [float(v) for v in norm.get("std") or [1.0]]
    if len(mean) == 1 and channels > 1:
        mean, std = mean * channels, std * channels
    if len(mean) != channels or len(std) != channels or any(s <= 0 for s in std):
        raise CheckpointError(
            f"{path}: its normalization (mean {mean}, std {std}) does not fit a "
            f"{channels}-channel model; the file is inconsistent"
        )
    return mean, std


def _arch(meta: dict[str, Any], model: nn.Module) -> str:
    config = getattr(model, "config", None)
    arch = getattr(config, "arch", None)
    if arch is None:
        preset = meta.get("preset") or {}
        arch = (preset.get("model") or {}).get("arch", "capsnet")
    return str(arch)


def predict_images(
    checkpoint: str | os.PathLike[str],
    paths: Sequence[str | os.PathLike[str]],
    *,
    top_k: int = 5,
    device: str = "auto",
    skip_bad: bool = False,
    batch_size: int = 64,
    on_event: EventFn = None,
) -> PredictResult:
    """Top-``top_k`` classes of every image in ``paths`` (files, folders, glob patterns).

    Paths are expanded by :func:`capsctl.data.images.expand_image_paths`. An argument that
    matches nothing, or a file not regular or not decodable, is an error naming it (with
    ``skip_bad``: a ``warning`` event, the file left out). ``top_k`` above the class count shows
    all. Events: ``eval_step`` (``name="images"``, ``step``, ``steps``), ``warning``."""
    from capsctl.checkpoint import read_metadata, resolve_checkpoint
    from capsctl.data.images import describe_preprocessing

    if top_k < 1:
        raise UsageError(f"--top-k {top_k}: must be >= 1")
    if batch_size < 1:
        raise UsageError(f"--batch-size {batch_size}: must be >= 1")
    if not paths:
        raise UsageError("name at least one image file, folder or glob pattern")
    checkpoint = resolve_checkpoint(checkpoint)  # a run folder: its best.safetensors
    skipped: list[Skipped] = []
    files = _image_files(paths, skip_bad, skipped, on_event)
    meta = read_metadata(checkpoint)  # cheap: the header only; the model is loaded below
    channels, size = _input_shape(meta)
    mean, std = _normalization(meta, channels, checkpoint)
    loaded = _load_images(files, channels, size, skip_bad, skipped, on_event)

    model = _load_model(checkpoint, device)
    k = min(top_k, model.num_classes)
    t0 = time.perf_counter()
    predictions = _classify(model, loaded, mean, std, k, batch_size, on_event)
    norm_name = (model.meta.get("normalization") or {}).get("name")
    preprocessing = (
        f"{describe_preprocessing(channels, size)}; (x/255 - mean) / std with "
        f"{f'{norm_name} ' if norm_name else ''}mean {_fmt(mean)}, std {_fmt(std)}"
    )
    return PredictResult(
        checkpoint=str(checkpoint),
        arch=model.arch,
        num_classes=model.num_classes,
        multi_label=model.multi_label,
        score=model.score,
        score_description=_SCORE_TEXT[model.score],
        preprocessing=preprocessing,
        top_k=k,
        device=str(model.device),
        seconds=time.perf_counter() - t0,
        predictions=predictions,
        skipped=skipped,
    )


def _image_files(
    paths: Sequence[str | os.PathLike[str]],
    skip_bad: bool,
    skipped: list[Skipped],
    on_event: EventFn,
) -> list[Path]:
    """The image files ``paths`` name; an argument matching none is skipped or an error."""
    from capsctl.data.images import expand_image_paths

    files, unmatched = expand_image_paths(paths)
    for arg, reason in unmatched:
        if not skip_bad:
            raise UsageError(f"{arg}: {reason}")
        skipped.append(Skipped(arg, reason))
        emit(on_event, "warning", message=f"skipped {arg}: {reason}")
    if not files:
        raise UsageError(
            f"no image files among {', '.join(os.fspath(p) for p in paths)}; name PNG, JPEG or "
            "other image files, folders holding them, or glob patterns"
        )
    return files


def _input_shape(meta: dict[str, Any]) -> tuple[int, int]:
    """``(channels, size)`` of the model's input, from the checkpoint's metadata."""
    channels = int(meta.get("in_channels") or 0)
    size = int(meta.get("input_size") or 0)
    if channels < 1 or size < 1:
        model_meta = (meta.get("preset") or {}).get("model") or {}
        channels = channels or int(model_meta.get("in_channels", 3))
        size = size or int(model_meta.get("input_size", 32))
    return channels, size


def _load_images(
    files: Sequence[Path],
    channels: int,
    size: int,
    skip_bad: bool,
    skipped: list[Skipped],
    on_event: EventFn,
) -> list[tuple[Path, LoadedImage]]:
    """Every readable file decoded for the model; an unreadable one is skipped or an error."""
    from capsctl.data.images import UnreadableImageError, load_image

    loaded: list[tuple[Path, LoadedImage]] = []
    for f in files:
        try:
            image = load_image(f, channels, size)
        except CapsctlError as e:
            if not skip_bad:
                if isinstance(e, UnreadableImageError):
                    raise DataError(f"{e} (--skip-bad skips unreadable files)") from None
                raise
            reason = e.reason if isinstance(e, UnreadableImageError) else str(e)
            skipped.append(Skipped(str(f), reason.removeprefix(f"{f}: ")))
            emit(on_event, "warning", message=f"skipped {f}: {skipped[-1].reason}")
            continue
        loaded.append((f, image))
        for text in image.warnings:
            emit(on_event, "warning", message=f"{f}: {text}")
    if not loaded:
        raise CapsctlError(
            f"none of the {len(files)} image file(s) could be read; see the warnings above"
        )
    return loaded


@dataclass
class _LoadedModel:
    """A checkpoint's model on its device, with what scoring its outputs needs."""

    module: nn.Module
    meta: dict[str, Any]
    device: torch.device
    classes: list[str]
    arch: str
    num_classes: int
    multi_label: bool
    score: str  # see score_kind


def _load_model(checkpoint: Path, device: str) -> _LoadedModel:
    from capsctl.checkpoint import load_checkpoint
    from capsctl.devices import resolve_device

    dev = resolve_device(device)
    model, meta = load_checkpoint(checkpoint, device=dev)
    classes = [str(c) for c in meta.get("classes") or []]
    arch = _arch(meta, model)
    multi_label = is_multi_label(meta)
    n_cls = int(getattr(getattr(model, "config", None), "num_classes", len(classes)))
    if len(classes) != n_cls:
        raise CheckpointError(
            f"{checkpoint}: it names {len(classes)} classes but the model outputs {n_cls}; "
            "the file is inconsistent"
        )
    router = getattr(model, "router", None)
    kind = score_kind(router if isinstance(router, str) else None, multi_label)
    return _LoadedModel(model, meta, dev, classes, arch, n_cls, multi_label, kind)


def _classify(
    model: _LoadedModel,
    loaded: Sequence[tuple[Path, LoadedImage]],
    mean: Sequence[float],
    std: Sequence[float],
    k: int,
    batch_size: int,
    on_event: EventFn,
) -> list[Prediction]:
    """The top-``k`` classes of every image, in batches of ``batch_size`` in eval mode."""
    dev = model.device
    # (x / 255 - mean) / std == x * scale + shift, as the data loader of capsctl eval does it.
    std_t = torch.tensor(std, dtype=torch.float32)
    mean_t = torch.tensor(mean, dtype=torch.float32)
    scale = (1.0 / (255.0 * std_t)).view(1, -1, 1, 1).to(dev)  # [1, C, 1, 1]
    shift = (-mean_t / std_t).view(1, -1, 1, 1).to(dev)  # [1, C, 1, 1]
    predictions: list[Prediction] = []
    model.module.eval()
    steps = (len(loaded) + batch_size - 1) // batch_size
    for step in range(steps):
        chunk = loaded[step * batch_size : (step + 1) * batch_size]
        raw = torch.stack([img.pixels for _, img in chunk]).to(dev)  # uint8 [b, C, H, W]
        x = raw.to(torch.float32).mul_(scale).add_(shift)  # [b, C, H, W]
        with torch.no_grad():
            scores = scores_from_outputs(model.module(x), model.score, model.module)  # [b, cls]
        top = scores.topk(k, dim=1)  # values/indices [b, k]
        values, indices = top.values.cpu().tolist(), top.indices.cpu().tolist()
        for (f, img), vs, ix in zip(chunk, values, indices, strict=True):
            predictions.append(
                Prediction(str(f), img.description, [model.classes[i] for i in ix], ix, vs)
            )
        emit(on_event, "eval_step", name="images", step=step + 1, steps=steps)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return predictions


def _fmt(values: Sequence[float]) -> str:
    return "[" + ", ".join(f"{v:.4g}" for v in values) + "]"
