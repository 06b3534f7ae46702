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
    fingerprint: str | None  # of the training images; None when only the test split was loaded
    test_name: str


def prepare_data(preset: Preset, on_event: EventFn = None, *, need_train: bool = True) -> RunData:
    """Load the preset's dataset, hold out the seeded validation split, keep test apart.

    ``need_train=False`` loads the test split alone (``capsctl eval --split test``): ``train``
    and ``val`` are None, the classes and checks come from the test images, and there is no
    fingerprint (it is one of the training images).
    """
    from capsctl.data import fingerprint, load_dataset, normalization_for, split_train_val

    d = preset.data
    if not need_train:
        test = _load(preset, "test", on_event)
        mean, std = normalization_for(d.normalization, int(test.images.shape[1]))
        _check_fits(preset, test)
        return RunData(None, None, test, list(test.classes), list(mean), list(std), None, test.name)
    full = load_dataset(d.dataset, "train", d.data_dir, download=d.download, on_event=on_event)
    test = _load(preset, "test", on_event)
    if d.val_size >= len(full):
        raise ConfigError(
            f"data.val_size: {d.val_size} leaves no training images (train has {len(full)}); "
            f"set it below {len(full)}, e.g. --set data.val_size={len(full) // 10}"
        )
    if d.val_size > 0:
        train, val = split_train_val(full, d.val_size, preset.train.seed)
    else:
        train, val = full, None
    mean, std = normalization_for(d.normalization, int(full.images.shape[1]))
    _check_fits(preset, full)
    return RunData(
        train, val, test, list(full.classes), list(mean), list(std), fingerprint(full), test.name
    )


def _load(preset: Preset, split: str, on_event: EventFn) -> Any:
    from capsctl.data import load_dataset

    d = preset.data
    test_file = d.test_file if split == "test" else None
    return load_dataset(
        d.dataset, split, d.data_dir, test_file=test_file, download=d.download, on_event=on_event
    )


def _check_fits(preset: Preset, ds: Any) -> None:
    """ConfigError unless the model takes the images of ``ds`` and has one output per class."""
    d, m = preset.data, preset.model
    channels, size = int(ds.images.shape[1]), int(ds.images.shape[-1])
    if channels != m.in_channels:
        raise ConfigError(
            f"model.in_channels: {m.in_channels}, but {d.dataset} images have {channels} channels"
        )
    if size != m.input_size:
        raise ConfigError(
            f"model.input_size: {m.input_size}, but {d.dataset} images are {size}x{size}"
        )
    if len(ds.classes) != m.num_classes:
        raise ConfigError(
            f"model.num_classes: {m.num_classes}, but {d.dataset} has {len(ds.classes)} classes"
        )
