"""Expanded MNIST (Sabour, Frosst and Hinton, NeurIPS 2017, §5.2): each 28x28 MNIST digit
placed at a random position on a black 40x40 canvas.

"Each example is an MNIST digit placed randomly on a black background of 40x40 pixels": the
digit's top-left corner is drawn uniformly among the 13 x 13 positions that keep the whole
28x28 digit on the canvas (offsets -6..6 from the centre in each direction). One image per
MNIST digit, in MNIST's order; offsets come from one CPU ``torch.Generator`` seeded per split
(:data:`SEEDS`), so the set is the same on every machine. Train on it and test on affNIST-style
images (``capsctl robustness --shift affine``, :mod:`capsctl.robustness.shifts`).
"""

from __future__ import annotations

import torch

from capsctl.data.dataset import ArrayDataset
from capsctl.data.multimnist import place_digits

__all__ = ["CANVAS", "SEEDS", "expanded_mnist"]

CANVAS = 40
SEEDS = {"train": 20171026, "test": 20171027}


def expanded_mnist(mnist: ArrayDataset, seed: int, name: str = "expanded-mnist") -> ArrayDataset:
    """``mnist`` (``[N, 1, 28, 28]``) with every digit at a random place on a 40x40 canvas."""
    n, _, h, w = mnist.images.shape
    room = (CANVAS - h) // 2  # 6: the largest shift from the centre that keeps the digit whole
    gen = torch.Generator().manual_seed(int(seed))
    shifts = torch.randint(-room, room + 1, (2, n), generator=gen)  # [2, N]: dy, dx
    digits = mnist.images[:, 0]  # [N, 28, 28]
    canvas = torch.empty(n, CANVAS, CANVAS, dtype=torch.uint8)
    for s in range(0, n, 4096):
        e = min(s + 4096, n)
        canvas[s:e] = place_digits(digits[s:e], shifts[0, s:e], shifts[1, s:e], CANVAS)
    return ArrayDataset(
        canvas[:, None].contiguous(), mnist.labels.clone(), list(mnist.classes), name
    )
