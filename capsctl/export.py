"""Export a checkpoint for deployment: ONNX, ``torch.export`` (.pt2) or a weights-only release.

:func:`export_checkpoint` loads a capsctl checkpoint, writes one artifact and checks it:

* ``onnx``: ``torch.onnx.export(..., dynamo=True)`` with a dynamic batch axis, one
  self-contained file (no external data). The file is run in onnxruntime and compared with eager
  PyTorch at two batch sizes (``N`` and ``N + 1`` check images, neither of which is the export
  example's batch of 2), so the dynamic axis is known to work.
* ``pt2``: ``torch.export.export`` with a dynamic batch dim, ``torch.export.save``; the file is
  loaded back with ``torch.export.load`` and compared the same way.
* ``safetensors``: a weights-only copy (:func:`capsctl.checkpoint.strip_training_state`:
  metadata kept, optimizer/scheduler/EMA/RNG state dropped), rebuilt with
  :func:`capsctl.checkpoint.load_checkpoint`; its outputs must be identical.
* ``hf``: a model folder in the Hugging Face layout (``model.safetensors`` weights only,
  ``config.json``, ``README.md`` model card), see :func:`capsctl.hub.export_model_folder`;
  loaded back from the folder, its outputs must be identical.

Every file artifact gets a JSON sidecar ``<artifact>.json`` (input size, channels,
normalization, class names, format, versions, source checkpoint and the parity result); a model
folder carries the same facts in its ``config.json``. Files are written to a temporary file (a
temporary folder for ``hf``) next to the target and renamed into place only after the check
passed.

Exporting the capsule network: the eager routed pass walks over the batch in chunks with a
Python loop, which tracing would unroll and specialize to the example's batch size. While
tracing, :func:`capsctl.layers.routing.dense_routing` selects the dense formula of the same
pass (one expression for any batch size); the eager model used as the parity reference keeps
the chunked code, so the check compares the two implementations.

Nothing is printed; progress goes to ``on_event`` as dicts ``{"event": name, ...}``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from capsctl import __version__
from capsctl.atomic import fsync_dir, temp_path, write_atomic
from capsctl.checkpoint import (
    TRAINING_STATE_KEY,
    load_checkpoint,
    read_header,
    read_metadata,
    strip_training_state,
)
from capsctl.errors import CapsctlError, UsageError

__all__ = [
    "FORMATS",
    "ExportResult",
    "default_output_path",
    "export_checkpoint",
    "write_atomic",
]

Event = dict[str, Any]
EventFn = Callable[[Event], None] | None

#: Export formats and the suffix of their default output path.
FORMATS: dict[str, str] = {
    "onnx": ".onnx",
    "pt2": ".pt2",
    "safetensors": ".release.safetensors",
    "hf": "-hf",
}
#: Batch size of the example input used for tracing (>= 2, so the batch dim is not special).
EXAMPLE_BATCH = 2
#: Number of seeded random check images used when the caller passes none.
SYNTHETIC_IMAGES = 4
_ONNX_PACKAGES = ("onnx", "onnxscript", "onnxruntime")
_ONNX_MISSING = "ONNX export needs onnx, onnxscript and onnxruntime: pip install 'capsctl[export]'"


@dataclass
class ExportResult:
    """What :func:`export_checkpoint` wrote and how it was checked.

    ``path``: the artifact (for ``hf``: the model folder); ``format``:
    ``onnx``/``pt2``/``safetensors``/``hf``; ``sidecar``: the JSON file next to it (for ``hf``:
    the folder's ``config.json``); ``max_abs_diff``: largest ``|artifact - eager PyTorch|``
    over all logits checked (None if nothing was compared); ``checked_on``: what it was
    compared on, e.g. ``"4 synthetic images"``; ``size_bytes``: size of the artifact;
    ``batch_sizes``: batch sizes run through the artifact; ``seconds``: wall time of the
    export (trace and write); ``check_seconds``: wall time of the check; ``files``: for
    ``hf``, the names of the files in the folder.
    """

    path: Path
    format: str
    sidecar: Path
    max_abs_diff: float | None
    checked_on: str
    size_bytes: int
    batch_sizes: list[int] = field(default_factory=list)
    seconds: float = 0.0
    check_seconds: float = 0.0
    files: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["path"], data["sidecar"] = str(self.path), str(self.sidecar)
        return data


def _emit(on_event: EventFn, event: str, **fields: Any) -> None:
    if on_event is not None:
        on_event({"event": event, **fields})


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def _check_writable_folder(path: Path) -> None:
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


def _publish(tmp: Path, path: Path) -> None:
    """fsync ``tmp`` and rename it over ``path``."""
    try:
        with open(tmp, "rb+") as file:
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise CapsctlError(f"cannot write {path}: {e.strerror or e}") from None
    fsync_dir(path.parent)


def default_output_path(ckpt: str | os.PathLike[str], fmt: str) -> Path:
    """``<folder>/<stem><suffix>`` next to the checkpoint (see :data:`FORMATS`)."""
    ckpt = Path(ckpt)
    return ckpt.with_name(ckpt.stem + FORMATS[fmt])


# --------------------------------------------------------------------------------------------
# Tracing
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _traceable_routing() -> Iterator[None]:
    """Trace the routed pass as one expression over the whole batch (see ``dense_routing``)."""
    from capsctl.layers.routing import dense_routing

    with dense_routing():
        yield


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


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------


def _check_inputs(
    check_images: Tensor | None, channels: int, size: int, description: str | None
) -> tuple[Tensor, str]:
    if check_images is None:
        g = torch.Generator().manual_seed(0)
        images = torch.randn(SYNTHETIC_IMAGES, channels, size, size, generator=g)
        return images, description or f"{SYNTHETIC_IMAGES} synthetic images"
    if not isinstance(check_images, Tensor) or check_images.dim() != 4:
        raise UsageError("check images must be a float tensor [N, C, H, W]; pass normalized images")
    n, c, h, w = check_images.shape
    if n < 1 or (c, h, w) != (channels, size, size):
        raise UsageError(
            f"check images have shape {list(check_images.shape)} but the model takes "
            f"[N>=1, {channels}, {size}, {size}]; pass images of the model's input size"
        )
    images = check_images.detach().to("cpu", torch.float32)
    noun = "image" if n == 1 else "images"
    return images, description or f"{n} {noun}"


def _parity_batches(images: Tensor) -> list[Tensor]:
    """The check images as one batch of N and one of N + 1 (the first image repeated)."""
    return [images, torch.cat([images, images[:1]])]


def _max_diff(outs: list[Tensor], refs: list[Tensor]) -> float:
    """Largest ``|out - ref|`` over all pairs (NaN if any output is NaN)."""
    diffs = [(o.double() - r.double()).abs().max() for o, r in zip(outs, refs, strict=True)]
    return float(torch.stack(diffs).max())


def _fail_parity(fmt: str, diff: float, tolerance: float, checked_on: str) -> CapsctlError:
    return CapsctlError(
        f"{fmt} export does not match PyTorch: max |diff| = {diff:.3g} > tolerance "
        f"{tolerance:g} on {checked_on}; the artifact was not written, report this as a bug"
    )


def _export_onnx(
    wrapped: nn.Module, example: Tensor, tmp: Path, batches: list[Tensor], refs: list[Tensor]
) -> tuple[float, float, float]:
    import onnx
    import onnxruntime as ort
    from onnx.external_data_helper import uses_external_data

    start = time.perf_counter()
    try:
        with _traceable_routing(), torch.no_grad():
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
    outs = [torch.from_numpy(session.run(None, {name: b.numpy()})[0]) for b in batches]
    return _max_diff(outs, refs), seconds, time.perf_counter() - start


def _export_pt2(
    wrapped: nn.Module, example: Tensor, tmp: Path, batches: list[Tensor], refs: list[Tensor]
) -> tuple[float, float, float]:
    start = time.perf_counter()
    try:
        with _traceable_routing(), torch.no_grad():
            program = torch.export.export(wrapped, (example,), dynamic_shapes=_batch_dim())
        torch.export.save(program, str(tmp))
    except Exception as e:
        raise CapsctlError(f"torch.export failed ({_one_line(e)}); report this as a bug") from e
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    loaded = torch.export.load(str(tmp)).module()
    with torch.no_grad():
        outs = [loaded(b) for b in batches]
    return _max_diff(outs, refs), seconds, time.perf_counter() - start


def _export_release(
    ckpt: Path, tmp: Path, batches: list[Tensor], refs: list[Tensor]
) -> tuple[float, float, float]:
    start = time.perf_counter()
    strip_training_state(ckpt, tmp)
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    header, _ = read_header(tmp)
    extra = [k for k in header if not k.startswith("model.")]
    if extra or TRAINING_STATE_KEY in read_metadata(tmp):
        raise CapsctlError(
            f"the release file still holds training state ({extra[:3]}); report this"
        )
    model, _ = load_checkpoint(tmp)
    with torch.no_grad():
        outs = [model(b) for b in batches]
    return _max_diff(outs, refs), seconds, time.perf_counter() - start


def export_checkpoint(
    ckpt: str | os.PathLike[str],
    fmt: str,
    out: str | os.PathLike[str] | None = None,
    *,
    check_images: Tensor | None = None,
    check_description: str | None = None,
    tolerance: float = 1e-4,
    overwrite: bool = False,
    on_event: EventFn = None,
) -> ExportResult:
    """Export checkpoint ``ckpt`` as ``fmt`` (``onnx``, ``pt2``, ``safetensors``, ``hf``), check it.

    ``ckpt``: a capsctl checkpoint file or a model folder.

    ``out``: the artifact path; default :func:`default_output_path`; an existing folder gets
    the default file name inside it. ``check_images``: normalized float images ``[N, C, H, W]``
    to compare the artifact with eager PyTorch on (default: 4 seeded random images),
    described in the result as ``check_description`` (default ``"N images"``). A difference
    above ``tolerance`` raises :class:`CapsctlError` and leaves nothing written; a release
    safetensors file and a model folder must reproduce the outputs exactly. For ``hf``, ``out``
    is the model folder itself (default ``<folder>/<stem>-hf``; see
    :func:`capsctl.hub.export_model_folder`): an existing empty folder is filled, a non-empty
    one is refused unless ``overwrite``. Raises :class:`UsageError` for an
    unknown format or bad check images, :class:`CapsctlError` for a missing optional package,
    an output folder that does not exist or is not writable, or a failed export,
    :class:`~capsctl.errors.CheckpointError` for an unreadable checkpoint.
    """
    if fmt not in FORMATS:
        raise UsageError(f"unknown export format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    if fmt == "onnx" and any(importlib.util.find_spec(p) is None for p in _ONNX_PACKAGES):
        raise CapsctlError(_ONNX_MISSING)
    if not tolerance >= 0:
        raise UsageError(f"tolerance must be >= 0, got {tolerance}")
    if fmt == "hf":
        from capsctl.hub import export_model_folder

        return export_model_folder(
            ckpt,
            out,
            check_images=check_images,
            check_description=check_description,
            overwrite=overwrite,
            on_event=on_event,
        )
    ckpt = Path(ckpt)
    read_metadata(ckpt)  # a missing or foreign checkpoint is reported before the output path
    path = default_output_path(ckpt, fmt) if out is None else Path(out)
    if out is not None and path.is_dir():
        path = path / default_output_path(ckpt, fmt).name
    if path.resolve() == ckpt.resolve():
        raise UsageError(
            f"the export would overwrite the checkpoint {ckpt}; pick another output path"
        )
    sidecar = path.with_name(path.name + ".json")
    _check_writable_folder(path)

    _emit(on_event, "export_load", checkpoint=str(ckpt), format=fmt)
    model, metadata = load_checkpoint(ckpt)
    model.eval()
    config = getattr(model, "config", None)
    channels = int(metadata.get("in_channels") or getattr(config, "in_channels", 3))
    size = int(metadata.get("input_size") or getattr(config, "input_size", 32))
    images, checked_on = _check_inputs(check_images, channels, size, check_description)
    batches = _parity_batches(images)
    with torch.no_grad():
        refs = [model(b) for b in batches]
    batch_sizes = [int(b.shape[0]) for b in batches]

    wrapped = _Logits(model).eval()
    for p in wrapped.parameters():
        p.requires_grad_(False)
    example = torch.randn(
        EXAMPLE_BATCH, channels, size, size, generator=torch.Generator().manual_seed(1)
    )

    tmp = temp_path(path)
    _emit(on_event, "export_build", format=fmt, path=str(path))
    try:
        if fmt == "onnx":
            diff, seconds, check_s = _export_onnx(wrapped, example, tmp, batches, refs)
        elif fmt == "pt2":
            diff, seconds, check_s = _export_pt2(wrapped, example, tmp, batches, refs)
        else:
            diff, seconds, check_s = _export_release(ckpt, tmp, batches, refs)
        _emit(
            on_event,
            "export_check",
            format=fmt,
            max_abs_diff=diff,
            batch_sizes=batch_sizes,
            checked_on=checked_on,
        )
        limit = 0.0 if fmt == "safetensors" else tolerance
        if not diff <= limit:  # also catches NaN
            raise _fail_parity(fmt, diff, limit, checked_on)
        _publish(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)

    size_bytes = path.stat().st_size
    info = {
        "format": fmt,
        "file": path.name,
        "source_checkpoint": ckpt.name,
        "capsctl_version": __version__,
        "torch_version": torch.__version__,
        "input": {
            "name": "images",
            "shape": ["batch", channels, size, size],
            "dtype": "float32",
            "layout": "NCHW",
            "normalized": True,
        },
        "output": {"name": "logits", "shape": ["batch", len(metadata.get("classes") or [])]},
        "input_size": size,
        "in_channels": channels,
        "normalization": metadata.get("normalization"),
        "classes": metadata.get("classes"),
        "arch": getattr(config, "arch", None),
        "routing": {
            "iterations": getattr(model, "iterations", None),
            "mode": getattr(model, "routing", None),
        },
        "epoch": metadata.get("epoch"),
        "metrics": metadata.get("metrics"),
        "size_bytes": size_bytes,
        "parity": {
            "reference": "eager PyTorch",
            "max_abs_diff": diff,
            "tolerance": limit,
            "checked_on": checked_on,
            "batch_sizes": batch_sizes,
        },
    }
    write_atomic(sidecar, (json.dumps(info, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))
    _emit(
        on_event, "export_done", format=fmt, path=str(path), size_bytes=size_bytes, seconds=seconds
    )
    return ExportResult(
        path=path,
        format=fmt,
        sidecar=sidecar,
        max_abs_diff=diff,
        checked_on=checked_on,
        size_bytes=size_bytes,
        batch_sizes=batch_sizes,
        seconds=seconds,
        check_seconds=check_s,
    )
