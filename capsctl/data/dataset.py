"""The in-memory dataset type and the operations on it that do not depend on where it came from."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from capsctl.errors import DataError

__all__ = ["ArrayDataset", "fingerprint", "split_train_val", "stratified_val_mask"]


@dataclass
class ArrayDataset:
    """Decoded images and labels held in memory.

    Attributes:
        images: uint8 ``[N, C, H, W]``, contiguous, on the CPU.
        labels: int64 ``[N]`` with values in ``[0, len(classes))``; multi-label datasets use
            ``[N, k]`` (``-1`` marks an unused slot).
        classes: class names, index = label.
        name: dataset name, with the variant in brackets when it matters
            (e.g. ``"cifar10[test-jpeg]"``).
    """

    images: torch.Tensor
    labels: torch.Tensor
    classes: list[str]
    name: str

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.dim() != 4:
            raise DataError(
                f"dataset {self.name!r}: images must be uint8 [N, C, H, W], got "
                f"{self.images.dtype} {list(self.images.shape)}"
            )
        if self.labels.dtype != torch.int64 or self.labels.dim() not in (1, 2):
            raise DataError(
                f"dataset {self.name!r}: labels must be int64 [N] (or [N, k] for several "
                "labels per image, -1 = none), got "
                f"{self.labels.dtype} {list(self.labels.shape)}"
            )
        if self.labels.shape[0] != self.images.shape[0]:
            raise DataError(
                f"dataset {self.name!r}: {self.images.shape[0]} images but "
                f"{self.labels.shape[0]} labels"
            )
        if self.images.device.type != "cpu" or self.labels.device.type != "cpu":
            raise DataError(f"dataset {self.name!r}: tensors must be on the CPU")
        if not self.images.is_contiguous():
            self.images = self.images.contiguous()

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def multi_label(self) -> bool:
        """True when every image carries several labels (``labels`` is ``[N, k]``)."""
        return self.labels.dim() == 2

    @property
    def num_classes(self) -> int:
        """Number of classes (``len(classes)``)."""
        return len(self.classes)

    def subset(self, idx: torch.Tensor) -> ArrayDataset:
        """A new dataset holding the rows ``idx`` (int64 indices or a bool mask); data is copied."""
        idx = torch.as_tensor(idx)
        if idx.dtype != torch.bool:
            idx = idx.to(torch.int64)
        return ArrayDataset(
            images=self.images[idx].contiguous(),
            labels=self.labels[idx].contiguous(),
            classes=list(self.classes),
            name=self.name,
        )


def split_train_val(
    ds: ArrayDataset, val_size: int, seed: int
) -> tuple[ArrayDataset, ArrayDataset]:
    """Split ``ds`` into (train, val) with ``val_size`` images in val, stratified by class.

    Each class contributes to val in proportion to its size (largest-remainder rounding, so
    the total is exactly ``val_size``); which images go is drawn with ``torch.randperm`` on a
    CPU ``torch.Generator`` seeded with ``seed``, so the split is the same on every machine
    and independent of the global RNG. Both parts keep the original order of ``ds``.
    ``val_size == 0`` gives an empty val set.

    A dataset composed from source items (DiverseMultiMNIST: its images share MNIST digits)
    has a ``split_by_source(val_size, seed)`` method; for ``val_size > 0`` it is used instead,
    so that no source item is on both sides (see :mod:`capsctl.data.multimnist`).
    """
    n = len(ds)
    if not 0 <= val_size < n:
        raise DataError(
            f"val_size {val_size} is not in [0, {n}) for dataset {ds.name!r}; choose a smaller "
            "validation size"
        )
    by_source = getattr(ds, "split_by_source", None)
    if by_source is not None and val_size > 0:
        return by_source(val_size, seed)
    labels = ds.labels if ds.labels.dim() == 1 else ds.labels[:, 0]  # stratify on the first label
    is_val = stratified_val_mask(labels, ds.num_classes, val_size, seed)  # [N]
    return ds.subset(~is_val), ds.subset(is_val)


def stratified_val_mask(
    labels: torch.Tensor, num_classes: int, val_size: int, seed: int
) -> torch.Tensor:
    """Bool mask ``[N]`` over int64 ``labels [N]`` marking ``val_size`` items, stratified.

    Each class gets a share of ``val_size`` in proportion to its size (largest-remainder
    rounding, ties to the lower class index); within class ``k`` (in increasing ``k``) the
    items are drawn by ``torch.randperm`` on a CPU generator seeded with ``seed``.
    """
    n = int(labels.numel())
    if n:
        num_classes = max(int(labels.max()) + 1, num_classes)
    counts = torch.bincount(labels, minlength=num_classes).tolist()
    # Largest-remainder allocation of val_size over classes.
    exact = [val_size * c / n for c in counts] if n else [0.0] * num_classes
    take = [int(e) for e in exact]
    short = val_size - sum(take)
    order = sorted(range(num_classes), key=lambda k: (-(exact[k] - take[k]), k))
    for k in order[:short]:
        take[k] += 1

    gen = torch.Generator().manual_seed(int(seed))
    is_val = torch.zeros(n, dtype=torch.bool)
    for k in range(num_classes):
        if take[k] == 0:
            continue
        members = torch.nonzero(labels == k, as_tuple=True)[0]
        chosen = members[torch.randperm(members.numel(), generator=gen)[: take[k]]]
        is_val[chosen] = True
    return is_val


_CHUNK = 1 << 24  # 16 MiB


def fingerprint(ds: ArrayDataset) -> str:
    """Short (16 hex digits) sha256 over the shapes, image bytes and label bytes of ``ds``.

    Class names and the dataset name are not included: two datasets with the same pixels
    and labels in the same order have the same fingerprint.
    """
    h = hashlib.sha256()
    h.update(f"capsctl-data-v1 {list(ds.images.shape)} {list(ds.labels.shape)}".encode())
    for t in (ds.images, ds.labels):
        buf = memoryview(t.contiguous().numpy()).cast("B")
        for start in range(0, len(buf), _CHUNK):
            h.update(buf[start : start + _CHUNK])
    return h.hexdigest()[:16]
