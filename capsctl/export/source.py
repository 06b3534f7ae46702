"""The checkpoint being exported, loaded once: metadata, tensors, model and its reference logits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from capsctl.checkpoint import load_tensors, model_from_tensors
from capsctl.events import EventFn
from capsctl.export.parity import CheckImages, choose_check_images, parity_batches

__all__ = ["ExportSource", "load_source"]


@dataclass
class ExportSource:
    """A loaded checkpoint and the eager reference the artifact is compared with.

    ``tensors``: the checkpoint's tensors (for a model folder: under ``model.`` names);
    ``model``: rebuilt from them, on the CPU in eval mode; ``channels``/``size``: its input
    ``[N, channels, size, size]``; ``batches``: the check images as batches of N and N + 1
    (:func:`capsctl.export.parity.parity_batches`); ``refs``: the model's logits on them.
    """

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, Tensor]
    model: nn.Module
    channels: int
    size: int
    check: CheckImages
    batches: list[Tensor]
    refs: list[Tensor]

    @property
    def batch_sizes(self) -> list[int]:
        return [int(b.shape[0]) for b in self.batches]


def load_source(
    ckpt: Path,
    metadata: dict[str, Any],
    check_images: int | Tensor | None,
    *,
    check_description: str | None = None,
    data_dir: str | None = None,
    on_event: EventFn = None,
) -> ExportSource:
    """Load ``ckpt`` (its ``metadata`` already read, so its header is not read again).

    The model's input size comes from the metadata (``in_channels``, ``input_size``), else
    from its configuration. ``check_images`` etc.: see
    :func:`capsctl.export.parity.choose_check_images`.
    """
    tensors = load_tensors(ckpt, validate=False)
    model = model_from_tensors(ckpt, metadata, tensors)
    config = getattr(model, "config", None)
    channels = int(metadata.get("in_channels") or getattr(config, "in_channels", 3))
    size = int(metadata.get("input_size") or getattr(config, "input_size", 32))
    check = choose_check_images(
        check_images,
        metadata,
        channels,
        size,
        description=check_description,
        data_dir=data_dir,
        on_event=on_event,
    )
    batches = parity_batches(check.images)
    with torch.no_grad():
        refs = [model(b) for b in batches]
    return ExportSource(ckpt, metadata, tensors, model, channels, size, check, batches, refs)
