"""Checkpoints: safetensors files with JSON metadata (never pickle), and model folders.

* :mod:`capsctl.checkpoint.format`: the file format, header validation, atomic writes;
* :mod:`capsctl.checkpoint.load`: reading a file or a model folder, rebuilding the model;
* :mod:`capsctl.checkpoint.state`: training state (optimizer, scheduler, EMA, RNG) in a file;
* :mod:`capsctl.checkpoint.folder`: model folders (``model.safetensors`` + ``config.json``,
  written by ``capsctl export --format hf``), which read like weights-only checkpoints.
"""

from __future__ import annotations

from capsctl.checkpoint.folder import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    config_from_metadata,
    metadata_from_config,
)
from capsctl.checkpoint.format import (
    FORMAT,
    MODEL_PREFIX,
    model_tensors,
    read_header,
    save_checkpoint,
)
from capsctl.checkpoint.load import (
    load_checkpoint,
    load_tensors,
    model_config,
    model_from_tensors,
    read_metadata,
    resolve_checkpoint,
    stored_preset,
)
from capsctl.checkpoint.state import (
    TRAINING_STATE_KEY,
    TRAINING_TENSOR_PREFIXES,
    capture_rng_state,
    pack_training_state,
    restore_rng_state,
    strip_training_state,
    unpack_training_state,
    weights_only,
)

__all__ = [
    "CONFIG_NAME",
    "FORMAT",
    "MODEL_PREFIX",
    "TRAINING_STATE_KEY",
    "TRAINING_TENSOR_PREFIXES",
    "WEIGHTS_NAME",
    "capture_rng_state",
    "config_from_metadata",
    "load_checkpoint",
    "load_tensors",
    "metadata_from_config",
    "model_config",
    "model_from_tensors",
    "model_tensors",
    "pack_training_state",
    "read_header",
    "read_metadata",
    "resolve_checkpoint",
    "restore_rng_state",
    "save_checkpoint",
    "stored_preset",
    "strip_training_state",
    "unpack_training_state",
    "weights_only",
]
