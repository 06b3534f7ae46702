"""Model folders (the Hugging Face layout), read side: ``config.json`` <-> checkpoint metadata.

A model folder (written by :func:`capsctl.export.hf.export_model_folder`) holds:

* ``model.safetensors``: the weights only, under the model's ``state_dict()`` names (no
  ``model.`` prefix, no optimizer or RNG state), with the safetensors metadata
  ``{"format": "pt"}`` that other readers expect and ``capsctl_config``, a record of
  ``config.json`` (:func:`weights_metadata`): the folder's source of truth;
* ``config.json``: the model and its preprocessing as data. The keys timm reads are at the top
  level: ``architecture`` (the registered model name when the configuration is exactly a
  registered one, else the ``arch``), ``num_classes``, ``input_size`` (``[C, H, W]``),
  ``mean``, ``std`` and ``label_names``. Next to them: ``model_config`` (the full
  :class:`~capsctl.models.spec.ModelConfig`, which is what the model is rebuilt from),
  ``preset`` (the resolved preset the model was trained with), ``capsctl_version``,
  ``normalization`` (the normalization's name, when known) and every other metadata entry of
  the checkpoint unchanged (``dataset``, ``epoch``, ``metrics``, ``params``, ``test`` with its
  ``split`` and ``dataset``, ``test_name``, ...), except the training state;
* ``README.md``: a model card (:mod:`capsctl.export.card`).

A folder reads like a weights-only checkpoint: :func:`read_folder` rebuilds the checkpoint
metadata from the record (:func:`metadata_from_config`), refusing a ``config.json`` that
contradicts it (edited labels or normalization would otherwise reach some commands and not
others), and
:func:`load_folder_tensors` returns the weights under ``model.`` names. Loading is strict
(:func:`check_folder_state`): a tensor missing from ``model.safetensors`` or one the model does
not have is an error naming it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from capsctl.checkpoint.format import (
    MODEL_PREFIX,
    library_versions,
    load_file_tensors,
    read_header,
    state_mismatch,
)
from capsctl.errors import CapsctlError, CheckpointError

__all__ = [
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "architecture_name",
    "check_folder_state",
    "config_from_metadata",
    "load_folder_tensors",
    "metadata_from_config",
    "read_folder",
    "read_folder_metadata",
    "weights_metadata",
]

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
#: The safetensors metadata entry of ``model.safetensors`` that records ``config.json``.
RECORD_KEY = "capsctl_config"

#: Checkpoint metadata entries that a weights-only folder does not carry.
_DROPPED = ("training_state", "partial", "format")
#: Checkpoint metadata entries stored under timm's names (or in ``model_config``) instead.
_RENAMED = ("classes", "normalization", "input_size", "in_channels")
#: config.json keys that are not copied back into the metadata as they are.
_CONFIG_ONLY = (
    "architecture",
    "num_classes",
    "input_size",
    "mean",
    "std",
    "label_names",
    "model_config",
    "normalization",
)


# --------------------------------------------------------------------------------------------
# config.json <-> checkpoint metadata
# --------------------------------------------------------------------------------------------


def architecture_name(raw_model: Mapping[str, Any]) -> str:
    """The registered model name whose configuration is exactly ``raw_model``, else its arch."""
    from capsctl.config import from_dict
    from capsctl.models.spec import ModelConfig
    from capsctl.registry import get_config, list_models

    try:
        config = from_dict(ModelConfig, dict(raw_model), "model_config")
    except CapsctlError:
        return str(raw_model.get("arch", "capsnet"))
    for name in list_models():
        if get_config(name) == config:
            return name
    return config.arch


def config_from_metadata(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The ``config.json`` of a model folder from a checkpoint's metadata (JSON-able)."""
    preset = meta.get("preset")
    raw_model = preset.get("model") if isinstance(preset, dict) else None
    if not isinstance(raw_model, dict):
        raise CheckpointError(
            "the checkpoint's metadata has no model configuration (preset.model), so it "
            "cannot be written as a model folder"
        )
    norm = meta.get("normalization") or {}
    channels = int(meta.get("in_channels") or raw_model.get("in_channels") or 3)
    size = int(meta.get("input_size") or raw_model.get("input_size") or 32)
    classes = meta.get("classes")
    num_classes = int(raw_model.get("num_classes") or len(classes or []))
    if not classes:
        classes = [str(i) for i in range(num_classes)]
    config: dict[str, Any] = {
        "architecture": architecture_name(raw_model),
        "num_classes": num_classes,
        "input_size": [channels, size, size],
        "mean": [float(v) for v in norm.get("mean", [0.0] * channels)],
        "std": [float(v) for v in norm.get("std", [1.0] * channels)],
        "label_names": list(classes),
        "capsctl_version": meta.get("capsctl_version") or library_versions()["capsctl_version"],
        "model_config": raw_model,
        "preset": preset,
    }
    if norm.get("name"):
        config["normalization"] = norm["name"]
    for key, value in meta.items():
        if key not in config and key not in _DROPPED and key not in _RENAMED:
            config[key] = value
    return config


def weights_metadata(config: Mapping[str, Any]) -> dict[str, str]:
    """The safetensors metadata of ``model.safetensors``: ``format: pt`` (what other readers
    expect) and the record of ``config``, the folder's source of truth (:func:`read_folder`)."""
    return {"format": "pt", RECORD_KEY: json.dumps(config, ensure_ascii=False, default=str)}


def _bad_config(path: Path, key: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: {key} {what}; the folder is damaged or was not written by capsctl: "
        "export it again"
    )


def _input_size(config: Mapping[str, Any], path: Path) -> list[int]:
    size = config.get("input_size")
    if (
        not isinstance(size, list)
        or len(size) != 3
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in size)
        or size[1] != size[2]
    ):
        raise _bad_config(path, "input_size", f"is {size!r}, not [channels, size, size]")
    return size


def _normalization(config: Mapping[str, Any], channels: int, path: Path) -> dict[str, Any]:
    norm: dict[str, Any] = {}
    if isinstance(config.get("normalization"), str):
        norm["name"] = config["normalization"]
    for key in ("mean", "std"):
        values = config.get(key)
        if (
            not isinstance(values, list)
            or len(values) not in (1, channels)
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        ):
            raise _bad_config(path, key, f"is {values!r}, not {channels} number(s)")
        norm[key] = [float(v) for v in values]
    return norm


def metadata_from_config(config: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """Inverse of :func:`config_from_metadata`: the checkpoint metadata other commands read.

    ``model_config`` is what the model is rebuilt from (it replaces ``preset.model``);
    ``input_size`` must be ``[C, H, H]``; ``mean``/``std`` one number per channel (or one);
    ``label_names`` one string per class. ``path`` (the ``config.json``) is named in errors.
    """
    raw_model = config.get("model_config")
    if not isinstance(raw_model, dict):
        raise CheckpointError(
            f"{path} has no model_config, so the model cannot be rebuilt; pass a folder "
            "written by capsctl export --format hf"
        )
    size = _input_size(config, path)
    norm = _normalization(config, size[0], path)
    labels = config.get("label_names")
    num_classes = raw_model.get("num_classes")
    if (
        not isinstance(labels, list)
        or not all(isinstance(v, str) for v in labels)
        or (isinstance(num_classes, int) and len(labels) != num_classes)
    ):
        raise _bad_config(path, "label_names", f"is not a list of {num_classes} class names")
    if "num_classes" in config and config["num_classes"] != num_classes:
        raise _bad_config(
            path, "num_classes", f"is {config['num_classes']!r}, not model_config's {num_classes}"
        )
    preset = config.get("preset")
    preset = dict(preset) if isinstance(preset, dict) else {}
    preset["model"] = raw_model
    meta = {k: v for k, v in config.items() if k not in _CONFIG_ONLY}
    meta.update(
        {
            "preset": preset,
            "classes": list(labels),
            "normalization": norm,
            "input_size": size[1],
            "in_channels": size[0],
        }
    )
    return meta


# --------------------------------------------------------------------------------------------
# Reading a folder
# --------------------------------------------------------------------------------------------


def _folder_files(folder: Path) -> tuple[Path, Path]:
    weights, config = folder / WEIGHTS_NAME, folder / CONFIG_NAME
    has_weights, has_config = weights.is_file(), config.is_file()
    if not has_weights and not has_config:
        raise CheckpointError(
            f"{folder} is a folder, not a checkpoint file or a model folder (it has no "
            f"{CONFIG_NAME} and {WEIGHTS_NAME}); pass a .safetensors checkpoint, a run folder "
            "of capsctl train or a folder written by capsctl export --format hf"
        )
    if not has_config or not has_weights:
        missing = CONFIG_NAME if not has_config else WEIGHTS_NAME
        raise CheckpointError(
            f"{folder} is an incomplete model folder: {missing} is missing; copy or export "
            "the folder again"
        )
    return weights, config


def _read_config(config_path: Path) -> dict[str, Any]:
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) else "not valid JSON"
        raise CheckpointError(
            f"cannot read {config_path}: {reason}; copy or export the folder again"
        ) from None
    if not isinstance(config, dict):
        raise _bad_config(config_path, "the file", "is not a JSON object")
    return config


def _json_text(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def _first_difference(mirror: Any, record: Any, key: str) -> str | None:
    """The dotted key of the first value ``mirror`` (config.json) holds unlike ``record``."""
    if isinstance(mirror, dict) and isinstance(record, dict):
        for k in record:
            found = _first_difference(mirror.get(k), record[k], f"{key}.{k}")
            if found is not None:
                return found
        return None
    return None if _json_text(mirror) == _json_text(record) else key


def _recorded_config(weights: Path, raw: Mapping[str, str]) -> dict[str, Any] | None:
    """The config.json recorded in ``model.safetensors`` (None: a folder exported before)."""
    text = raw.get(RECORD_KEY)
    if text is None:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    if not isinstance(record, dict):
        raise CheckpointError(
            f"{weights}: its {RECORD_KEY} entry is not a JSON object; the folder is damaged: "
            "export it again"
        )
    return record


def read_folder(folder: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """The checkpoint metadata of a model folder and its weights' shapes (from the header; no
    tensor is read).

    The source of truth is the copy of ``config.json`` recorded in ``model.safetensors`` (see
    :func:`weights_metadata`): ``config.json`` mirrors it for the Hub and other readers, and a
    value it holds otherwise (edited labels, normalization, model) is a one-line error naming
    the key. Extra keys in ``config.json`` are ignored. Folders exported before the record
    existed are read from ``config.json``.
    """
    weights, config_path = _folder_files(Path(folder))
    config = _read_config(config_path)
    header, raw = read_header(weights)
    record = _recorded_config(weights, raw)
    if record is None:
        meta = metadata_from_config(config, config_path)
    else:
        differences = (_first_difference(config.get(k), v, k) for k, v in record.items())
        key = next((k for k in differences if k is not None), None)
        if key is not None:
            raise CheckpointError(
                f"{config_path}: {key} differs from the copy recorded in {WEIGHTS_NAME} (the "
                "weights' own record); config.json was edited or belongs to other weights: "
                "restore it or export the folder again"
            )
        meta = metadata_from_config(record, config_path)  # config.json's extra keys: unread
    shapes = {name: info["shape"] for name, info in header.items()}
    return meta, shapes


def read_folder_metadata(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint metadata of a model folder (:func:`read_folder`; no tensor is read)."""
    return read_folder(folder)[0]


def load_folder_tensors(
    folder: str | os.PathLike[str], device: str | torch.device = "cpu", *, validate: bool = True
) -> dict[str, torch.Tensor]:
    """The weights of a model folder under checkpoint names (``model.<state_dict key>``)."""
    weights, _ = _folder_files(Path(folder))
    tensors = load_file_tensors(weights, device, validate=validate)
    return {MODEL_PREFIX + k: v for k, v in tensors.items()}


def check_folder_state(
    folder: Path, model: torch.nn.Module, state: Mapping[str, torch.Tensor]
) -> None:
    """Strict loading: every tensor of the model present, none extra, every shape right.

    ``state`` holds the tensors of ``model.safetensors`` under their stored names. Raises a
    one-line :class:`CheckpointError` naming the first problems.
    """
    problems = state_mismatch(model, state, lambda k: f"tensor {k!r}")
    if problems:
        raise CheckpointError(
            f"{folder / WEIGHTS_NAME} does not match the model of {CONFIG_NAME} "
            f"({problems}); the folder is inconsistent: export it again"
        )
