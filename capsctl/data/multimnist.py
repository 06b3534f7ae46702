"""DiverseMultiMNIST (Tsai et al. 2020, §5): overlapping digit pairs on a 36x36 canvas.

Each image is built from MNIST digits: with probability 1/6 one digit, otherwise two digits of
*different* classes. Each digit (28x28) is placed on a 36x36 canvas at the centre shifted by up
to ``shift`` = 4 pixels in each direction (uniform integers in [-4, 4]), and the two digits are
combined by a pixel-wise maximum. Labels are int64 ``[N, 2]``: the two classes, or the class and
``-1`` for a single digit.

The generator is deterministic: image ``i`` depends only on ``(seed, i)`` through one
``torch.Generator``, so the same call gives the same images on every machine. The training set
uses every MNIST training image once as the first digit (``n`` = 60,000 by default); the test
set is built from the MNIST test images with another seed.
"""

from __future__ import annotations

import torch

from capsctl.data.dataset import ArrayDataset

CANVAS = 36
SHIFT = 4
SINGLE_FRACTION = 1.0 / 6.0
SEEDS = {"train": 20200101, "test": 20200202}


def _place(digits: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, canvas: int) -> torch.Tensor:
    """Digits ``[n, 28, 28]`` on an empty ``canvas`` at the centre shifted by ``(dy, dx)``."""
    n, h, w = digits.shape
    top = (canvas - h) // 2 + dy  # [n]
    left = (canvas - w) // 2 + dx  # [n]
    rows = torch.arange(canvas)[None, :] - top[:, None]  # [n, canvas]: source row per target row
    cols = torch.arange(canvas)[None, :] - left[:, None]  # [n, canvas]
    valid = ((rows >= 0) & (rows < h))[:, :, None] & ((cols >= 0) & (cols < w))[:, None, :]
    r = rows.clamp(0, h - 1)[:, :, None].expand(n, canvas, canvas)  # [n, canvas, canvas]
    c = cols.clamp(0, w - 1)[:, None, :].expand(n, canvas, canvas)  # [n, canvas, canvas]
    flat = digits.reshape(n, h * w)  # [n, 28*28]
    out = flat.gather(1, (r * w + c).reshape(n, -1)).view(n, canvas, canvas)  # [n, canvas, canvas]
    return out * valid


def diverse_multimnist(
    mnist: ArrayDataset, n: int | None = None, *, seed: int = 0, name: str = "diverse-multimnist"
) -> ArrayDataset:
    """Build ``n`` DiverseMultiMNIST images from an MNIST split (default: one per image)."""
    count = len(mnist) if n is None else int(n)
    gen = torch.Generator().manual_seed(int(seed))
    digits = mnist.images[:, 0]  # [N, 28, 28]
    labels = mnist.labels
    total = len(mnist)
    first = (
        torch.arange(count) % total
        if n is None
        else torch.randint(0, total, (count,), generator=gen)
    )
    pair = torch.rand(count, generator=gen) >= SINGLE_FRACTION
    second = torch.randint(0, total, (count,), generator=gen)
    clash = pair & (labels[second] == labels[first])
    while bool(clash.any()):  # redraw second digits of the same class
        second[clash] = torch.randint(0, total, (int(clash.sum()),), generator=gen)
        clash = pair & (labels[second] == labels[first])
    shifts = torch.randint(-SHIFT, SHIFT + 1, (4, count), generator=gen)
    images = torch.empty(count, 1, CANVAS, CANVAS, dtype=torch.uint8)
    step = 8192
    for s in range(0, count, step):
        e = min(count, s + step)
        a = _place(digits[first[s:e]], shifts[0, s:e], shifts[1, s:e], CANVAS)  # [n, 36, 36]
        b = _place(digits[second[s:e]], shifts[2, s:e], shifts[3, s:e], CANVAS)  # [n, 36, 36]
        b = b * pair[s:e, None, None]
        images[s:e, 0] = torch.maximum(a, b)
    y = torch.stack(
        [labels[first], torch.where(pair, labels[second], torch.full_like(labels[first], -1))], 1
    )
    return ArrayDataset(images.contiguous(), y.contiguous(), list(mnist.classes), name)


def multi_hot(y: torch.Tensor, classes: int) -> torch.Tensor:
    """``[B, 2]`` labels (``-1`` = none) or ``[B]`` labels as a float multi-hot ``[B, classes]``."""
    if y.dim() == 1:
        return torch.nn.functional.one_hot(y, classes).float()
    hot = torch.zeros(y.shape[0], classes + 1, device=y.device)
    hot.scatter_(
        1, torch.where(y < 0, classes, y), 1.0
    )  # [B, classes + 1]: -1 goes to a spare slot
    return hot[:, :classes]


def top2_correct(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The paper's metric, per image: for a pair, the top-2 classes equal the two labels; for a
    single digit, the top-1 class equals the label. ``logits [B, C]``, ``y [B, 2]``."""
    top2 = logits.topk(2, dim=1).indices  # [B, 2]
    single = y[:, 1] < 0
    pair_ok = ((top2[:, :1] == y[:, :1]) | (top2[:, 1:] == y[:, :1])).squeeze(1) & (
        (top2[:, :1] == y[:, 1:]) | (top2[:, 1:] == y[:, 1:])
    ).squeeze(1)
    single_ok = top2[:, 0] == y[:, 0]
    return torch.where(single, single_ok, pair_ok)
