"""Training state in a checkpoint: optimizer, scheduler, EMA and RNG states as tensors + JSON.

:func:`pack_training_state` splits the nested ``state_dict()`` structures into tensors (named
``optim.*``, ``sched.*``, ``ema.*``, ``rng.*``) and one JSON metadata entry
``training_state`` that points at them; :func:`unpack_training_state` inverts it exactly
(int keys, tuples, Counters, OrderedDicts and numpy arrays survive). A JSON object with exactly
one of the tags below is a tagged value, not a plain mapping.
"""

from __future__ import annotations

import os
import random
from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from capsctl.checkpoint.format import MODEL_PREFIX, save_checkpoint
from capsctl.checkpoint.load import load_tensors, read_metadata
from capsctl.errors import CheckpointError

__all__ = [
    "TRAINING_STATE_KEY",
    "TRAINING_TENSOR_PREFIXES",
    "capture_rng_state",
    "pack_training_state",
    "restore_rng_state",
    "strip_training_state",
    "unpack_training_state",
    "weights_only",
]

#: Metadata key holding the non-tensor part of the training state.
TRAINING_STATE_KEY = "training_state"
#: Tensor name prefixes of the training state (everything that is not ``model.``).
TRAINING_TENSOR_PREFIXES = ("optim.", "sched.", "ema.", "rng.")

_TAGS = (
    "__tensor__",
    "__tuple__",
    "__dict__",
    "__counter__",
    "__ordered__",
    "__ndarray__",
    "__npscalar__",
)


def _store_tensor(value: torch.Tensor, prefix: str, tensors: dict[str, torch.Tensor]) -> str:
    """Put ``value`` into ``tensors`` under ``prefix`` (``prefix#2``, ... when taken)."""
    name = prefix
    n = 1
    while name in tensors:
        n += 1
        name = f"{prefix}#{n}"
    tensors[name] = value
    return name


def _encode_mapping(value: dict[Any, Any], prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    items = [
        (_encode(k, prefix, {}), _encode(v, f"{prefix}.{k}", tensors)) for k, v in value.items()
    ]
    if isinstance(value, Counter):
        return {"__counter__": [list(kv) for kv in items]}
    if isinstance(value, OrderedDict):
        return {"__ordered__": [list(kv) for kv in items]}
    if all(isinstance(k, str) and k not in _TAGS for k in value):
        return dict(items)
    return {"__dict__": [list(kv) for kv in items]}


def _encode(value: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON-able form of ``value``; tensors go into ``tensors`` under names based on ``prefix``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return {"__tensor__": _store_tensor(value, prefix, tensors)}
    if isinstance(value, list):
        return [_encode(v, f"{prefix}.{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{prefix}.{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, dict):
        return _encode_mapping(value, prefix, tensors)
    if isinstance(value, np.ndarray):
        return {"__ndarray__": [str(value.dtype), list(value.shape), value.ravel().tolist()]}
    if isinstance(value, np.generic):
        return {"__npscalar__": [str(value.dtype), value.item()]}
    raise CheckpointError(
        f"cannot store {type(value).__name__} at {prefix} in a checkpoint; only tensors, "
        "numbers, strings, lists, tuples and dicts are supported"
    )


def _decode_tagged(tag: str, body: Any, tensors: Mapping[str, torch.Tensor], where: str) -> Any:
    if tag == "__tensor__":
        if body not in tensors:
            raise CheckpointError(f"{where}: training state tensor {body!r} is missing")
        return tensors[body]
    if tag == "__tuple__":
        return tuple(_decode(v, tensors, where) for v in body)
    if tag in ("__dict__", "__counter__", "__ordered__"):
        pairs = [
            (_hashable(_decode(k, tensors, where)), _decode(v, tensors, where)) for k, v in body
        ]
        if tag == "__counter__":
            return Counter(dict(pairs))
        return OrderedDict(pairs) if tag == "__ordered__" else dict(pairs)
    if tag == "__ndarray__":
        dtype, shape, data = body
        return np.array(data, dtype=dtype).reshape(shape)
    dtype, item = body  # "__npscalar__"
    return np.dtype(dtype).type(item)


def _decode(value: Any, tensors: Mapping[str, torch.Tensor], where: str) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, where) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        tag, body = next(iter(value.items()))
        if tag in _TAGS:
            return _decode_tagged(tag, body, tensors, where)
    return {k: _decode(v, tensors, where) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def capture_rng_state() -> dict[str, Any]:
    """The states of torch (CPU and CUDA), Python ``random`` and numpy's global generators."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    state["numpy"] = np.random.get_state()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`capture_rng_state` captured (CUDA only when the device count matches)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"].to("cpu", torch.uint8))
    if "python" in state:
        random.setstate(state["python"])
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all([t.to("cpu", torch.uint8) for t in cuda])
    if "numpy" in state:
        np.random.set_state(state["numpy"])


def pack_training_state(
    optimizer_state: Mapping[str, Any],
    scheduler_state: Mapping[str, Any] | None,
    ema_state: Mapping[str, torch.Tensor] | None,
    rng: Mapping[str, Any],
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split training state into tensors and JSON metadata for ``save_checkpoint``.

    ``optimizer_state``/``scheduler_state``: ``state_dict()`` of the optimizer and LR scheduler;
    ``ema_state``: the EMA model's ``state_dict()``; ``rng``: :func:`capture_rng_state`.
    Tensors are named ``optim.*``, ``sched.*``, ``ema.*``, ``rng.*``; the metadata is
    ``{"training_state": {...}}``. Int keys, tuples, Counters and numpy arrays survive exactly.
    """
    tensors: dict[str, torch.Tensor] = {}
    state = {
        "version": 1,
        "optimizer": _encode(dict(optimizer_state), "optim", tensors),
        "scheduler": None
        if scheduler_state is None
        else _encode(dict(scheduler_state), "sched", tensors),
        "ema": None if ema_state is None else _encode(dict(ema_state), "ema", tensors),
        "rng": _encode(dict(rng), "rng", tensors),
    }
    return tensors, {TRAINING_STATE_KEY: state}


def unpack_training_state(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, torch.Tensor] | None, dict[str, Any]]:
    """Inverse of :func:`pack_training_state`: ``(optimizer, scheduler, ema, rng)`` states."""
    state = metadata.get(TRAINING_STATE_KEY)
    if not isinstance(state, dict):
        raise CheckpointError(
            "this checkpoint has no training state (it holds weights only), so training cannot "
            "resume from it; resume from a full checkpoint or start a new run"
        )
    if state.get("version") != 1:
        raise CheckpointError(
            f"unsupported training state version {state.get('version')!r}; use the capsctl "
            "version that wrote the checkpoint"
        )
    where = "training state"
    return (
        _decode(state["optimizer"], tensors, where),
        _decode(state["scheduler"], tensors, where),
        _decode(state["ema"], tensors, where),
        _decode(state["rng"], tensors, where),
    )


def weights_only(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The ``model.*`` tensors and the metadata without ``training_state``."""
    kept = {k: v for k, v in tensors.items() if k.startswith(MODEL_PREFIX)}
    return kept, {k: v for k, v in metadata.items() if k != TRAINING_STATE_KEY}


def strip_training_state(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Write a weights-only copy of ``src`` to ``dst`` (may be the same path).

    Keeps the metadata except ``training_state`` and only the ``model.*`` tensors.
    """
    metadata = read_metadata(src)
    tensors, metadata = weights_only(load_tensors(src, validate=False), metadata)
    save_checkpoint(dst, tensors, metadata)
