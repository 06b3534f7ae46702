"""Export to one file: ONNX, ``torch.export`` (.pt2) or a weights-only safetensors release.

* ``onnx``: ``torch.onnx.export(..., dynamo=True)`` with a dynamic batch axis, one
  self-contained file (no external data), run in onnxruntime for the parity check;
* ``pt2``: ``torch.export.export`` with a dynamic batch dim, ``torch.export.save``; loaded back
  with ``torch.export.load`` for the check;
* ``safetensors``: the ``model.*`` tensors and the metadata without the training state
  (:func:`capsctl.checkpoint.weights_only`), rebuilt with
  :func:`capsctl.checkpoint.load_checkpoint`; its outputs must be identical.

Each file is written to a temporary file next to the target and renamed into place only after
the parity check (:mod:`capsctl.export.parity`) passed; a JSON sidecar ``<artifact>.json``
(input size, channels, normalization, class names, format, versions, source checkpoint and
the parity result) is written next to it.

Exporting the capsule network: the eager routed pass walks over the batch in chunks with a
Python loop, which tracing would unroll and specialize to the example's batch size. While
tracing, :func:`capsctl.layers.dispatch.use` (``"dense"``) selects the dense formula of the same
pass (one expression for any batch size); the eager model used as the parity reference keeps
the chunked code, so the check compares the two implementations.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from capsctl.atomic import check_output, fsync_dir, publish, same_file, temp_path, write_atomic
from capsctl.checkpoint import (
    TRAINING_STATE_KEY,
    load_checkpoint,
    read_header,
    save_checkpoint,
    weights_only,
)
from capsctl.checkpoint.format import library_versions
from capsctl.errors import CapsctlError, UsageError
from capsctl.events import EventFn, emit
from capsctl.export.parity import EXAMPLE_BATCH, ExportResult, max_abs_diff, parity_error
from capsctl.export.source import ExportSource
from capsctl.layers import dispatch
from capsctl.outputs import EXPORT_SIDECAR, ONNX, PT2, RELEASE, OutputKind

__all__ = [
    "FORMATS",
    "check_writable_folder",
    "default_output_path",
    "export_file",
    "output_file",
]

#: Export formats and the suffix of their default output path.
FORMATS: dict[str, str] = {
    "onnx": ".onnx",
    "pt2": ".pt2",
    "safetensors": ".release.safetensors",
    "hf": "-hf",
}

#: The kind of output of each one-file format (:func:`capsctl.atomic.check_output`).
_KINDS: dict[str, OutputKind] = {"onnx": ONNX, "pt2": PT2, "safetensors": RELEASE}

# What a format's writer returns: (max |diff|, export seconds, check seconds).
_Timings = tuple[float, float, float]


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def default_output_path(ckpt: str | os.PathLike[str], fmt: str) -> Path:
    """``<stem><suffix>`` in the current folder (see :data:`FORMATS`): not beside the
    checkpoint, whose run folder belongs to its run."""
    return Path(Path(ckpt).stem + FORMATS[fmt])


def check_writable_folder(path: Path) -> None:
    """Raise CapsctlError unless a file can be created next to ``path``."""
    folder = path.parent
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise CapsctlError(
            f"cannot write {path}: the folder {folder} {what}; "
            "create it or pick another output path"
        )
    probe = temp_path(path)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as e:
        raise CapsctlError(
            f"cannot write {path}: the folder {folder} is not writable ({e.strerror or e}); "
            "pick another output path"
        ) from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)


def source_files(ckpt: Path) -> list[Path]:
    """The files an export reads: the checkpoint, or every file of a model folder."""
    return sorted(p for p in ckpt.iterdir() if p.is_file()) if ckpt.is_dir() else [ckpt]


def sidecar_path(path: Path) -> Path:
    """``<artifact>.json``, the sidecar written next to an exported file."""
    return path.with_name(path.name + ".json")


def output_file(
    ckpt: Path, fmt: str, out: str | os.PathLike[str] | None, overwrite: bool = False
) -> Path:
    """The artifact path: ``out``, the default name inside an existing folder ``out``, or
    :func:`default_output_path`; never the checkpoint itself; its folder must be writable.

    The artifact and its sidecar must not be a file the export reads (even with
    ``overwrite``), nor lie in a run or suite folder, nor exist unless ``overwrite`` and then
    only as an earlier export of the same kind (:func:`check_output`): :class:`UsageError`.
    """
    path = default_output_path(ckpt, fmt) if out is None else Path(out)
    if out is not None and path.is_dir():
        path = path / default_output_path(ckpt, fmt).name
    inputs = source_files(ckpt)
    if any(same_file(path, f) for f in inputs) or same_file(path, ckpt):
        raise UsageError(
            f"the export would overwrite the checkpoint {ckpt}; pick another output path"
        )
    for target, kind in ((path, _KINDS[fmt]), (sidecar_path(path), EXPORT_SIDECAR)):
        check_output(target, kind=kind, inputs=inputs, overwrite=overwrite)
    check_writable_folder(path)
    return path


def _publish(tmp: Path, path: Path, overwrite: bool) -> None:
    """fsync ``tmp`` and rename it to ``path`` (replacing a file there only if ``overwrite``)."""
    try:
        with open(tmp, "rb+") as file:
            os.fsync(file.fileno())
        publish(tmp, path, overwrite=overwrite)
    except OSError as e:
        raise CapsctlError(f"cannot write {path}: {e.strerror or e}") from None
    fsync_dir(path.parent)


# --------------------------------------------------------------------------------------------
# Writers
# --------------------------------------------------------------------------------------------


class _Logits(nn.Module):
    """``images [b, C, H, W] -> logits [b, classes]``: the model with a plain signature."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: Tensor) -> Tensor:
        return self.model(images)


def _batch_dim() -> Any:
    return {"images": {0: torch.export.Dim("batch", min=1, max=1 << 20)}}


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".strip()


def _export_onnx(source: ExportSource, tmp: Path, wrapped: nn.Module, example: Tensor) -> _Timings:
    import onnx
    import onnxruntime as ort
    from onnx.external_data_helper import uses_external_data

    start = time.perf_counter()
    try:
        with dispatch.use("dense"), torch.no_grad():
            torch.onnx.export(
                wrapped,
                (example,),
                str(tmp),
                dynamo=True,
                external_data=False,
                dynamic_shapes=_batch_dim(),
                input_names=["images"],
                output_names=["logits"],
                verbose=False,
            )
    except Exception as e:
        raise CapsctlError(f"ONNX export failed ({_one_line(e)}); report this as a bug") from e
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    proto = onnx.load(str(tmp), load_external_data=False)
    if any(uses_external_data(t) for t in proto.graph.initializer):
        raise CapsctlError(
            "the ONNX model needs external data files (it is larger than 2 GB); "
            "export to pt2 instead"
        )
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(tmp), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    outs = [torch.from_numpy(session.run(None, {name: b.numpy()})[0]) for b in source.batches]
    return max_abs_diff(outs, source.refs), seconds, time.perf_counter() - start


def _export_pt2(source: ExportSource, tmp: Path, wrapped: nn.Module, example: Tensor) -> _Timings:
    start = time.perf_counter()
    try:
        with dispatch.use("dense"), torch.no_grad():
            program = torch.export.export(wrapped, (example,), dynamic_shapes=_batch_dim())
        torch.export.save(program, str(tmp))
    except Exception as e:
        raise CapsctlError(f"torch.export failed ({_one_line(e)}); report this as a bug") from e
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    loaded = torch.export.load(str(tmp)).module()
    with torch.no_grad():
        outs = [loaded(b) for b in source.batches]
    return max_abs_diff(outs, source.refs), seconds, time.perf_counter() - start


def _export_release(
    source: ExportSource, tmp: Path, wrapped: nn.Module, example: Tensor
) -> _Timings:
    start = time.perf_counter()
    save_checkpoint(tmp, *weights_only(source.tensors, source.metadata))
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    header, raw = read_header(tmp)
    extra = [k for k in header if not k.startswith("model.")]
    if extra or TRAINING_STATE_KEY in raw:
        raise CapsctlError(
            f"the release file still holds training state ({extra[:3]}); report this"
        )
    model, _ = load_checkpoint(tmp)
    with torch.no_grad():
        outs = [model(b) for b in source.batches]
    return max_abs_diff(outs, source.refs), seconds, time.perf_counter() - start


_WRITERS = {"onnx": _export_onnx, "pt2": _export_pt2, "safetensors": _export_release}


# --------------------------------------------------------------------------------------------
# One export
# --------------------------------------------------------------------------------------------


def _sidecar(source: ExportSource, fmt: str, path: Path, result: ExportResult) -> dict[str, Any]:
    """The facts of ``<artifact>.json``: what goes in and out, where it came from, the check."""
    meta, model, c, s = source.metadata, source.model, source.channels, source.size
    config = getattr(model, "config", None)
    return {
        "format": fmt,
        "file": path.name,
        "source_checkpoint": source.path.name,
        **library_versions(),
        "input": {
            "name": "images",
            "shape": ["batch", c, s, s],
            "dtype": "float32",
            "layout": "NCHW",
            "normalized": True,
        },
        "output": {"name": "logits", "shape": ["batch", len(meta.get("classes") or [])]},
        "input_size": s,
        "in_channels": c,
        "normalization": meta.get("normalization"),
        "classes": meta.get("classes"),
        "arch": getattr(config, "arch", None),
        "routing": {
            "iterations": getattr(model, "iterations", None),
            "mode": getattr(model, "routing", None),
        },
        "epoch": meta.get("epoch"),
        "metrics": meta.get("metrics"),
        "size_bytes": result.size_bytes,
        "parity": {
            "reference": "eager PyTorch",
            "max_abs_diff": result.max_abs_diff,
            "tolerance": result.tolerance,
            "checked_on": result.checked_on,
            "batch_sizes": result.batch_sizes,
        },
    }


def export_file(
    source: ExportSource,
    fmt: str,
    path: Path,
    tolerance: float,
    on_event: EventFn = None,
    *,
    overwrite: bool = False,
) -> ExportResult:
    """Write ``source`` as ``fmt`` (onnx, pt2, safetensors) to ``path`` once it passed the check.

    A difference above ``tolerance`` (0 for ``safetensors``) raises :class:`CapsctlError` and
    leaves nothing written. Files already at ``path`` or its sidecar are replaced only with
    ``overwrite`` (see :func:`output_file`). Events: ``export_build``, ``export_check``,
    ``export_done``.
    """
    wrapped = _Logits(source.model).eval()
    for p in wrapped.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    example = torch.randn(EXAMPLE_BATCH, source.channels, source.size, source.size, generator=g)
    checked_on, batch_sizes = source.check.description, source.batch_sizes
    limit = 0.0 if fmt == "safetensors" else tolerance
    tmp = temp_path(path)
    emit(on_event, "export_build", format=fmt, path=str(path))
    try:
        diff, seconds, check_s = _WRITERS[fmt](source, tmp, wrapped, example)
        emit(
            on_event,
            "export_check",
            format=fmt,
            max_abs_diff=diff,
            batch_sizes=batch_sizes,
            checked_on=checked_on,
        )
        if not diff <= limit:  # also catches NaN
            raise parity_error(fmt, diff, limit, checked_on)
        _publish(tmp, path, overwrite)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    sidecar = sidecar_path(path)
    result = ExportResult(
        path=path,
        format=fmt,
        sidecar=sidecar,
        max_abs_diff=diff,
        checked_on=checked_on,
        size_bytes=path.stat().st_size,
        batch_sizes=batch_sizes,
        seconds=seconds,
        check_seconds=check_s,
        tolerance=limit,
        notes=list(source.check.notes),
    )
    info = _sidecar(source, fmt, path, result)
    text = json.dumps(info, indent=2, ensure_ascii=False) + "\n"
    write_atomic(sidecar, text.encode("utf-8"), overwrite=overwrite)
    emit(
        on_event,
        "export_done",
        format=fmt,
        path=str(path),
        size_bytes=result.size_bytes,
        seconds=seconds,
    )
    return result
