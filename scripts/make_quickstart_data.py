#!/usr/bin/env python
"""Build capsctl/data/embedded/fashion-mnist-quickstart.npz from the full Fashion-MNIST.

Reads the gzipped IDX files of Debian's ``dataset-fashion-mnist`` package
(``/usr/share/datasets/fashion-mnist``; ``--source`` to use another folder) and writes a
class-balanced subset: train images from the official train split, test images from the
official test split. For each split the images are permuted with
``numpy.random.default_rng(SEED)`` and the first K of each class (in permuted order) are
kept, then put back in their original order. K is the largest candidate in
``CANDIDATES`` (train K, test K // 4 per class) whose compressed file is <= ``--max-bytes``.

The npz holds ``train_images`` uint8 [N, 28, 28], ``train_labels`` uint8 [N],
``test_images``, ``test_labels`` and ``classes`` (unicode). It is written as a zip with
fixed timestamps (deflate level 9), so the same input gives the same bytes with the same
zlib, and atomically (temporary file + rename).

Usage: python scripts/make_quickstart_data.py [--source DIR] [--out FILE] [--max-bytes N]
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from capsctl.data.catalog import FASHION_MNIST_CLASSES  # noqa: E402
from capsctl.data.idx import read_idx  # noqa: E402

SEED = 20170825  # Fashion-MNIST's release date; any fixed value works
CANDIDATES = (1200, 1100, 1000, 900, 800, 700, 600, 500, 400, 300, 200, 100)
DEFAULT_OUT = REPO / "capsctl" / "data" / "embedded" / "fashion-mnist-quickstart.npz"
DEFAULT_SOURCE = Path("/usr/share/datasets/fashion-mnist")


def select(labels: np.ndarray, per_class: int, seed: int) -> np.ndarray:
    """Indices of the first ``per_class`` images of each class after a seeded permutation,
    sorted back into the original order."""
    perm = np.random.default_rng(seed).permutation(labels.shape[0])
    chosen = [perm[labels[perm] == k][:per_class] for k in range(10)]
    for k, c in enumerate(chosen):
        if c.shape[0] < per_class:
            raise SystemExit(f"class {k} has only {c.shape[0]} images, need {per_class}")
    return np.sort(np.concatenate(chosen))


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """An npz (zip of .npy files) with fixed timestamps and order, deflate level 9."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        for key in sorted(arrays):
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            npy = io.BytesIO()
            np.lib.format.write_array(npy, np.ascontiguousarray(arrays[key]), allow_pickle=False)
            zf.writestr(info, npy.getvalue(), compresslevel=9)
    return buf.getvalue()


def read_source(source: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The official splits: ``{"train": (images, labels), "test": (images, labels)}``."""
    return {
        split: (
            read_idx(source / f"{prefix}-images-idx3-ubyte.gz"),
            read_idx(source / f"{prefix}-labels-idx1-ubyte.gz"),
        )
        for split, prefix in (("train", "train"), ("test", "t10k"))
    }


def build(
    full: dict[str, tuple[np.ndarray, np.ndarray]], per_class_train: int
) -> dict[str, np.ndarray]:
    """The arrays of the subset with ``per_class_train`` train and a quarter as many test."""
    out: dict[str, np.ndarray] = {}
    for split, k in (("train", per_class_train), ("test", per_class_train // 4)):
        images, labels = full[split]
        idx = select(labels, k, SEED)
        out[f"{split}_images"] = images[idx]
        out[f"{split}_labels"] = labels[idx].astype(np.uint8)
    out["classes"] = np.array(FASHION_MNIST_CLASSES)
    return out


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same folder and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--max-bytes", type=int, default=4_500_000)
    args = parser.parse_args(argv)
    full = read_source(args.source)
    for k in CANDIDATES:
        data = npz_bytes(build(full, k))
        if len(data) <= args.max_bytes:
            write_atomic(args.out, data)
            sys.stdout.write(
                f"wrote {args.out} ({len(data):,} bytes): {k} train + {k // 4} test images per "
                f"class\n"
            )
            return 0
        sys.stdout.write(f"{k} train/class gives {len(data):,} bytes > {args.max_bytes:,}\n")
    sys.stderr.write("no candidate fits; raise --max-bytes\n")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
