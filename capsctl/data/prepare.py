"""The data of a run: a preset's dataset with its seeded validation split and its test split.

The training images are split into train and validation with the run's seed (validation is
held out from training; for composite datasets the source images are held out, see
:func:`capsctl.data.dataset.split_train_val`); the test split is kept apart and used once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from capsctl.config import Preset
from capsctl.errors import ConfigError
from capsctl.events import EventFn

__all__ = ["RunData", "prepare_data"]


@dataclass
class RunData:
    train: Any  # ArrayDataset
    val: Any | None
    test: Any
    classes: list[str]
    mean: list[float]
    std: list[float]
    fingerprint: str
    test_name: str


def prepare_data(preset: Preset, on_event: EventFn = None, *, need_train: bool = True) -> RunData:
    """Load the preset's dataset, hold out the seeded validation split, keep test apart."""
    from capsctl.data import fingerprint, load_dataset, normalization_for, split_train_val

    d = preset.data
    full = load_dataset(d.dataset, "train", d.data_dir, download=d.download, on_event=on_event)
    test = load_dataset(
        d.dataset, "test", d.data_dir, test_file=d.test_file, download=d.download, on_event=on_event
    )
    if d.val_size >= len(full):
        raise ConfigError(
            f"data.val_size: {d.val_size} leaves no training images (train has {len(full)})"
        )
    if d.val_size > 0:
        train, val = split_train_val(full, d.val_size, preset.train.seed)
    else:
        train, val = full, None
    channels = int(full.images.shape[1])
    mean, std = normalization_for(d.normalization, channels)
    m = preset.model
    size = int(full.images.shape[-1])
    if channels != m.in_channels:
        raise ConfigError(
            f"model.in_channels: {m.in_channels}, but {d.dataset} images have {channels} channels"
        )
    if size != m.input_size:
        raise ConfigError(
            f"model.input_size: {m.input_size}, but {d.dataset} images are {size}x{size}"
        )
    if len(full.classes) != m.num_classes:
        raise ConfigError(
            f"model.num_classes: {m.num_classes}, but {d.dataset} has {len(full.classes)} classes"
        )
    return RunData(
        train, val, test, list(full.classes), list(mean), list(std), fingerprint(full), test.name
    )
