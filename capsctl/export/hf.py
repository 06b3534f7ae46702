"""Export a checkpoint as a model folder in the Hugging Face layout (``--format hf``).

The folder holds ``model.safetensors`` (weights only), ``config.json`` (see
:mod:`capsctl.checkpoint.folder` for both) and ``README.md``, a model card
(:mod:`capsctl.export.card`). It is created as a whole: the files are written into a temporary
folder next to the target, the folder is loaded back with
:func:`capsctl.checkpoint.load_checkpoint` and its logits on the check images must equal the
checkpoint's exactly, and only then is it renamed into place.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save as safetensors_bytes
from torch import Tensor

from capsctl.atomic import check_output, fsync_dir, write_atomic, write_text_atomic
from capsctl.checkpoint import (
    CONFIG_NAME,
    MODEL_PREFIX,
    WEIGHTS_NAME,
    config_from_metadata,
    load_checkpoint,
    read_metadata,
    resolve_checkpoint,
)
from capsctl.checkpoint.folder import weights_metadata
from capsctl.checkpoint.format import storable_tensors
from capsctl.compare.flops import count_flops
from capsctl.errors import CapsctlError, CheckpointError, UsageError
from capsctl.events import EventFn, emit
from capsctl.export.card import DEFAULT_LICENSE, model_card
from capsctl.export.formats import check_writable_folder, default_output_path
from capsctl.export.parity import ExportResult, max_abs_diff, parity_error
from capsctl.export.source import ExportSource, load_source
from capsctl.models import parameter_counts
from capsctl.outputs import MODEL_FOLDER

__all__ = ["CARD_NAME", "FOLDER_FILES", "export_model_folder"]

CARD_NAME = "README.md"
#: The files of a model folder, in the order they are listed.
FOLDER_FILES = (WEIGHTS_NAME, CONFIG_NAME, CARD_NAME)


def _weights_bytes(state: Mapping[str, Tensor], config: Mapping[str, Any], path: Path) -> bytes:
    """``model.safetensors``: the weights under their ``state_dict()`` names, ``format: pt``
    and the record of ``config`` (:func:`capsctl.checkpoint.folder.weights_metadata`)."""
    try:
        return safetensors_bytes(storable_tensors(state, path), metadata=weights_metadata(config))
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"could not write {path}: {e}") from None


def _check_output_folder(out: Path, ckpt: Path, overwrite: bool) -> None:
    if out.resolve() == ckpt.resolve():
        raise UsageError(
            f"the export would overwrite the checkpoint {ckpt}; pick another output folder"
        )
    if out.exists() and not out.is_dir():
        raise CapsctlError(
            f"cannot write the model folder {out}: it exists and is not a folder; pick another "
            "output folder"
        )
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise CapsctlError(
                f"cannot write the model folder {out}: it exists and is not empty; pass "
                "--overwrite to replace it or pick another output folder"
            )
        if ckpt.resolve().is_relative_to(out.resolve()):
            raise UsageError(
                f"the export would replace {out}, which holds the checkpoint {ckpt}; pick "
                "another output folder"
            )
    check_output(out, kind=MODEL_FOLDER, inputs=[ckpt], overwrite=overwrite)
    check_writable_folder(out)


def _publish_folder(tmp: Path, out: Path) -> None:
    """Move the finished folder ``tmp`` to ``out`` (an existing ``out`` is replaced)."""
    old: Path | None = None
    emptied = False
    try:
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
            emptied = True
        elif out.exists():
            old = out.with_name(f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.old")
            os.rename(out, old)
        os.rename(tmp, out)
    except OSError as e:
        with contextlib.suppress(OSError):
            if old is not None and not out.exists():
                os.rename(old, out)
            elif emptied and not out.exists():
                out.mkdir()
        raise CapsctlError(
            f"cannot write the model folder {out}: {e.strerror or e}; nothing was changed"
        ) from None
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_files(tmp: Path, out: Path, source: ExportSource, card: str) -> None:
    """The three files of the folder, into the (new, empty) folder ``tmp``."""
    state = {
        k[len(MODEL_PREFIX) :]: v for k, v in source.tensors.items() if k.startswith(MODEL_PREFIX)
    }
    config = config_from_metadata(source.metadata)
    write_atomic(tmp / WEIGHTS_NAME, _weights_bytes(state, config, out / WEIGHTS_NAME))
    text = json.dumps(config, indent=2, ensure_ascii=False, default=str) + "\n"
    write_text_atomic(tmp / CONFIG_NAME, text)
    write_text_atomic(tmp / CARD_NAME, card)


def _loaded_back_diff(tmp: Path, source: ExportSource) -> float:
    """Largest ``|folder - checkpoint|`` over the check batches, the folder loaded from disk."""
    loaded, _ = load_checkpoint(tmp)
    with torch.no_grad():
        outs = [loaded(b) for b in source.batches]
    return max_abs_diff(outs, source.refs)


def _card(source: ExportSource, name: str, license: str, repo_id: str | None) -> str:
    model, c, s = source.model, source.channels, source.size
    return model_card(
        source.metadata,
        name=name,
        params=parameter_counts(model),
        gflops=count_flops(model, (c, s, s)),
        license=license,
        repo_id=repo_id,
    )


def write_model_folder(
    source: ExportSource,
    out: Path,
    *,
    license: str = DEFAULT_LICENSE,
    name: str | None = None,
    repo_id: str | None = None,
    on_event: EventFn = None,
) -> ExportResult:
    """Write the loaded checkpoint ``source`` as the model folder ``out``, checked exactly.

    Events: ``export_build``, ``export_check``, ``export_done``. See
    :func:`export_model_folder` for ``license``, ``name`` and ``repo_id``.
    """
    card = _card(source, name or out.name, license, repo_id)
    emit(on_event, "export_build", format="hf", path=str(out))
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    checked_on, batch_sizes = source.check.description, source.batch_sizes
    start = time.perf_counter()
    try:
        tmp.mkdir()
        _write_files(tmp, out, source, card)
        seconds = time.perf_counter() - start
        start = time.perf_counter()
        diff = _loaded_back_diff(tmp, source)
        check_s = time.perf_counter() - start
        emit(
            on_event,
            "export_check",
            format="hf",
            max_abs_diff=diff,
            batch_sizes=batch_sizes,
            checked_on=checked_on,
        )
        if not diff <= 0.0:  # also catches NaN
            raise parity_error("hf", diff, 0.0, checked_on)
        _publish_folder(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size_bytes = sum((out / f).stat().st_size for f in FOLDER_FILES)
    emit(
        on_event, "export_done", format="hf", path=str(out), size_bytes=size_bytes, seconds=seconds
    )
    return ExportResult(
        path=out,
        format="hf",
        sidecar=out / CONFIG_NAME,
        max_abs_diff=diff,
        checked_on=checked_on,
        size_bytes=size_bytes,
        batch_sizes=batch_sizes,
        seconds=seconds,
        check_seconds=check_s,
        files=list(FOLDER_FILES),
        tolerance=0.0,
        notes=list(source.check.notes),
    )


def export_model_folder(
    ckpt: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    *,
    check_images: int | Tensor | None = 16,
    check_description: str | None = None,
    data_dir: str | None = None,
    overwrite: bool = False,
    license: str = DEFAULT_LICENSE,
    name: str | None = None,
    repo_id: str | None = None,
    on_event: EventFn = None,
) -> ExportResult:
    """Write checkpoint ``ckpt`` as a model folder ``out`` and check that it loads back exactly.

    ``out``: default ``<stem>-hf`` in the current folder. An existing empty folder is filled; a
    non-empty one is refused unless ``overwrite`` (then it is replaced, and only when it is an
    earlier model folder; never a run or suite folder nor a folder in one). The check
    images are chosen as in :func:`capsctl.export.export_checkpoint`. ``license``, ``name``
    (default: the folder's name) and ``repo_id`` (default: ``name``) go into the model card.
    """
    ckpt = resolve_checkpoint(ckpt)  # a run folder: its best.safetensors
    meta = read_metadata(ckpt)  # the only read of the header
    out = default_output_path(ckpt, "hf") if out is None else Path(out)
    _check_output_folder(out, ckpt, overwrite)
    emit(on_event, "export_load", checkpoint=str(ckpt), format="hf")
    source = load_source(
        ckpt,
        meta,
        check_images,
        check_description=check_description,
        data_dir=data_dir,
        on_event=on_event,
    )
    return write_model_folder(
        source, out, license=license, name=name, repo_id=repo_id, on_event=on_event
    )
