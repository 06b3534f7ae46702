"""Checked conversion of decoded image and label arrays into an :class:`ArrayDataset`."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from capsctl.data.dataset import ArrayDataset
from capsctl.errors import DataError

__all__ = ["dataset_from_arrays"]


def dataset_from_arrays(
    images_nhwc: np.ndarray, labels: np.ndarray, classes: Sequence[str], name: str, source: str
) -> ArrayDataset:
    """An ArrayDataset from uint8 ``[N, H, W]``/``[N, H, W, C]`` images and integer labels.

    Images become ``[N, C, H, W]``, labels int64. ``source`` (a path) names the data in the
    :class:`DataError` raised for a wrong dtype or shape or a label outside ``classes``.
    """
    if images_nhwc.dtype != np.uint8:
        raise DataError(f"{source}: images are {images_nhwc.dtype}, expected uint8; fix the file")
    if images_nhwc.ndim == 3:
        images_nhwc = images_nhwc[..., None]
    if images_nhwc.ndim != 4:
        raise DataError(
            f"{source}: images have shape {images_nhwc.shape}, expected [N, H, W, C]; fix the file"
        )
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.shape[0] != images_nhwc.shape[0]:
        raise DataError(
            f"{source}: {images_nhwc.shape[0]} images but labels of shape {labels.shape}; "
            "fix the file"
        )
    if not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"{source}: labels are {labels.dtype}, expected integers; fix the file")
    labels64 = labels.astype(np.int64)
    if labels64.size and (labels64.min() < 0 or labels64.max() >= len(classes)):
        raise DataError(
            f"{source}: labels range {labels64.min()}..{labels64.max()} but there are "
            f"{len(classes)} classes; fix the labels or the class list"
        )
    # [N, H, W, C] -> [N, C, H, W]
    images = torch.from_numpy(np.ascontiguousarray(images_nhwc)).permute(0, 3, 1, 2).contiguous()
    return ArrayDataset(images, torch.from_numpy(labels64), list(classes), name)
