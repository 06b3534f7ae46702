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

Validation split. :func:`diverse_multimnist` returns a :class:`CompositeDataset`, which keeps
the MNIST digits it was composed from and, per image, the indices of its two source digits.
:func:`capsctl.data.split_train_val` on such a dataset does not pick composites (that would put
an MNIST digit in a validation image and again in training images, as a second digit or even
as the first digit of another image, so validation accuracy would be optimistic and the
best-epoch choice would leak). It holds out source digits instead
(:meth:`CompositeDataset.split_by_source`): ``val_size`` of the MNIST training digits, stratified
by class and drawn with the split seed exactly as :func:`~capsctl.data.split_train_val` draws
images, and then composes the validation set only from the held-out digits (first and second
digits) and the training set only from the others, each with its own seed derived from the
dataset's seed and the split seed. With the default one image per digit, the training part has
``N - val_size`` images (one per remaining digit) and the validation part ``val_size`` images
(one per held-out digit); no MNIST digit appears on both sides. The parts are new composites,
not rows of the full set, and the same ``(val_size, seed)`` always gives the same parts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from capsctl.data.dataset import ArrayDataset, stratified_val_mask
from capsctl.errors import DataError

CANVAS = 36
SHIFT = 4
SINGLE_FRACTION = 1.0 / 6.0
SEEDS = {"train": 20200101, "test": 20200202}


def place_digits(
    digits: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, canvas: int
) -> torch.Tensor:
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


@dataclass
class CompositeDataset(ArrayDataset):
    """A DiverseMultiMNIST dataset that remembers how it was composed.

    Attributes (besides those of :class:`ArrayDataset`):
        digits: the MNIST dataset the digits come from (not copied).
        pool: int64 ``[P]``, the indices into ``digits`` this dataset was allowed to use.
        first: int64 ``[N]``, index into ``digits`` of each image's first digit.
        second: int64 ``[N]``, index into ``digits`` of each image's second digit (``-1`` for a
            single digit).
        seed: the generator seed.
        count: the ``n`` it was built with (``None``: one image per digit of ``pool``).
    """

    digits: ArrayDataset = field(repr=False)
    pool: torch.Tensor = field(repr=False)
    first: torch.Tensor = field(repr=False)
    second: torch.Tensor = field(repr=False)
    seed: int = 0
    count: int | None = None

    def split_by_source(
        self, val_size: int, seed: int
    ) -> tuple[CompositeDataset, CompositeDataset]:
        """(train, val) composed from disjoint source digits; see the module docstring.

        ``val_size`` digits of ``pool`` are held out (stratified by class, drawn with ``seed``)
        and composed into ``val_size`` validation images; the remaining digits are composed
        into ``len(self) - val_size`` training images.
        """
        n = len(self)
        if not 0 < val_size < min(n, int(self.pool.numel())):
            raise DataError(
                f"val_size {val_size} is not in [1, {min(n, int(self.pool.numel()))}) for "
                f"dataset {self.name!r}; choose a smaller validation size"
            )
        labels = self.digits.labels[self.pool]  # [P]
        held = stratified_val_mask(labels, self.digits.num_classes, val_size, seed)  # [P]
        train_n = None if self.count is None else n - val_size
        val_n = None if self.count is None else val_size
        train = diverse_multimnist(
            self.digits,
            train_n,
            seed=_part_seed(self.seed, seed, "train"),
            name=self.name,
            pool=self.pool[~held],
        )
        val = diverse_multimnist(
            self.digits,
            val_n,
            seed=_part_seed(self.seed, seed, "val"),
            name=self.name,
            pool=self.pool[held],
        )
        return train, val


def _part_seed(dataset_seed: int, split_seed: int, part: str) -> int:
    """A generator seed for one part of a split, fixed by the two seeds and the part's name."""
    text = f"diverse-multimnist split {int(dataset_seed)} {int(split_seed)} {part}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def diverse_multimnist(
    mnist: ArrayDataset,
    n: int | None = None,
    *,
    seed: int = 0,
    name: str = "diverse-multimnist",
    pool: torch.Tensor | None = None,
) -> CompositeDataset:
    """Build ``n`` DiverseMultiMNIST images from an MNIST split (default: one per image).

    ``pool`` (int64 indices into ``mnist``) restricts both digits of every image to those
    MNIST images; without it every image may be used. With ``n=None`` each digit of the pool
    is the first digit of exactly one image, in pool order; otherwise first digits are drawn
    from the pool at random.
    """
    total = len(mnist)
    src = torch.arange(total) if pool is None else torch.as_tensor(pool, dtype=torch.int64)
    size = int(src.numel())
    count = size if n is None else int(n)
    if size == 0:
        raise DataError(f"dataset {name!r}: no MNIST digits to compose images from")
    gen = torch.Generator().manual_seed(int(seed))
    digits = mnist.images[:, 0]  # [N, 28, 28]
    labels = mnist.labels
    first = (
        src[torch.arange(count) % size]
        if n is None
        else src[torch.randint(0, size, (count,), generator=gen)]
    )
    pair = torch.rand(count, generator=gen) >= SINGLE_FRACTION
    if bool(pair.any()) and int(labels[src].unique().numel()) < 2:
        raise DataError(
            f"dataset {name!r}: two-digit images need digits of at least two classes, but the "
            f"{size} source digits have one; use more digits (e.g. a larger validation size)"
        )
    second = src[torch.randint(0, size, (count,), generator=gen)]
    clash = pair & (labels[second] == labels[first])
    while bool(clash.any()):  # redraw second digits of the same class
        second[clash] = src[torch.randint(0, size, (int(clash.sum()),), generator=gen)]
        clash = pair & (labels[second] == labels[first])
    shifts = torch.randint(-SHIFT, SHIFT + 1, (4, count), generator=gen)
    images = torch.empty(count, 1, CANVAS, CANVAS, dtype=torch.uint8)
    step = 8192
    for s in range(0, count, step):
        e = min(count, s + step)
        a = place_digits(digits[first[s:e]], shifts[0, s:e], shifts[1, s:e], CANVAS)  # [n, 36, 36]
        b = place_digits(digits[second[s:e]], shifts[2, s:e], shifts[3, s:e], CANVAS)  # [n, 36, 36]
        b = b * pair[s:e, None, None]
        images[s:e, 0] = torch.maximum(a, b)
    none = torch.full_like(first, -1)
    y = torch.stack([labels[first], torch.where(pair, labels[second], none)], 1)  # [n, 2]
    return CompositeDataset(
        images.contiguous(),
        y.contiguous(),
        list(mnist.classes),
        name,
        digits=mnist,
        pool=src,
        first=first,
        second=torch.where(pair, second, none),
        seed=int(seed),
        count=None if n is None else count,
    )
