"""Random-pixel stand-ins of real datasets, for dry runs of the benchmark scripts and for tests.

They have the real files' layout (an npz folder that :mod:`capsctl.data` reads like the real
one), so every step of a script runs end to end where the data is absent; the numbers they
give mean nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["write_random_cifar10"]


def write_random_cifar10(root: str | Path, train: int = 64, test: int = 16, seed: int = 0) -> Path:
    """Write ``root/cifar10/{train,test}.npz`` with random 32x32 RGB images and labels; returns
    ``root`` (what ``--data-dir`` or ``data.data_dir`` takes)."""
    rng = np.random.default_rng(seed)
    folder = Path(root) / "cifar10"
    folder.mkdir(parents=True)
    for name, n in (("train", train), ("test", test)):
        np.savez(
            folder / f"{name}.npz",
            images=rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8),  # [n, H, W, C]
            labels=rng.integers(0, 10, n).astype(np.int64),
        )
    return Path(root)
