"""Checks of the values a checkpoint stores, before anything is sized from them.

A checkpoint or model folder may come from anywhere. :func:`capsctl.checkpoint.read_metadata`
checks every value that later sizes an allocation or a loop, so that a forged or damaged file
gives one line naming the file and the field instead of a hang or an allocation of terabytes:

* the stored preset against the schema and its size limits
  (:data:`capsctl.config.schema.LIMITS`: routing iterations, widths, input size, classes,
  batch sizes), in :func:`capsctl.checkpoint.load.model_config` and
  :func:`~capsctl.checkpoint.load.stored_preset`;
* the top-level entries commands read (:func:`check_entries`): ``input_size`` and
  ``in_channels`` (the model's), ``classes`` (one name per class), ``normalization`` (finite
  means, finite positive stds, one per channel or one for all), ``epoch`` (where a resumed
  run starts: a count, not a loop of a billion epochs);
* the parameter shapes the preset implies, computed on the meta device (nothing is
  allocated), against the shapes in the file's header (:func:`implied_model`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from capsctl.errors import CheckpointError, ConfigError
from capsctl.numbers import MAX_EPOCHS

__all__ = ["check_entries", "header_state", "implied_model"]


def _bad(path: Path, key: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: its stored {key} {what}; the file is inconsistent or forged: use a checkpoint "
        "written by capsctl train or export"
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _numbers(values: Any) -> list[float] | None:
    """``values`` as finite floats, or None when it is not a list of finite numbers."""
    if not isinstance(values, list) or not values:
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return None
    floats = [float(v) for v in values]
    return floats if all(math.isfinite(v) for v in floats) else None


def _check_normalization(path: Path, norm: Any, channels: int) -> None:
    if not isinstance(norm, Mapping):
        raise _bad(path, "normalization", f"is {norm!r}, not a mapping with mean and std")
    for key in ("mean", "std"):
        if norm.get(key) is None:
            continue
        values = _numbers(norm[key])
        if values is None or len(values) not in (1, channels):
            raise _bad(
                path,
                "normalization",
                f"{key} is {norm[key]!r}, not {channels} finite number(s) (or one for all)",
            )
        if key == "std" and min(values) <= 0:
            raise _bad(path, "normalization", f"std is {norm[key]!r}; every std must be > 0")


def check_entries(path: Path, meta: Mapping[str, Any], cfg: Any) -> None:
    """The top-level metadata entries fit the stored model ``cfg``: ``input_size``,
    ``in_channels``, ``classes`` and ``normalization``; ``epoch`` is a count (each where
    present)."""
    for key in ("input_size", "in_channels"):
        value, want = meta.get(key), getattr(cfg, key)
        if value is not None and (not _is_int(value) or value != want):
            raise _bad(path, key, f"is {value!r}, but its model (preset.model.{key}) has {want}")
    classes = meta.get("classes")
    if classes is not None and (
        not isinstance(classes, list)
        or not all(isinstance(c, str) for c in classes)
        or len(classes) != cfg.num_classes
    ):
        count = len(classes) if isinstance(classes, list) else classes
        raise _bad(
            path,
            "classes",
            f"are {count} entries, not the {cfg.num_classes} class names its model outputs",
        )
    if meta.get("normalization") is not None:
        _check_normalization(path, meta["normalization"], cfg.in_channels)
    epoch = meta.get("epoch")  # where a resumed run starts counting
    if epoch is not None and (not _is_int(epoch) or not 0 <= epoch <= MAX_EPOCHS):
        raise _bad(path, "epoch", f"is {epoch!r}, not a count of epochs in [0, {MAX_EPOCHS}]")


def implied_model(path: Path, cfg: Any) -> nn.Module:
    """The model of ``cfg`` on the meta device: its parameter shapes, nothing allocated."""
    from capsctl import models  # the module attribute: tests replace build_model_from_config

    try:
        with torch.device("meta"):
            return models.build_model_from_config(cfg)
    except (ConfigError, ValueError) as e:
        raise CheckpointError(
            f"{path}: its stored model configuration cannot be built ({e}); the file is "
            "inconsistent or from another capsctl version"
        ) from None


def header_state(model: nn.Module, shapes: Mapping[str, Sequence[int]]) -> dict[str, Any]:
    """Meta tensors of the header's ``shapes`` under the names ``model`` loads them by."""
    state = {name: torch.empty(tuple(shape), device="meta") for name, shape in shapes.items()}
    upgrade = getattr(model, "upgrade_state", None)
    return upgrade(state) if callable(upgrade) else state
