"""``export_checkpoint``: the library call of ``capsctl export``."""

from __future__ import annotations

import importlib.util
import os

from torch import Tensor

from capsctl.checkpoint import read_metadata, resolve_checkpoint
from capsctl.errors import CapsctlError, UsageError
from capsctl.events import EventFn, emit
from capsctl.export.formats import FORMATS, export_file, output_file
from capsctl.export.hf import export_model_folder
from capsctl.export.parity import ExportResult
from capsctl.export.source import load_source

__all__ = ["export_checkpoint"]

_ONNX_PACKAGES = ("onnx", "onnxscript", "onnxruntime")
_ONNX_MISSING = "ONNX export needs onnx, onnxscript and onnxruntime: pip install 'capsctl[export]'"


def export_checkpoint(
    ckpt: str | os.PathLike[str],
    fmt: str,
    out: str | os.PathLike[str] | None = None,
    *,
    check_images: int | Tensor | None = 16,
    check_description: str | None = None,
    data_dir: str | None = None,
    tolerance: float = 1e-4,
    overwrite: bool = False,
    on_event: EventFn = None,
) -> ExportResult:
    """Export checkpoint ``ckpt`` as ``fmt`` (``onnx``, ``pt2``, ``safetensors``, ``hf``), check it.

    ``ckpt``: a capsctl checkpoint file or a model folder; its header is read once.

    ``out``: the artifact path; default ``<stem><suffix>`` in the current folder
    (:data:`capsctl.export.formats.FORMATS`), never beside the checkpoint in its run folder;
    an existing folder gets the default file name inside it. An existing file there (or at its
    ``<artifact>.json`` sidecar) is refused unless ``overwrite``, and even then unless it is an
    earlier export of the same kind; a file the export reads, and any path in a run or suite
    folder, are refused always (:func:`capsctl.atomic.check_output`). For ``hf``, ``out`` is
    the model folder itself (default ``<stem>-hf``): an existing empty folder is filled, a
    non-empty one is refused unless ``overwrite`` and an earlier model folder.

    ``check_images``: what the artifact is compared with eager PyTorch on. An int ``n``
    (default 16): the first ``n`` test images of the checkpoint's dataset, looked for in
    ``data_dir`` (default: ``$CAPSCTL_DATA``, else the user cache); when they are unavailable, 4
    seeded random images instead, and the result's ``notes`` and a ``warning`` event say why.
    A tensor: these normalized float images ``[N, C, H, W]``, described in the result as
    ``check_description`` (default ``"N images"``). None: the 4 seeded random images.

    A difference above ``tolerance`` raises :class:`CapsctlError` and leaves nothing written; a
    release safetensors file and a model folder must reproduce the outputs exactly. Raises
    :class:`UsageError` for an unknown format or bad check images, :class:`CapsctlError` for a
    missing optional package, an output folder that does not exist or is not writable, or a
    failed export, :class:`~capsctl.errors.CheckpointError` for an unreadable checkpoint.
    Events: ``export_load``, ``warning``, ``export_build``, ``export_check``, ``export_done``.
    """
    if fmt not in FORMATS:
        raise UsageError(f"unknown export format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    if fmt == "onnx" and any(importlib.util.find_spec(p) is None for p in _ONNX_PACKAGES):
        raise CapsctlError(_ONNX_MISSING)
    if not tolerance >= 0:
        raise UsageError(f"tolerance must be >= 0, got {tolerance}")
    if fmt == "hf":
        return export_model_folder(
            ckpt,
            out,
            check_images=check_images,
            check_description=check_description,
            data_dir=data_dir,
            overwrite=overwrite,
            on_event=on_event,
        )
    ckpt = resolve_checkpoint(ckpt)  # a run folder: its best.safetensors
    meta = read_metadata(ckpt)  # a missing or foreign checkpoint is reported before the output
    path = output_file(ckpt, fmt, out, overwrite)
    emit(on_event, "export_load", checkpoint=str(ckpt), format=fmt)
    source = load_source(
        ckpt,
        meta,
        check_images,
        check_description=check_description,
        data_dir=data_dir,
        on_event=on_event,
    )
    return export_file(source, fmt, path, tolerance, on_event, overwrite=overwrite)
