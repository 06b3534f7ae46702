"""The parity check of an export: which images, which batches, how far the artifact may be off.

An artifact is run on the check images as two batches, of ``N`` and ``N + 1`` images, and its
logits are compared with eager PyTorch's (:func:`max_abs_diff`). Neither batch size is the
tracing example's (:data:`EXAMPLE_BATCH`), so a dynamic batch axis is known to work.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from capsctl.errors import CapsctlError, DataError, UsageError
from capsctl.events import EventFn, emit

__all__ = [
    "EXAMPLE_BATCH",
    "SYNTHETIC_IMAGES",
    "CheckImages",
    "ExportResult",
    "choose_check_images",
    "max_abs_diff",
    "parity_batches",
    "parity_error",
]

#: Batch size of the example input used for tracing (>= 2, so the batch dim is not special).
EXAMPLE_BATCH = 2
#: Number of seeded random check images used when no test image is available.
SYNTHETIC_IMAGES = 4


@dataclass
class ExportResult:
    """What :func:`capsctl.export.export_checkpoint` wrote and how it was checked.

    ``path``: the artifact (for ``hf``: the model folder); ``format``:
    ``onnx``/``pt2``/``safetensors``/``hf``; ``sidecar``: the JSON file next to it (for ``hf``:
    the folder's ``config.json``); ``max_abs_diff``: largest ``|artifact - eager PyTorch|``
    over all logits checked (None if nothing was compared); ``checked_on``: what it was
    compared on, e.g. ``"16 test images of mnist (indices ...)"`` or ``"4 synthetic
    images"``; ``size_bytes``: size of the artifact; ``batch_sizes``: batch sizes run through
    the artifact; ``seconds``: wall time of the export (trace and write); ``check_seconds``:
    wall time of the check; ``files``: for ``hf``, the names of the files in the folder;
    ``tolerance``: the largest difference allowed (0 for ``safetensors`` and ``hf``);
    ``notes``: one line each about how the check was done, e.g. that the test images were
    unavailable and random images were used instead (also sent as ``warning`` events).
    """

    path: Path
    format: str
    sidecar: Path
    max_abs_diff: float | None
    checked_on: str
    size_bytes: int
    batch_sizes: list[int] = field(default_factory=list)
    seconds: float = 0.0
    check_seconds: float = 0.0
    files: list[str] = field(default_factory=list)
    tolerance: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["path"], data["sidecar"] = str(self.path), str(self.sidecar)
        return data


@dataclass
class CheckImages:
    """Normalized float images ``[N, C, H, W]`` for the parity check, how they were chosen."""

    images: Tensor
    description: str
    notes: list[str] = field(default_factory=list)


def _synthetic(channels: int, size: int) -> Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(SYNTHETIC_IMAGES, channels, size, size, generator=g)


def _given(images: Tensor, channels: int, size: int, description: str | None) -> CheckImages:
    if not isinstance(images, Tensor) or images.dim() != 4:
        raise UsageError("check images must be a float tensor [N, C, H, W]; pass normalized images")
    n, c, h, w = images.shape
    if n < 1 or (c, h, w) != (channels, size, size):
        raise UsageError(
            f"check images have shape {list(images.shape)} but the model takes "
            f"[N>=1, {channels}, {size}, {size}]; pass images of the model's input size"
        )
    noun = "image" if n == 1 else "images"
    return CheckImages(images.detach().to("cpu", torch.float32), description or f"{n} {noun}")


def _test_images(
    meta: dict[str, Any], n: int, channels: int, size: int, data_dir: str | None
) -> CheckImages:
    """The first ``n`` test images of the checkpoint's dataset; raises DataError/UsageError."""
    from capsctl.data.samples import sample_images

    sample = sample_images(meta, split="test", indices=list(range(n)), data_dir=data_dir)
    shape = tuple(sample.normalized.shape[1:])
    if shape != (channels, size, size):
        raise UsageError(
            f"they are {' x '.join(map(str, shape))} images and the model takes "
            f"{channels} x {size} x {size}"
        )
    return CheckImages(sample.normalized.to(torch.float32), sample.description)


def choose_check_images(
    check_images: int | Tensor | None,
    meta: dict[str, Any],
    channels: int,
    size: int,
    *,
    description: str | None = None,
    data_dir: str | None = None,
    on_event: EventFn = None,
) -> CheckImages:
    """The parity-check images of a checkpoint's model (inputs ``[N, channels, size, size]``).

    ``check_images``: an int ``n``: the first ``n`` test images of the checkpoint's dataset
    (looked for in ``data_dir``, default ``$CAPSCTL_DATA``), or :data:`SYNTHETIC_IMAGES` seeded
    random images when they are unavailable (a note and a ``warning`` event say why); a tensor:
    these normalized images, described as ``description`` (default ``"N images"``); None: the
    seeded random images without looking for data.
    """
    if check_images is None:
        return CheckImages(_synthetic(channels, size), f"{SYNTHETIC_IMAGES} synthetic images")
    if isinstance(check_images, Tensor):
        return _given(check_images, channels, size, description)
    if isinstance(check_images, bool) or not isinstance(check_images, int) or check_images < 1:
        raise UsageError(f"check images must be at least 1, got {check_images!r}")
    try:
        return _test_images(meta, check_images, channels, size, data_dir)
    except (DataError, UsageError) as e:
        note = f"checking on random images: the test images are not available ({e})"
        emit(on_event, "warning", message=note)
        return CheckImages(
            _synthetic(channels, size), f"{SYNTHETIC_IMAGES} synthetic images", [note]
        )


def parity_batches(images: Tensor) -> list[Tensor]:
    """The check images as one batch of N and one of N + 1 (the first image repeated)."""
    return [images, torch.cat([images, images[:1]])]


def max_abs_diff(outs: list[Tensor], refs: list[Tensor]) -> float:
    """Largest ``|out - ref|`` over all pairs (NaN if any output is NaN)."""
    diffs = [(o.double() - r.double()).abs().max() for o, r in zip(outs, refs, strict=True)]
    return float(torch.stack(diffs).max())


def parity_error(fmt: str, diff: float, tolerance: float, checked_on: str) -> CapsctlError:
    """The error of an artifact that does not match eager PyTorch."""
    return CapsctlError(
        f"{fmt} export does not match PyTorch: max |diff| = {diff:.3g} > tolerance "
        f"{tolerance:g} on {checked_on}; the artifact was not written, report this as a bug"
    )
