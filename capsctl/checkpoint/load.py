"""Reading a checkpoint file or a model folder: metadata, tensors, the model rebuilt.

Every reader takes a checkpoint file (:mod:`capsctl.checkpoint.format`) or a model folder
(:mod:`capsctl.checkpoint.folder`): a folder reads like a weights-only checkpoint, its metadata
rebuilt from ``config.json`` and its tensors under ``model.`` names. Commands pass what the
user named through :func:`resolve_checkpoint` first, so that a run folder of ``capsctl train``
stands for its ``best.safetensors`` everywhere.

:func:`read_metadata` checks every stored value before anything is built or sized from it
(:func:`check_stored_values`, :mod:`capsctl.checkpoint.stored`): a forged file is one line
naming the file and the field, never a hang or a huge allocation.

To read a file's header once, read the metadata first and pass it on:
``meta = read_metadata(path)`` then ``load_checkpoint(path, metadata=meta)``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from capsctl.checkpoint.folder import (
    CONFIG_NAME,
    check_folder_state,
    load_folder_tensors,
    read_folder,
)
from capsctl.checkpoint.format import (
    MODEL_PREFIX,
    decode_metadata,
    load_file_tensors,
    read_header,
    state_mismatch,
)
from capsctl.checkpoint.shipped import shipped_or_path
from capsctl.checkpoint.stored import check_entries, header_state, implied_model
from capsctl.errors import CheckpointError, ConfigError

__all__ = [
    "load_checkpoint",
    "load_tensors",
    "model_config",
    "model_from_tensors",
    "read_metadata",
    "resolve_checkpoint",
    "stored_preset",
]

#: The checkpoints of a ``capsctl train`` run folder: the one commands read, and the other.
RUN_BEST, RUN_LAST = "best.safetensors", "last.safetensors"


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The checkpoint a command reads for ``path``: a run folder of ``capsctl train`` (a folder
    without ``config.json`` holding ``best.safetensors``) stands for its ``best.safetensors``;
    anything else is returned as it is (a file, a model folder, a missing path: reported by
    whoever reads it). A run folder with only ``last.safetensors`` is a one-line error. A
    shipped name (``capsctl weights``) that is not an existing path stands for its file."""
    path = shipped_or_path(path)
    if not path.is_dir() or (path / CONFIG_NAME).exists():
        return path
    if (path / RUN_BEST).is_file():
        return path / RUN_BEST
    if (path / RUN_LAST).is_file():
        raise CheckpointError(
            f"{path} is a run folder without {RUN_BEST} (training stopped before its first "
            f"validation); pass {path / RUN_LAST} to use its last epoch"
        )
    return path


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The decoded metadata of a capsctl checkpoint (without the ``format`` marker).

    The file's header is validated, and so is every stored value that sizes anything later
    (:func:`check_stored_values`). For a model folder: the metadata rebuilt from its
    ``config.json``, checked against the copy in its weights file.
    """
    path = Path(path)
    if path.is_dir():
        meta, shapes = read_folder(path)
    else:
        header, raw = read_header(path)
        meta = decode_metadata(path, raw)
        prefix = len(MODEL_PREFIX)
        shapes = {k[prefix:]: v["shape"] for k, v in header.items() if k.startswith(MODEL_PREFIX)}
    check_stored_values(path, meta, shapes)
    return meta


def check_stored_values(
    path: Path, meta: Mapping[str, Any], shapes: Mapping[str, Sequence[int]]
) -> None:
    """Refuse a checkpoint whose stored values would size anything wrongly, before anything is
    built: its preset against the schema and its limits, its top-level entries against its
    model, and the parameter shapes the model implies (on the meta device) against ``shapes``
    (the header's, under ``state_dict()`` names). Metadata without a preset (training state
    alone) passes: :func:`model_config` reports it where a model is needed."""
    if "preset" not in meta:
        return
    cfg = model_config(path, meta)
    stored_preset(meta, path)
    check_entries(path, meta, cfg)
    model = implied_model(path, cfg)
    state = header_state(model, shapes)
    if path.is_dir():
        check_folder_state(path, model, state)
    else:
        _check_state(path, model, state)


def load_tensors(
    path: str | os.PathLike[str], device: str | torch.device = "cpu", *, validate: bool = True
) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint on ``device``, its header validated first.

    For a model folder: the tensors of its ``model.safetensors`` under ``model.<name>``.
    ``validate=False`` skips the header check for a caller that has just run
    :func:`read_metadata` on the same path.
    """
    path = Path(path)
    if path.is_dir():
        return load_folder_tensors(path, device, validate=validate)
    return load_file_tensors(path, device, validate=validate)


def stored_preset(metadata: Mapping[str, Any], path: str | os.PathLike[str]) -> Any:
    """The resolved :class:`~capsctl.config.Preset` a checkpoint was trained with.

    Without its ``data.data_dir``: a path read from a file never says where data is read or
    downloaded (``--data-dir``, ``$CAPSCTL_DATA`` or the user cache do; the training machine's
    folder may not exist here, or be anything in a file from elsewhere)."""
    from capsctl.config import preset_from_dict

    try:
        preset = preset_from_dict(stored_defaults(metadata["preset"]))
    except (KeyError, TypeError, ConfigError) as e:
        raise CheckpointError(f"{path}: its stored preset is unusable ({e})") from None
    preset.data.data_dir = None
    return preset


#: Router parameters whose default changed, with the value a stored configuration that does not
#: name them was trained with.
STORED_ROUTER_DEFAULTS: dict[str, dict[str, Any]] = {"self": {"primary_norm": "none"}}


def stored_defaults(preset: Any) -> Any:
    """A stored preset mapping with the old defaults of :data:`STORED_ROUTER_DEFAULTS` filled in
    where it does not name them (a copy; anything else is returned as it is)."""
    if not isinstance(preset, Mapping) or not isinstance(preset.get("model"), Mapping):
        return preset
    model = dict(preset["model"])
    router = model.get("router")
    if isinstance(router, Mapping):
        old = STORED_ROUTER_DEFAULTS.get(str(router.get("name")), {})
        model["router"] = {**old, **router}
    return {**preset, "model": model}


def model_config(path: str | os.PathLike[str], metadata: Mapping[str, Any] | None = None) -> Any:
    """The :class:`~capsctl.models.spec.ModelConfig` stored in a checkpoint (no tensor is read)."""
    from capsctl.config import from_dict
    from capsctl.models.spec import ModelConfig

    path = Path(path)
    meta = read_metadata(path) if metadata is None else metadata
    preset = meta.get("preset")
    raw_model = preset.get("model") if isinstance(preset, dict) else None
    if not isinstance(raw_model, dict):
        raise CheckpointError(
            f"{path}: its metadata has no model configuration (preset.model), so the model "
            "cannot be rebuilt"
        )
    try:
        return from_dict(
            ModelConfig, stored_defaults({"model": raw_model})["model"], "preset.model"
        )
    except ConfigError as e:
        raise CheckpointError(
            f"{path}: its stored model configuration is invalid ({e}); the file is damaged, "
            "forged or from another capsctl version"
        ) from None


def model_from_tensors(
    path: str | os.PathLike[str],
    metadata: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
) -> torch.nn.Module:
    """The model of ``metadata`` (on the CPU, in eval mode) loaded from its ``model.*`` tensors.

    Built with ``capsctl.models.build_model_from_config`` and loaded with strict key and shape
    checks; ``path`` (a file or a model folder) is named in the errors.
    """
    from capsctl.models import build_model_from_config

    path = Path(path)
    model = build_model_from_config(model_config(path, metadata))
    state = {k[len(MODEL_PREFIX) :]: v for k, v in tensors.items() if k.startswith(MODEL_PREFIX)}
    upgrade = getattr(model, "upgrade_state", None)
    if callable(upgrade):  # weights of older checkpoints under today's names
        state = upgrade(state)
    if path.is_dir():
        check_folder_state(path, model, state)
    else:
        _check_state(path, model, state)
    model.load_state_dict(state, strict=True)
    model.eval()
    return model


def load_checkpoint(
    path: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    *,
    metadata: Mapping[str, Any] | None = None,
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Rebuild the model stored in a checkpoint; returns ``(model in eval mode, metadata)``.

    The model is built from ``metadata["preset"]["model"]`` and loaded from the ``model.*``
    tensors with strict key and shape checks (:func:`model_from_tensors`). ``path`` may be a
    model folder (its ``model.safetensors`` must hold exactly the model's tensors).
    ``metadata``: what :func:`read_metadata` returned for ``path``, so that the header is not
    read again.
    """
    path = Path(path)
    meta = read_metadata(path) if metadata is None else dict(metadata)
    tensors = load_tensors(path, validate=metadata is None)
    model = model_from_tensors(path, meta, tensors)
    model.to(device)
    return model, meta


def _check_state(path: Path, model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    problems = state_mismatch(model, state, lambda k: f"{MODEL_PREFIX}{k}")
    if problems:
        raise CheckpointError(
            f"{path}: its metadata does not match its tensors ({problems}); the file is "
            "inconsistent or from another capsctl version"
        )
