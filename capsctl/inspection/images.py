"""Which images an inspection looks at: dataset images by index, image files, or random ones.

One of ``indices`` (a list, or text such as ``"0,3,10-12"``), ``image_files`` and ``random``
may be given; with none, the first 8 images of the split. The images themselves come from
capsctl/data/samples.py, normalized as the checkpoint's metadata says.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from capsctl.data.samples import SampleImages, sample_images
from capsctl.errors import UsageError

__all__ = ["parse_indices", "select_images"]


def parse_indices(text: str) -> list[int]:
    """``"0,3,10-12"`` -> ``[0, 3, 10, 11, 12]`` (ranges include both ends)."""
    out: list[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                a, b = part.split("-", 1)
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
