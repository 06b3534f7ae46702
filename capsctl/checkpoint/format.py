"""The checkpoint file: a safetensors file with JSON metadata, validated and written atomically.

Layout of a checkpoint file:

* tensors ``model.<state_dict key>``: the model weights;
* optionally training state (:func:`capsctl.checkpoint.state.pack_training_state`):
  ``optim.*`` (optimizer tensors), ``sched.*`` (scheduler tensors, rare), ``ema.*`` (EMA
  weights), ``rng.*`` (RNG states);
* safetensors string metadata: ``"format": "capsctl"`` and one entry per top-level metadata
  key, each JSON-encoded (``preset``, ``epoch``, ``metrics``, ``classes``, ...,
  ``capsctl_version``, ``torch_version`` and, with training state, ``training_state``).

Every file is validated (:func:`read_header`) before a tensor is read, and written
atomically (:func:`save_checkpoint`: temporary file, fsync, rename). Nothing is ever unpickled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import secrets
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from capsctl.atomic import fsync_dir
from capsctl.errors import CheckpointError

__all__ = [
    "FORMAT",
    "MODEL_PREFIX",
    "decode_metadata",
    "library_versions",
    "load_file_tensors",
    "model_tensors",
    "read_header",
    "save_checkpoint",
    "storable_tensors",
]

#: The ``format`` entry of a capsctl checkpoint's safetensors metadata.
FORMAT = "capsctl"
#: Largest header accepted by :func:`read_header` (the safetensors limit).
MAX_HEADER_BYTES = 100_000_000
#: Name prefix of the model's weights in a checkpoint.
MODEL_PREFIX = "model."
_CHUNK = 16 * 1024 * 1024
_PICKLE_STARTS = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")

#: Bytes per element of every safetensors dtype.
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


def library_versions() -> dict[str, str]:
    """``{"capsctl_version", "torch_version"}`` of the running code (stored with every file)."""
    from capsctl.version import __version__

    return {"capsctl_version": __version__, "torch_version": torch.__version__}


def _json_default(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serializable")


def _encode_metadata(metadata: Mapping[str, Any], path: Path) -> dict[str, str]:
    encoded = {"format": FORMAT}
    versions = {k: v for k, v in library_versions().items() if k not in metadata}
    for key, value in {**metadata, **versions}.items():
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


def storable_tensors(tensors: Mapping[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors that share no storage (safetensors refuses sharing).

    ``path`` (the file they are meant for) is named in the error for a bad entry.
    """
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


def _replace_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to a fresh temporary file beside ``path``, fsync it, rename it over."""
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
    prepared = storable_tensors(tensors, path)
    encoded = _encode_metadata(metadata, path)
    try:
        data = safetensors_bytes(prepared, metadata=encoded)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise CheckpointError(
            f"could not write {path}: {e}; the previous file is unchanged"
        ) from None
    _replace_atomically(path, data)


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's ``state_dict()`` under ``model.`` names, ready for :func:`save_checkpoint`."""
    return {MODEL_PREFIX + k: v for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def _invalid(path: Path, detail: str) -> CheckpointError:
    return CheckpointError(
        f"{path} is not a valid safetensors file ({detail}); it may be truncated or corrupt: "
        "save or copy it again"
    )


def _read_raw_header(path: Path) -> tuple[bytes, int]:
    """The header bytes and the file size; refuses folders, pickles and impossible lengths."""
    try:
        info = path.stat()
        size = info.st_size
        if stat.S_ISDIR(info.st_mode):
            raise CheckpointError(
                f"{path} is a folder, not a checkpoint file; pass a .safetensors file"
            )
        if not stat.S_ISREG(info.st_mode):  # reading a named pipe would wait for a writer
            raise CheckpointError(
                f"{path}: not a regular file (a named pipe, socket or device); pass a "
                ".safetensors file"
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
    return raw, size


def read_header(path: str | os.PathLike[str]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Read and validate a safetensors header without reading any tensor.

    Returns ``(tensor_infos, string_metadata)``: ``{name: {"dtype", "shape", "data_offsets"}}``
    and the raw ``__metadata__`` mapping. Raises :class:`CheckpointError` naming the file for
    missing files, pickles, truncation and any inconsistency of the header.
    """
    path = Path(path)
    raw, size = _read_raw_header(path)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise _invalid(path, "the header is not JSON") from None
    if not isinstance(header, dict):
        raise _invalid(path, "the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _invalid(path, "__metadata__ is not a mapping of strings")
    _check_layout(path, header, data_size=size - 8 - len(raw))
    return header, metadata


def _check_layout(path: Path, header: Mapping[str, Any], data_size: int) -> None:
    """The tensors tile the data section exactly: no overlap, no gap, nothing outside."""
    spans = [(*_check_entry(path, name, info, data_size), name) for name, info in header.items()]
    end = 0
    for begin, stop, name in sorted(spans):
        if begin < end:
            raise _invalid(path, f"tensor {name!r} overlaps another tensor")
        if begin > end:
            raise _invalid(path, f"{begin - end} unused bytes before tensor {name!r}")
        end = stop
    if end != data_size:
        raise _invalid(path, f"the tensors cover {end} of {data_size} data bytes")


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


def decode_metadata(path: Path, raw: Mapping[str, str]) -> dict[str, Any]:
    """The JSON-decoded metadata of a capsctl file from its raw header strings (no ``format``)."""
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


def load_file_tensors(
    path: Path, device: str | torch.device = "cpu", *, validate: bool = True
) -> dict[str, torch.Tensor]:
    """All tensors of one safetensors file on ``device``.

    The header is validated first (:func:`read_header`) unless ``validate=False``, for a
    caller that has just validated it.
    """
    if validate:
        read_header(path)
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(
            f"cannot load tensors from {path}: {' '.join(str(e).split())}"
        ) from None


def state_mismatch(
    model: torch.nn.Module, state: Mapping[str, torch.Tensor], name: Callable[[str], str]
) -> str | None:
    """The first problems between ``model``'s tensors and ``state`` as one phrase (missing,
    unexpected, wrong shape; ``name`` renders a tensor's key), or None when they fit."""
    expected = model.state_dict()
    problems = [f"missing {name(k)}" for k in expected if k not in state]
    problems += [f"unexpected {name(k)}" for k in state if k not in expected]
    problems += [
        f"{name(k)} has shape {tuple(state[k].shape)}, the model needs {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if not problems:
        return None
    more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
    return ", ".join(problems[:3]) + more
