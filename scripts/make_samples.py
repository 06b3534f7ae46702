"""Write the sample images shipped in ``capsctl/samples/``: a few test images of each bundled
dataset, for ``capsctl predict`` and ``capsctl inspect-routing`` without any download.

    python scripts/make_samples.py [--data-dir ../shared/data]

- ``cifar10/``: the first test image of each class from the lossless CIFAR-10 test images
  (``cifar10/test-lossless-1k.npz``), 32x32 RGB;
- ``fashion-mnist/``: the first test image of each class of the Fashion-MNIST subset shipped in
  the package, 28x28 grey;
- ``multimnist/``: six DiverseMultiMNIST composites (36x36 grey, two overlapping digits) built
  from MNIST's test digits by the same generator as the dataset (seed 0).

Each file is ``<index>-<label>.png`` (``<a>+<b>`` for two digits), so the true class is in its
name. The script overwrites the folder's files; run it only to change the samples.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "capsctl" / "samples"


def _png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def _write(folder: Path, name: str, array: np.ndarray) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.png").write_bytes(_png(array))


def _first_of_each_class(labels: np.ndarray, classes: int) -> list[int]:
    return [int(np.flatnonzero(labels == c)[0]) for c in range(classes)]


def cifar10(data: Path) -> None:
    d = np.load(data / "cifar10" / "test-lossless-1k.npz")
    names = (data / "cifar10" / "classes.txt").read_text().split()
    for i in _first_of_each_class(d["labels"], 10):
        _write(OUT / "cifar10", f"{i:04d}-{names[int(d['labels'][i])]}", d["images"][i])


def fashion_mnist() -> None:
    d = np.load(ROOT / "capsctl" / "data" / "embedded" / "fashion-mnist-quickstart.npz")
    names = [str(c).lower().replace("/", "-").replace(" ", "-") for c in d["classes"]]
    for i in _first_of_each_class(d["test_labels"], 10):
        label = names[int(d["test_labels"][i])]
        _write(OUT / "fashion-mnist", f"{i:04d}-{label}", d["test_images"][i])


def multimnist(data: Path) -> None:
    import torch

    from capsctl.data.arrays import ArrayDataset
    from capsctl.data.idx import read_idx
    from capsctl.data.multimnist import diverse_multimnist

    images = read_idx(data / "mnist" / "t10k-images-idx3-ubyte.gz")[:200]
    labels = read_idx(data / "mnist" / "t10k-labels-idx1-ubyte.gz")[:200]
    mnist = ArrayDataset(
        torch.from_numpy(images.copy())[:, None],
        torch.from_numpy(labels.astype(np.int64)),
        [str(k) for k in range(10)],
        "mnist",
    )
    ds = diverse_multimnist(mnist, 40, seed=0)
    kept = 0
    for i in range(len(ds.labels)):
        a, b = (int(v) for v in ds.labels[i])
        if b < 0 or kept == 6:
            continue  # pairs only: a single digit is the plain MNIST case
        _write(OUT / "multimnist", f"{i:04d}-{a}+{b}", ds.images[i, 0].numpy())
        kept += 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    args = ap.parse_args(argv)
    cifar10(args.data_dir)
    fashion_mnist()
    multimnist(args.data_dir)
    print(f"wrote {sum(1 for _ in OUT.rglob('*.png'))} images under {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
