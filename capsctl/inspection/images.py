"""Which images an inspection looks at: dataset images by index, image files, or random ones.

One of ``indices`` (a list, or text such as ``"0,3,10-12"``), ``image_files`` and ``random``
may be given; with none, the first 8 images of the split. The images themselves come from
capsctl/data/samples.py, normalized as the checkpoint's metadata says.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from capsctl.data.samples import SampleImages, normalize_images, sample_images
from capsctl.errors import UsageError

__all__ = ["batches", "check_random", "parse_indices", "random_batches", "select_images"]


def parse_indices(text: str) -> list[int]:
    """``"0,3,10-12"`` -> ``[0, 3, 10, 11, 12]`` (ranges include both ends)."""
    out: list[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                a, b = part.split("-", 1)
                if int(b) < int(a):
                    raise UsageError(
                        f"--indices {text}: the range {part} goes down; write it as {b}-{a}"
                    )
                out.extend(range(int(a), int(b) + 1))
            elif part:
                out.append(int(part))
    except ValueError:
        raise UsageError(f"--indices {text}: expected numbers and ranges like 0,3,10-12") from None
    return out


def select_images(
    meta: dict[str, Any],
    *,
    split: str = "test",
    indices: str | Sequence[int] | None = None,
    image_files: Sequence[str | Path] | None = None,
    random: int | None = None,
    data_dir: str | None = None,
    seed: int = 0,
) -> SampleImages:
    """The images for a checkpoint with metadata ``meta`` (module docstring).

    Raises :class:`UsageError` when more than one source is given or an index is bad.
    """
    given = [x is not None and x != [] for x in (indices, image_files, random)]
    if sum(given) > 1:
        raise UsageError("choose one of --indices, --image and --random")
    wanted = parse_indices(indices) if isinstance(indices, str) else indices
    return sample_images(
        meta,
        split=split,
        indices=None if wanted is None else list(wanted),
        files=[Path(f) for f in image_files] if image_files else None,
        random=random,
        data_dir=data_dir,
        seed=seed,
    )


def check_random(random: int | None) -> None:
    """:class:`UsageError` for a ``--random`` count below 1."""
    if random is not None and random < 1:
        raise UsageError(f"--random {random}: expected a number of images of at least 1")


def random_batches(
    meta: dict[str, Any], count: int, seed: int, size: int
) -> Iterator[SampleImages]:
    """The images of ``sample_images(meta, random=count, seed=seed)`` in batches of ``size``:
    the same images (one generator, drawn in order), never more than a batch in memory."""
    check_random(count)
    norm = meta.get("normalization") or {}
    mean, std = list(norm.get("mean", [0.0])), list(norm.get("std", [1.0]))
    channels = int(meta.get("in_channels", len(mean)))
    side = int(meta.get("input_size", 32))
    if len(mean) != channels:
        mean, std = mean[:1] * channels, std[:1] * channels
    g = torch.Generator().manual_seed(seed)
    for b0 in range(0, count, size):
        shape = (min(size, count - b0), channels, side, side)
        raw = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)  # [b, C, H, W]
        yield SampleImages(normalize_images(raw, mean, std), raw, None, f"{count} random images")


def batches(sample: SampleImages, size: int) -> Iterator[SampleImages]:
    """``sample`` in batches of ``size`` images (views, no copies)."""
    n = sample.normalized.shape[0]
    for b0 in range(0, n, size):
        labels = None if sample.labels is None else sample.labels[b0 : b0 + size]
        part = (sample.normalized[b0 : b0 + size], sample.raw[b0 : b0 + size])
        yield SampleImages(part[0], part[1], labels, sample.description)
