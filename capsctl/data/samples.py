"""Inputs for a checkpoint's model: dataset images by index, image files, or random images.

Used by ``capsctl export`` (parity checks) and ``capsctl inspect-routing``: the checkpoint's
metadata says which dataset, split, normalization and input size the model expects.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from capsctl.checkpoint import stored_preset
from capsctl.errors import UsageError

__all__ = ["SampleImages", "normalize_images", "sample_images"]


@dataclass
class SampleImages:
    """Images ready for a model (``normalized``) and for pictures (``raw`` uint8)."""

    normalized: Tensor  # float32 [N, C, H, W]
    raw: Tensor  # uint8 [N, C, H, W]
    labels: Tensor | None  # int64 [N]
    description: str


def normalize_images(raw: Tensor, mean: list[float], std: list[float]) -> Tensor:
    m = torch.tensor(mean).view(1, -1, 1, 1)
    s = torch.tensor(std).view(1, -1, 1, 1)
    return (raw.float() / 255.0 - m) / s


def sample_images(
    meta: dict[str, Any],
    *,
    split: str = "test",
    indices: list[int] | None = None,
    files: list[Path] | None = None,
    random: int | None = None,
    data_dir: str | None = None,
    seed: int = 0,
) -> SampleImages:
    """Inputs for a checkpoint: dataset images by index, image files, or a seeded random batch."""
    norm = meta.get("normalization") or {}
    mean, std = list(norm.get("mean", [0.0])), list(norm.get("std", [1.0]))
    channels = int(meta.get("in_channels", len(mean)))
    size = int(meta.get("input_size", 32))
    if len(mean) != channels:
        mean, std = mean[:1] * channels, std[:1] * channels
    if files:
        from capsctl.data.images import read_image_file

        raw = torch.stack([read_image_file(f, channels, size) for f in files])
        return SampleImages(
            normalize_images(raw, mean, std), raw, None, f"{len(files)} image file(s)"
        )
    if random is not None:
        g = torch.Generator().manual_seed(seed)
        raw = torch.randint(0, 256, (random, channels, size, size), generator=g, dtype=torch.uint8)
        return SampleImages(
            normalize_images(raw, mean, std), raw, None, f"{random} random images (seed {seed})"
        )
    preset = stored_preset(meta, Path("checkpoint"))
    if data_dir is not None:
        preset.data.data_dir = data_dir
    if split not in ("train", "val", "test"):
        raise UsageError(f"--split {split}: expected train, val or test")
    from capsctl.data import load_dataset, split_train_val

    d = preset.data
    if split == "test":
        ds = load_dataset(d.dataset, "test", d.data_dir, test_file=d.test_file, download=False)
    else:
        full = load_dataset(d.dataset, "train", d.data_dir, download=False)
        if d.val_size > 0:
            tr, va = split_train_val(full, d.val_size, preset.train.seed)
            ds = va if split == "val" else tr
        else:
            ds = full
    idx = indices if indices else list(range(min(8, len(ds))))
    bad = [i for i in idx if not 0 <= i < len(ds)]
    if bad:
        raise UsageError(
            f"--indices {bad[0]}: out of range for the {split} split ({len(ds)} images)"
        )
    sel = torch.tensor(idx)
    raw = ds.images[sel]
    return SampleImages(
        normalize_images(raw, mean, std),
        raw,
        ds.labels[sel],
        f"{len(idx)} {split} images of {ds.name} "
        f"(indices {idx[:8]}{'...' if len(idx) > 8 else ''})",
    )
