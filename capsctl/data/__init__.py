"""Datasets for capsctl: finding/downloading/decoding them and iterating in device batches.

Public API::

    ArrayDataset, load_dataset, resolve_data_dir, find_test_files,
    split_train_val, fingerprint, Loader,
    DATASETS, DatasetInfo, dataset_info, NORMALIZATION, normalization_for

``DATASETS``, ``DatasetInfo``, ``dataset_info``, ``NORMALIZATION`` and ``normalization_for``
live in :mod:`capsctl.data.catalog`, which does not import torch; everything else is loaded
on first use so that ``import capsctl.data`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from capsctl.data.catalog import (
    DATASETS,
    NORMALIZATION,
    DatasetInfo,
    dataset_info,
    normalization_for,
)

__all__ = [
    "DATASETS",
    "NORMALIZATION",
    "ArrayDataset",
    "DatasetInfo",
    "Loader",
    "dataset_info",
    "find_test_files",
    "fingerprint",
    "load_dataset",
    "normalization_for",
    "resolve_data_dir",
    "split_train_val",
]

if TYPE_CHECKING:  # pragma: no cover
    from capsctl.data.dataset import ArrayDataset, fingerprint, split_train_val
    from capsctl.data.loader import Loader
    from capsctl.data.sources import find_test_files, load_dataset, resolve_data_dir


def __getattr__(name: str) -> Any:
    """The names that need torch, imported on first use."""
    if name in ("ArrayDataset", "fingerprint", "split_train_val"):
        from capsctl.data import dataset

        return getattr(dataset, name)
    if name == "Loader":
        from capsctl.data.loader import Loader

        return Loader
    if name in ("find_test_files", "load_dataset", "resolve_data_dir"):
        from capsctl.data import sources

        return getattr(sources, name)
    raise AttributeError(f"module 'capsctl.data' has no attribute {name!r}")
