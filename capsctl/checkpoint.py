"""Checkpoints: safetensors files with JSON metadata. Never pickle.

Layout of a checkpoint file:

* tensors ``model.<state_dict key>``: the model weights;
* optionally training state (:func:`pack_training_state`): ``optim.*`` (optimizer tensors),
  ``sched.*`` (scheduler tensors, rare), ``ema.*`` (EMA weights), ``rng.*`` (RNG states);
* safetensors string metadata: ``"format": "capsctl"`` and one entry per top-level metadata
  key, each JSON-encoded (``preset``, ``epoch``, ``metrics``, ``classes``, ...,
  ``capsctl_version``, ``torch_version`` and, with training state, ``training_state``).

Every file is validated (:func:`read_header`) before a tensor is read, and written
atomically (:func:`save_checkpoint`).

The readers (:func:`read_metadata`, :func:`load_tensors`, :func:`model_config`,
:func:`load_checkpoint`) also accept a model folder (``model.safetensors`` + ``config.json``,
written by ``capsctl export --format hf``, see :mod:`capsctl.hub`): it reads like a
weights-only checkpoint, its metadata rebuilt from ``config.json`` and its tensors under
``model.`` names.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import secrets
from collections import Counter, OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from safetensors.torch import save as _safetensors_bytes

from capsctl.atomic import fsync_dir
from capsctl.errors import CheckpointError, ConfigError

__all__ = [
    "TRAINING_STATE_KEY",
    "TRAINING_TENSOR_PREFIXES",
    "capture_rng_state",
    "load_checkpoint",
    "load_tensors",
    "model_tensors",
    "pack_training_state",
    "read_header",
    "read_metadata",
    "restore_rng_state",
    "save_checkpoint",
    "strip_training_state",
    "unpack_training_state",
]

FORMAT = "capsctl"
#: Largest header accepted by :func:`read_header` (the safetensors limit).
MAX_HEADER_BYTES = 100_000_000
#: Metadata key holding the non-tensor part of the training state.
TRAINING_STATE_KEY = "training_state"
#: Tensor name prefixes of the training state (everything that is not ``model.``).
TRAINING_TENSOR_PREFIXES = ("optim.", "sched.", "ema.", "rng.")
_MODEL_PREFIX = "model."
_CHUNK = 16 * 1024 * 1024
_PICKLE_STARTS = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")

_ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def _versions() -> dict[str, str]:
    from capsctl import __version__

    return {"capsctl_version": __version__, "torch_version": torch.__version__}


def _json_default(value: Any) -> Any:
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serializable")


def _encode_metadata(metadata: Mapping[str, Any], path: Path) -> dict[str, str]:
    encoded = {"format": FORMAT}
    for key, value in {
        **metadata,
        **{k: v for k, v in _versions().items() if k not in metadata},
    }.items():
        if not isinstance(key, str):
            raise CheckpointError(f"could not write {path}: metadata key {key!r} is not a string")
        if key == "format":
            raise CheckpointError(f"could not write {path}: metadata key 'format' is reserved")
        try:
            encoded[key] = json.dumps(value, ensure_ascii=False, default=_json_default)
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"could not write {path}: metadata {key!r} is not JSON-serializable ({e})"
            ) from None
    return encoded


def _prepare_tensors(tensors: Mapping[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors that share no storage (safetensors refuses sharing)."""
    prepared: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"could not write {path}: {name!r} is not a (str, Tensor) pair")
        t = tensor.detach().to("cpu")
        ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        if not t.is_contiguous() or (ptr and ptr in seen):
            t = t.clone(memory_format=torch.contiguous_format)
            ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        if ptr:
            seen.add(ptr)
        prepared[name] = t
    return prepared


def _write_all(file: Any, data: bytes) -> None:
    """Write ``data`` in chunks (a separate function so tests can simulate a full disk)."""
    view = memoryview(data)
    for start in range(0, len(view), _CHUNK):
        file.write(view[start : start + _CHUNK])


def save_checkpoint(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, Any],
) -> None:
    """Write ``tensors`` and JSON-able ``metadata`` to a safetensors file, atomically.

    Tensors are stored detached, contiguous and on the CPU. Each metadata key is stored as a
    JSON string next to ``"format": "capsctl"``; ``capsctl_version`` and ``torch_version`` are
    added unless given. The data goes to a temporary file in the same folder, is fsynced and
    then renamed over ``path``: on any failure the previous file at ``path`` is unchanged and
    :class:`CheckpointError` is raised.
    """
    path = Path(path)
    prepared = _prepare_tensors(tensors, path)
    encoded = _encode_metadata(metadata, path)
    try:
        data = _safetensors_bytes(prepared, metadata=encoded)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise CheckpointError(
            f"could not write {path}: {e}; the previous file is unchanged"
        ) from None
    folder = path.parent
    tmp = folder / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        with os.fdopen(fd, "wb") as file:
            _write_all(file, data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            reason = e.strerror or str(e)
            raise CheckpointError(
                f"could not write {path}: {reason}; the previous file is unchanged"
            ) from e
        raise
    fsync_dir(folder)


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's ``state_dict()`` under ``model.`` names, ready for :func:`save_checkpoint`."""
    return {_MODEL_PREFIX + k: v for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def _invalid(path: Path, detail: str) -> CheckpointError:
    return CheckpointError(
        f"{path} is not a valid safetensors file ({detail}); it may be truncated or corrupt: "
        "save or copy it again"
    )


def read_header(path: str | os.PathLike[str]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Read and validate a safetensors header without reading any tensor.

    Returns ``(tensor_infos, string_metadata)``: ``{name: {"dtype", "shape", "data_offsets"}}``
    and the raw ``__metadata__`` mapping. Raises :class:`CheckpointError` naming the file for
    missing files, pickles, truncation and any inconsistency of the header.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        if path.is_dir():
            raise CheckpointError(
                f"{path} is a folder, not a checkpoint file; pass a .safetensors file"
            )
        with open(path, "rb") as file:
            prefix = file.read(8)
            length = int.from_bytes(prefix, "little")
            insane = size < 8 or length > MAX_HEADER_BYTES
            # A zip ("PK...": torch.save) or a raw pickle (protocol 2+): never unpickled.
            if insane and (prefix[:2] == b"PK" or prefix[:2] in _PICKLE_STARTS):
                raise CheckpointError(
                    f"{path} is a PyTorch pickle (.pt) file; capsctl never loads pickles "
                    "because they can run arbitrary code: pass a capsctl .safetensors file"
                )
            if size < 8:
                raise _invalid(path, f"{size} bytes, shorter than the 8-byte header length")
            if length > MAX_HEADER_BYTES:
                raise _invalid(path, f"header length {length} exceeds {MAX_HEADER_BYTES} bytes")
            if length > size - 8:
                raise _invalid(path, f"header length {length} exceeds the file size {size}")
            raw = file.read(length)
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist; check the path") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    if len(raw) != length:
        raise _invalid(path, "the file shrank while being read")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise _invalid(path, "the header is not JSON") from None
    if not isinstance(header, dict):
        raise _invalid(path, "the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _invalid(path, "__metadata__ is not a mapping of strings")
    data_size = size - 8 - length
    spans = []
    for name, info in header.items():
        spans.append((*_check_entry(path, name, info, data_size), name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin < end:
            raise _invalid(path, f"tensor {name!r} overlaps another tensor")
        if begin > end:
            raise _invalid(path, f"{begin - end} unused bytes before tensor {name!r}")
        end = stop
    if end != data_size:
        raise _invalid(path, f"the tensors cover {end} of {data_size} data bytes")
    return header, metadata


def _check_entry(path: Path, name: str, info: Any, data_size: int) -> tuple[int, int]:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise _invalid(path, f"entry {name!r} lacks dtype, shape or data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in _ITEMSIZE:
        raise _invalid(path, f"tensor {name!r} has unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise _invalid(path, f"tensor {name!r} has a bad shape")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise _invalid(path, f"tensor {name!r} has bad data_offsets")
    begin, stop = offsets
    if not 0 <= begin <= stop <= data_size:
        raise _invalid(path, f"tensor {name!r} lies outside the file")
    if math.prod(shape) * _ITEMSIZE[dtype] != stop - begin:
        raise _invalid(path, f"tensor {name!r} has {stop - begin} bytes, not its shape's size")
    return begin, stop


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The decoded metadata of a capsctl checkpoint (without the ``format`` marker).

    For a model folder: the metadata rebuilt from its ``config.json``.
    """
    path = Path(path)
    if path.is_dir():
        from capsctl.hub import read_folder_metadata

        return read_folder_metadata(path)
    _, raw = read_header(path)
    if raw.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} was not written by capsctl (no capsctl metadata); pass a checkpoint saved "
            "by capsctl"
        )
    metadata: dict[str, Any] = {}
    for key, text in raw.items():
        if key == "format":
            continue
        try:
            metadata[key] = json.loads(text)
        except ValueError:
            raise CheckpointError(
                f"{path}: metadata entry {key!r} is not valid JSON; the file is corrupt"
            ) from None
    return metadata


def load_tensors(
    path: str | os.PathLike[str], device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """All tensors of a validated safetensors file, on ``device``.

    For a model folder: the tensors of its ``model.safetensors`` under ``model.<name>``.
    """
    path = Path(path)
    if path.is_dir():
        from capsctl.hub import load_folder_tensors

        return load_folder_tensors(path, device)
    read_header(path)
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(
            f"cannot load tensors from {path}: {' '.join(str(e).split())}"
        ) from None


def stored_preset(metadata: Mapping[str, Any], path: str | os.PathLike[str]) -> Any:
    """The resolved :class:`~capsctl.config.Preset` a checkpoint was trained with."""
    from capsctl.config import preset_from_dict

    try:
        return preset_from_dict(metadata["preset"])
    except (KeyError, TypeError, ConfigError) as e:
        raise CheckpointError(f"{path}: its stored preset is unusable ({e})") from None


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
        return from_dict(ModelConfig, raw_model, "preset.model")
    except ConfigError as e:
        raise CheckpointError(
            f"{path}: its stored model configuration is invalid ({e}); it may come from another "
            "capsctl version"
        ) from None


def load_checkpoint(
    path: str | os.PathLike[str], device: str | torch.device = "cpu"
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Rebuild the model stored in a checkpoint; returns ``(model in eval mode, metadata)``.

    The model is built from ``metadata["preset"]["model"]`` with
    ``capsctl.models.build_model_from_config`` and loaded from the ``model.*`` tensors with
    strict key and shape checks. ``path`` may be a model folder (its ``model.safetensors`` must
    hold exactly the model's tensors).
    """
    path = Path(path)
    metadata = read_metadata(path)
    config = model_config(path, metadata)
    from capsctl.models import build_model_from_config

    model = build_model_from_config(config)
    tensors = load_tensors(path)
    state = {k[len(_MODEL_PREFIX) :]: v for k, v in tensors.items() if k.startswith(_MODEL_PREFIX)}
    if path.is_dir():
        from capsctl.hub import check_folder_state

        check_folder_state(path, model, state)
    else:
        _check_state(path, model, state)
    model.load_state_dict(state, strict=True)
    model.to(device)
    model.eval()
    return model, metadata


def _check_state(path: Path, model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    expected = model.state_dict()
    problems = [f"missing model.{k}" for k in expected if k not in state]
    problems += [f"unexpected model.{k}" for k in state if k not in expected]
    problems += [
        f"model.{k} has shape {tuple(state[k].shape)}, the model needs {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if problems:
        shown = ", ".join(problems[:3])
        more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise CheckpointError(
            f"{path}: its metadata does not match its tensors ({shown}{more}); the file is "
            "inconsistent or from another capsctl version"
        )


# --------------------------------------------------------------------------------------------
# Training state
# --------------------------------------------------------------------------------------------

# A JSON object with exactly one of these keys is a tagged value, not a plain mapping.
_TAGS = (
    "__tensor__",
    "__tuple__",
    "__dict__",
    "__counter__",
    "__ordered__",
    "__ndarray__",
    "__npscalar__",
)


def _encode(value: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON-able form of ``value``; tensors go into ``tensors`` under names based on ``prefix``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        name = prefix
        n = 1
        while name in tensors:
            n += 1
            name = f"{prefix}#{n}"
        tensors[name] = value
        return {"__tensor__": name}
    if isinstance(value, list):
        return [_encode(v, f"{prefix}.{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{prefix}.{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, dict):
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
    np = _numpy()
    if np is not None and isinstance(value, np.ndarray):
        return {"__ndarray__": [str(value.dtype), list(value.shape), value.ravel().tolist()]}
    if np is not None and isinstance(value, np.generic):
        return {"__npscalar__": [str(value.dtype), value.item()]}
    raise CheckpointError(
        f"cannot store {type(value).__name__} at {prefix} in a checkpoint; only tensors, "
        "numbers, strings, lists, tuples and dicts are supported"
    )


def _decode(value: Any, tensors: Mapping[str, torch.Tensor], where: str) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, where) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        tag, body = next(iter(value.items()))
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
            np = _require_numpy(where)
            dtype, shape, data = body
            return np.array(data, dtype=dtype).reshape(shape)
        if tag == "__npscalar__":
            np = _require_numpy(where)
            dtype, item = body
            return np.dtype(dtype).type(item)
    return {k: _decode(v, tensors, where) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with torch here
        return None
    return numpy


def _require_numpy(where: str) -> Any:
    np = _numpy()
    if np is None:  # pragma: no cover
        raise CheckpointError(f"{where}: restoring this training state needs numpy; install it")
    return np


def capture_rng_state() -> dict[str, Any]:
    """The states of torch (CPU and CUDA), Python ``random`` and numpy's global generators."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = _numpy()
    if np is not None:
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
    np = _numpy()
    if "numpy" in state and np is not None:
        np.random.set_state(state["numpy"])


def pack_training_state(
    optimizer_state: Mapping[str, Any],
    scheduler_state: Mapping[str, Any] | None,
    ema_state: Mapping[str, torch.Tensor] | None,
    rng: Mapping[str, Any],
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split training state into tensors and JSON metadata for :func:`save_checkpoint`.

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


def strip_training_state(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Write a weights-only copy of ``src`` to ``dst`` (may be the same path).

    Keeps the metadata except ``training_state`` and only the ``model.*`` tensors.
    """
    metadata = read_metadata(src)
    metadata.pop(TRAINING_STATE_KEY, None)
    tensors = {k: v for k, v in load_tensors(src).items() if k.startswith(_MODEL_PREFIX)}
    save_checkpoint(dst, tensors, metadata)
