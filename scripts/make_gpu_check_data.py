#!/usr/bin/env python
"""Build the CIFAR-10 subset that travels with the code to a GPU machine (scripts/gpu_check.py).

    python scripts/make_gpu_check_data.py                    # from $CAPSCTL_DATA into gpu-data/
    python scripts/make_gpu_check_data.py --data /srv/data --out gpu-data --train 15000

Reads CIFAR-10 from the data root ``--data`` (default ``$CAPSCTL_DATA``) the way capsctl does
(``cifar-10-batches-py/`` or an npz folder ``cifar10/``; nothing is downloaded) and writes
``OUT/cifar10/``, a folder capsctl's CIFAR-10 loader reads (``data.data_dir=OUT``):

- ``train.npz``: ``--train`` training images, class-balanced: the first ``N / 10`` images of
  each class in the original order, kept in that order (the first 15,000 by default, 1,500 a
  class);
- ``test-lossless-1k.npz``: test images 0-999, exact (from an exact test file of the source:
  ``test.npz``, ``test-lossless.npz``, ``test-lossless-1k.npz`` or the python batches; a source
  with only lossy test images is refused);
- ``classes.txt`` and ``subset.json`` (what was taken from where, image counts, bytes).

Each npz holds ``images`` uint8 ``[N, 32, 32, 3]`` and ``labels`` uint8 ``[N]``, like the
shared files, deflate level 9 with fixed timestamps (the same input gives the same bytes),
written atomically. The default folder is about 43 MiB: it fits, with the code, in the
64 MiB that may travel to the GPU machine. The folder ``gpu-data/`` is ignored by git.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from capsctl.atomic import write_atomic, write_text_atomic  # noqa: E402
from capsctl.data.cifar import load_cifar  # noqa: E402
from capsctl.errors import CapsctlError  # noqa: E402

NAME = "cifar10"
TEST_IMAGES = 1000
TEST_FILE = "test-lossless-1k.npz"
# Test sets capsctl's loader names when they come from exact files (cifar.NPZ_TEST_PREFERENCE;
# "cifar10" itself is test.npz or the python batches).
EXACT_TEST_SETS = ("cifar10", "cifar10[test-lossless]", "cifar10[test-lossless-1k]")


def first_per_class(labels: np.ndarray, per_class: int, classes: int) -> np.ndarray:
    """Indices of the first ``per_class`` images of each class, in the original order."""
    chosen = []
    for k in range(classes):
        idx = np.flatnonzero(labels == k)[:per_class]
        if idx.shape[0] < per_class:
            raise SystemExit(f"class {k} has only {idx.shape[0]} training images, need {per_class}")
        chosen.append(idx)
    return np.sort(np.concatenate(chosen))


def npz_bytes(images: np.ndarray, labels: np.ndarray) -> bytes:
    """An npz of ``images`` and ``labels`` with fixed timestamps and order, deflate level 9."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        for key, array in (("images", images), ("labels", labels)):
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            npy = io.BytesIO()
            np.lib.format.write_array(npy, np.ascontiguousarray(array), allow_pickle=False)
            zf.writestr(info, npy.getvalue(), compresslevel=9)
    return buf.getvalue()


def as_arrays(ds: object) -> tuple[np.ndarray, np.ndarray]:
    """uint8 ``[N, H, W, C]`` images and uint8 labels of a capsctl ArrayDataset."""
    images = ds.images.permute(0, 2, 3, 1).contiguous().numpy()  # type: ignore[attr-defined]
    labels = ds.labels.numpy().astype(np.uint8)  # type: ignore[attr-defined]
    return images, labels


def build(root: Path, out: Path, train_images: int) -> dict[str, dict[str, Any]]:
    """Write ``out/cifar10/`` from the data root ``root``; the manifest (also subset.json)."""
    if train_images < 10 or train_images % 10:
        raise SystemExit(f"--train must be a positive multiple of 10, got {train_images}")
    train, train_from = load_cifar(NAME, "train", root, None, download=False, on_event=None)
    test, test_from = load_cifar(NAME, "test", root, None, download=False, on_event=None)
    if test.name not in EXACT_TEST_SETS:
        raise SystemExit(
            f"the test images in {test_from} are {test.name}, not exact; gpu_check needs "
            f"test-lossless-1k.npz (or test.npz or cifar-10-batches-py/) in the source"
        )
    images, labels = as_arrays(train)
    idx = first_per_class(labels, train_images // 10, len(train.classes))
    test_images, test_labels = (a[:TEST_IMAGES] for a in as_arrays(test))

    folder = out / NAME
    folder.mkdir(parents=True, exist_ok=True)
    train_bytes = npz_bytes(images[idx], labels[idx])
    test_bytes = npz_bytes(test_images, test_labels)
    write_atomic(folder / "train.npz", train_bytes)
    write_atomic(folder / TEST_FILE, test_bytes)
    write_text_atomic(folder / "classes.txt", "\n".join(train.classes) + "\n")
    manifest: dict[str, dict[str, Any]] = {
        "train": {
            "file": "train.npz",
            "images": int(idx.shape[0]),
            "per_class": train_images // 10,
            "of": int(labels.shape[0]),
            "rule": "the first images of each class in the original order",
            "last_index": int(idx[-1]),
            "from": train_from,
            "bytes": len(train_bytes),
        },
        "test": {
            "file": TEST_FILE,
            "images": int(test_labels.shape[0]),
            "rule": f"test images 0-{test_labels.shape[0] - 1}, exact",
            "from": f"{test_from} ({test.name})",
            "bytes": len(test_bytes),
        },
    }
    write_text_atomic(folder / "subset.json", json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="the data root (default: $CAPSCTL_DATA)")
    parser.add_argument("--out", type=Path, default=Path("gpu-data"), help="default: gpu-data/")
    parser.add_argument("--train", type=int, default=15000, help="training images (x10)")
    args = parser.parse_args(argv)
    env = os.environ.get("CAPSCTL_DATA")
    root = args.data or (Path(env) if env else None)
    if root is None:
        parser.error("give --data DIR or set CAPSCTL_DATA")
    try:
        manifest = build(root, args.out, args.train)
    except CapsctlError as e:
        sys.stderr.write(f"make_gpu_check_data: {e}\n")
        return 1
    train, test = manifest["train"], manifest["test"]
    sys.stdout.write(
        f"wrote {args.out / NAME}: {train['images']:,} training and {test['images']:,} exact "
        f"test images, {(train['bytes'] + test['bytes']) / 2**20:.1f} MiB\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
