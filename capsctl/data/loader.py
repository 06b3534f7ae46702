"""Batch iterator over an :class:`ArrayDataset` with on-device, vectorized augmentation."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

from capsctl.data.dataset import ArrayDataset
from capsctl.errors import DataError

__all__ = ["Loader", "epoch_seed"]


def epoch_seed(seed: int, epoch: int) -> int:
    """The 63-bit seed of the generator that draws epoch ``epoch``'s order and augmentation."""
    digest = hashlib.sha256(f"capsctl-loader:{int(seed)}:{int(epoch)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class Loader:
    """Iterates over an ArrayDataset in batches, already on the device.

    The whole uint8 dataset is copied to ``device`` once (CIFAR-10 train: 150 MB); each batch
    is gathered there, augmented there (no per-sample PIL work) and converted to float32
    ``(x / 255 - mean) / std``.

    Reproducibility: the epoch's order and every augmentation draw come from one CPU
    ``torch.Generator`` seeded with :func:`epoch_seed` ``(seed, epoch)``, so they do not
    depend on the global RNG, the device or the batch size. Call
    :meth:`set_epoch` before each epoch (default epoch 0); re-creating the loader and
    calling ``set_epoch(e)`` reproduces epoch ``e`` exactly, which makes training resumable.

    Augmentation (per sample, vectorized over the batch): with ``crop_padding = p > 0`` the
    image is zero-padded by ``p`` pixels on every side *in pixel space* (value 0 = black,
    before normalization, so the padding normalizes to ``-mean/std``) and a random
    ``H x W`` window is cut out (offsets uniform in ``[0, 2p]``); with ``hflip`` each image is
    mirrored left-right with probability 1/2. Both are applied whenever they are enabled,
    independent of ``shuffle``; pass ``crop_padding=0, hflip=False`` for evaluation.

    Sharding: with ``world_size > 1`` and ``drop_last`` (training), rank ``r`` takes the
    ``r``-th slice of every global batch of ``batch_size * world_size`` samples, so the ranks
    together train on exactly the batches (and augmentations) of a single process whose batch
    is the global batch. Otherwise the epoch's permutation is split into ``world_size``
    contiguous, disjoint, equal-size blocks and rank ``rank`` gets block ``rank``. Without
    ``drop_last`` the permutation is first extended by wrapping around so that every rank has
    ``ceil(N / world_size)`` samples (a few samples then appear twice in the epoch); with
    ``drop_last`` each rank gets ``N // world_size`` samples and the batches that would be
    incomplete are dropped too.
    """

    def __init__(
        self,
        ds: ArrayDataset,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int = 0,
        device: str | torch.device = "cpu",
        mean: Sequence[float],
        std: Sequence[float],
        crop_padding: int = 0,
        hflip: bool = False,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if batch_size < 1:
            raise DataError(f"batch size must be at least 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is not in [0, world_size={world_size})")
        if crop_padding < 0:
            raise DataError(f"crop padding must be >= 0, got {crop_padding}")
        channels = ds.images.shape[1]
        if len(mean) != channels or len(std) != channels:
            raise DataError(
                f"normalization has {len(mean)} mean / {len(std)} std values but {ds.name!r} "
                f"has {channels} channel(s); use a matching normalization"
            )
        if any(s <= 0 for s in std):
            raise DataError(f"normalization std must be positive, got {list(std)}")
        n = len(ds)
        if world_size == 1:
            per_rank = n
        elif drop_last:
            per_rank = n // world_size
        else:
            per_rank = math.ceil(n / world_size)
        num_batches = per_rank // batch_size if drop_last else math.ceil(per_rank / batch_size)
        if num_batches == 0:
            ranks = f" on each of {world_size} ranks" if world_size > 1 else ""
            raise DataError(
                f"dataset {ds.name!r} has {n} images: too few for one batch of {batch_size}"
                f"{ranks}; lower the batch size (--batch-size) or give the split more images "
                "(for training: a smaller data.val_size, e.g. --set data.val_size=0)"
            )

        self.dataset = ds
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.device = torch.device(device)
        self.crop_padding = int(crop_padding)
        self.hflip = bool(hflip)
        self.drop_last = bool(drop_last)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.epoch = 0
        # Samples this rank visits per epoch (including wrap-around duplicates).
        self.num_samples = per_rank
        self._num_batches = num_batches
        self._images = ds.images.to(self.device)
        self._labels = ds.labels.to(self.device)
        std_t = torch.tensor([float(s) for s in std], dtype=torch.float32)
        mean_t = torch.tensor([float(m) for m in mean], dtype=torch.float32)
        # (x / 255 - mean) / std == x * scale + shift
        self._scale = (1.0 / (255.0 * std_t)).view(1, -1, 1, 1).to(self.device)
        self._shift = (-mean_t / std_t).view(1, -1, 1, 1).to(self.device)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order and augmentation the next iteration uses."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        """Number of batches per epoch for this rank."""
        return self._num_batches

    def _plan(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's sample indices and crop offsets (y, x) and flip flags, all on CPU."""
        n = len(self.dataset)
        gen = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
        order = torch.randperm(n, generator=gen) if self.shuffle else torch.arange(n)
        total = self.num_samples * self.world_size
        if total > n:
            order = order.repeat(math.ceil(total / n))
        order = order[:total]
        span = 2 * self.crop_padding + 1
        # Draw at least one value per image so that the draws do not depend on world_size.
        draws = max(total, n)
        offsets = torch.randint(0, span, (2, draws), generator=gen)
        flips = torch.randint(0, 2, (draws,), generator=gen).bool()
        if self.world_size > 1 and self.drop_last:
            # Rank r takes the r-th slice of every global batch of batch_size * world_size
            # samples, so the ranks together see exactly the batches of one process.
            g = self.batch_size * self.world_size
            pos = (
                torch.arange(self._num_batches)[:, None] * g
                + self.rank * self.batch_size
                + torch.arange(self.batch_size)[None, :]
            ).flatten()  # [num_batches * batch_size]
            return order[pos], offsets[0, pos], offsets[1, pos], flips[pos]
        block = slice(self.rank * self.num_samples, (self.rank + 1) * self.num_samples)
        return order[block], offsets[0, block], offsets[1, block], flips[block]

    def _augment(
        self, x: torch.Tensor, oy: torch.Tensor, ox: torch.Tensor, flip: torch.Tensor
    ) -> torch.Tensor:
        """Padded random crop and horizontal flip of a uint8 batch, as two gathers."""
        b, c, h, w = x.shape
        p = self.crop_padding
        if p > 0:
            x = F.pad(x, (p, p, p, p), mode="constant", value=0)
            rows = oy[:, None] + torch.arange(h, device=x.device)
            x = x.gather(2, rows[:, None, :, None].expand(b, c, h, w + 2 * p))
        cols = ox[:, None] + torch.arange(w, device=x.device) if p > 0 else None
        if cols is None:
            cols = torch.arange(w, device=x.device).expand(b, w)
        if self.hflip:
            cols = torch.where(flip[:, None], cols.flip(1), cols)
        return x.gather(3, cols[:, None, None, :].expand(b, c, h, w))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield ``(x, y)``: float32 ``[B, C, H, W]`` normalized and int64 ``[B]``, on device."""
        idx, oy, ox, flip = (t.to(self.device) for t in self._plan())
        augment = self.crop_padding > 0 or self.hflip
        for i in range(self._num_batches):
            sl = slice(i * self.batch_size, min((i + 1) * self.batch_size, self.num_samples))
            bi = idx[sl]
            x = self._images.index_select(0, bi)
            if augment:
                x = self._augment(x, oy[sl], ox[sl], flip[sl])
            x = x.to(torch.float32).mul_(self._scale).add_(self._shift)
            yield x, self._labels.index_select(0, bi)
