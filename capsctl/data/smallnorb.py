"""smallNORB (LeCun, Huang and Bottou, CVPR 2004): reader, downloader and viewpoint splits.

Files (official names, gzip'd or not): ``smallnorb-5x46789x9x18x6x2x96x96-training-{dat,cat,
info}.mat`` and ``smallnorb-5x01235x9x18x6x2x96x96-testing-{...}.mat``, 24,300 stereo pairs
each. Every file is a "binary matrix": little-endian int32 magic number (0x1E3D4C55 bytes,
0x1E3D4C54 int32, 0x1E3D4C51 float32, 0x1E3D4C53 float64, 0x1E3D4C56 int16), int32 ``ndim``,
``max(3, ndim)`` int32 dimensions (unused ones 1), then the data in C order. ``dat``: uint8
``[N, 2, 96, 96]``; ``cat``: int32 ``[N]`` categories (animal, human, airplane, truck, car);
``info``: int32 ``[N, 4]``: instance, elevation 0..8 (30 to 70 degrees in steps of 5), azimuth
0, 2, ..., 34 (times 10 degrees), lighting 0..5.

Images: the two cameras as two channels, downsampled 96 -> 48 by 2x2 means as Hinton et al.
(ICLR 2018, §5) do.

Viewpoint splits (Hinton, Sabour and Frosst, "Matrix capsules with EM routing", ICLR 2018,
§5.2, followed by SR-CapsNet, Hahn et al., NeurIPS 2019, §4.4):

- ``azimuth``: train on the training images with azimuths 300, 320, 340, 0, 20 and 40 degrees
  (info azimuth 30, 32, 34, 0, 2, 4: one third of the training data), test on the test images
  with the other azimuths, 60 to 280 degrees (two thirds of the test data);
- ``elevation``: train on the 3 lowest elevations (30, 35, 40 degrees: info 0, 1, 2), test on
  the 6 higher ones (45 to 70 degrees: info 3..8).
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch

from capsctl.data.dataset import ArrayDataset
from capsctl.data.download import Remote, download_file
from capsctl.errors import DataError
from capsctl.events import EventFn

__all__ = [
    "AZIMUTH_TRAIN",
    "CLASSES",
    "ELEVATION_TRAIN",
    "FILES",
    "download_smallnorb",
    "load_smallnorb",
    "read_norb_matrix",
    "viewpoint_mask",
]

CLASSES = ["animal", "human", "airplane", "truck", "car"]
MAGIC = {
    0x1E3D4C51: np.dtype("<f4"),
    0x1E3D4C53: np.dtype("<f8"),
    0x1E3D4C54: np.dtype("<i4"),
    0x1E3D4C55: np.dtype("u1"),
    0x1E3D4C56: np.dtype("<i2"),
}
FILES = {
    "train": "smallnorb-5x46789x9x18x6x2x96x96-training",
    "test": "smallnorb-5x01235x9x18x6x2x96x96-testing",
}
URL = "https://cs.nyu.edu/~ylclab/data/norb-v1.0-small/"
AZIMUTH_TRAIN = (30, 32, 34, 0, 2, 4)  # info values: 300..40 degrees
ELEVATION_TRAIN = (0, 1, 2)  # info values: 30, 35, 40 degrees
SPLITS = ("azimuth", "elevation")


def read_norb_matrix(path: str | Path) -> np.ndarray:
    """The array in a smallNORB binary matrix file (``.gz`` read through gzip)."""
    path = Path(path)
    try:
        if path.suffix == ".gz":
            with gzip.open(path) as f:
                raw = f.read()
        else:
            raw = path.read_bytes()
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: cannot read it ({e}); download it again") from None
    if len(raw) < 20:
        raise DataError(f"{path}: too short for a smallNORB header; download it again")
    magic, ndim = (int(v) for v in np.frombuffer(raw, "<i4", 2))
    dtype = MAGIC.get(magic & 0xFFFFFFFF)
    if dtype is None or not 1 <= ndim <= 8:
        raise DataError(
            f"{path}: not a smallNORB matrix (magic {magic:#x}, ndim {ndim}); download it again"
        )
    stored = max(3, ndim)
    dims = [int(d) for d in np.frombuffer(raw, "<i4", stored, 8)][:ndim]
    offset = 8 + 4 * stored
    count = int(np.prod(dims))
    if len(raw) - offset != count * dtype.itemsize:
        raise DataError(
            f"{path}: header says {dims} of {dtype} but the file holds "
            f"{len(raw) - offset} data bytes; download it again"
        )
    return np.frombuffer(raw, dtype, count, offset).reshape(dims)


def _find(folder: Path, stem: str) -> Path | None:
    for name in (f"{stem}.mat", f"{stem}.mat.gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def _read_split(root: Path, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``dat [N, 2, 96, 96]``, ``cat [N]``, ``info [N, 4]`` of the official split."""
    parts = []
    for kind in ("dat", "cat", "info"):
        found = _find(root, f"{FILES[split]}-{kind}")
        if found is None:
            raise DataError(
                f"smallNORB {split} file {FILES[split]}-{kind}.mat[.gz] not found in {root}; "
                "download it (capsctl.data.smallnorb.download_smallnorb) or set CAPSCTL_DATA"
            )
        parts.append(read_norb_matrix(found))
    dat, cat, info = parts
    n = dat.shape[0]
    if dat.ndim != 4 or dat.shape[1] != 2 or cat.shape != (n,) or info.shape != (n, 4):
        raise DataError(
            f"smallNORB {split} files in {root} disagree: dat {dat.shape}, cat {cat.shape}, "
            f"info {info.shape}; download them again"
        )
    return dat, cat, info


def viewpoint_mask(info: np.ndarray, split: str, train: bool) -> np.ndarray:
    """Bool ``[N]``: the images of ``info [N, 4]`` on the ``train`` (or test) side of the
    ``azimuth`` or ``elevation`` split (see the module docstring)."""
    if split == "azimuth":
        inside = np.isin(info[:, 2], AZIMUTH_TRAIN)
    elif split == "elevation":
        inside = np.isin(info[:, 1], ELEVATION_TRAIN)
    else:
        raise DataError(f"unknown smallNORB split {split!r}; use azimuth or elevation")
    return inside if train else ~inside


def _downsample(dat: np.ndarray) -> np.ndarray:
    """``[N, 2, H, W]`` uint8 -> ``[N, 2, H/2, W/2]``, each pixel the rounded 2x2 mean."""
    n, c, h, w = dat.shape
    blocks = dat[:, :, : h // 2 * 2, : w // 2 * 2].reshape(n, c, h // 2, 2, w // 2, 2)
    return np.floor(blocks.mean((3, 5), dtype=np.float64) + 0.5).astype(np.uint8)  # [N,C,H/2,W/2]


def load_smallnorb(root: str | Path, split: str, viewpoint: str | None = None) -> ArrayDataset:
    """smallNORB's ``train`` or ``test`` split from ``root`` as 2x48x48 images; with
    ``viewpoint`` (``azimuth``/``elevation``) only that split's side of the viewpoints."""
    dat, cat, info = _read_split(Path(root), split)
    name = "smallnorb" if viewpoint is None else f"smallnorb-{viewpoint}"
    if viewpoint is not None:
        keep = viewpoint_mask(info, viewpoint, train=split == "train")
        dat, cat = dat[keep], cat[keep]
    if cat.size and (cat.min() < 0 or cat.max() >= len(CLASSES)):
        raise DataError(f"smallNORB {split} categories outside 0..4 in {root}; replace the files")
    images = torch.from_numpy(np.ascontiguousarray(_downsample(dat)))
    return ArrayDataset(images, torch.from_numpy(cat.astype(np.int64)), list(CLASSES), name)


def download_smallnorb(root: str | Path, on_event: EventFn = None) -> list[Path]:
    """Download the six gzip'd files into ``root`` (md5 unknown to capsctl: each file is read
    back and checked as a smallNORB matrix instead). Never called by the tests."""
    paths = []
    for stem in FILES.values():
        for kind in ("dat", "cat", "info"):
            name = f"{stem}-{kind}.mat.gz"
            path = download_file(
                Remote((URL + name,), name, ""), root, what="smallNORB", on_event=on_event
            )
            read_norb_matrix(path)
            paths.append(path)
    return paths
