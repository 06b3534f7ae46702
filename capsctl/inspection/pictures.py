"""Routing pictures as PNG files: :func:`write_pngs` (matplotlib, imported only here, lazily).

* ``routing_layer{l}_iter{t}.png`` per layer and iteration: the batch-mean coefficients as a
  child type x parent type heatmap (conv layers and FC layers over a grid aggregate children
  per type), one colour scale per layer: from the smallest to the largest mean coefficient of
  that layer over its iterations (coefficients of 0.06-0.14 fill the scale; the iterations of
  a layer stay comparable), with a labelled colour bar;
* ``image{i}_routing.png`` per image:
  :func:`~capsctl.inspection.statistics.spatial_map` upsampled onto the image, with a colorbar
  (scale 0 .. the map's maximum).

Each PNG carries text metadata ``capsctl:vmin``/``capsctl:vmax`` (the colour limits actually
used), ``capsctl:kind`` (``coefficients`` or ``overlay``) and the layer/iteration or image.
Files are written atomically (capsctl/atomic.py).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from capsctl.atomic import write_atomic
from capsctl.errors import CapsctlError, UsageError
from capsctl.events import EventFn, emit
from capsctl.inspection.report import ImageRouting, RoutingReport
from capsctl.inspection.statistics import spatial_map

__all__ = ["layer_limits", "matrix_sum", "write_heatmap", "write_overlay", "write_pngs"]

PLOT_MISSING = "routing pictures need matplotlib: pip install 'capsctl[plot]'"


def figure_class() -> Any:
    """matplotlib's ``Figure`` (no pyplot, no global state), or the pip hint as an error."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise CapsctlError(PLOT_MISSING) from None
    return Figure


def matrix_sum(coeff: Tensor, kind: str, grid: tuple[int, int, int] | None) -> tuple[Tensor, int]:
    """A batch's coefficients summed to ``[child types, parent types]`` (float64) and the count
    of rows summed: their mean is the heatmap of :func:`write_pngs`."""
    coeff = coeff.double()
    m = coeff.shape[-1]
    if kind == "conv":
        rows = coeff.reshape(-1, coeff.shape[-2], m)  # [b, h, w, k, l, n, m] -> [b*h*w*k*l, n, m]
        return rows.sum(0), rows.shape[0]
    if grid is not None:
        rows = coeff.reshape(coeff.shape[0], -1, grid[2], m)  # [b, h*w*n, m] -> [b, h*w, n, m]
        return rows.sum((0, 1)), rows.shape[0] * rows.shape[1]
    return coeff.sum(0), coeff.shape[0]  # [b, n, m] -> [n, m]


def _mean_matrix(report: RoutingReport, li: int, ti: int) -> Tensor:
    """Batch-mean coefficients aggregated to ``[child types, parent types]``."""
    total, count = matrix_sum(report.coefficients[li][ti], report.kinds[li], report.child_grids[li])
    return total / count


def images_hwc(images: Tensor | Any) -> Tensor:
    """Images as float ``[N, H, W, C]`` in [0, 1] (C = 1 or 3)."""
    x = torch.as_tensor(images).detach().cpu()
    if x.dim() == 3:
        x = x.unsqueeze(1)  # [N, H, W] -> [N, 1, H, W]
    if x.dim() != 4:
        raise UsageError("images for pictures must be [N, C, H, W] (uint8 or floats in [0, 1])")
    if x.shape[1] not in (1, 3) and x.shape[-1] in (1, 3):
        x = x.permute(0, 3, 1, 2)  # [N, H, W, C] -> [N, C, H, W]
    if x.shape[1] not in (1, 3):
        raise UsageError(f"images for pictures need 1 or 3 channels, got shape {list(x.shape)}")
    x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float().clamp(0.0, 1.0)
    return x.permute(0, 2, 3, 1)  # [N, C, H, W] -> [N, H, W, C]


def _save_png(fig: Any, path: Path, metadata: dict[str, str]) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata=metadata)
    write_atomic(path, buf.getvalue())


def _layer_name(report: RoutingReport, li: int) -> str:
    last = li == len(report.kinds) - 1
    return f"layer {li} ({report.kinds[li]}{', class capsules' if last else ''})"


def heatmap_name(li: int, t: int) -> str:
    return f"routing_layer{li}_iter{t}.png"


def overlay_name(i: int) -> str:
    return f"image{i}_routing.png"


def layer_limits(matrices: list[Tensor]) -> tuple[float, float]:
    """The colour range of a layer's heatmaps: its smallest and largest mean coefficient over
    ``matrices`` (its iterations), widened a little where they are equal (uniform routing)."""
    lo = min(float(m.min()) for m in matrices)
    hi = max(float(m.max()) for m in matrices)
    if hi - lo < 1e-9:
        pad = max(1e-3 * abs(hi), 1e-6)
        lo, hi = lo - pad, hi + pad
    return lo, hi


def write_heatmap(
    figure: Any,
    report: RoutingReport,
    matrix: Tensor,
    li: int,
    ti: int,
    out: Path,
    limits: tuple[float, float],
) -> Path:
    """``routing_layer{li}_iter{ti + 1}.png``: the mean coefficient ``matrix [n, m]`` of layer
    ``li`` (``report`` gives its kind, the classes and T), coloured over ``limits`` (the
    layer's :func:`layer_limits`)."""
    matrix = matrix.float().numpy()
    n, m = matrix.shape
    fig = figure(figsize=(max(5.0, 1.0 + 0.3 * m), max(3.0, 1.0 + 0.25 * n)))  # title fits
    ax = fig.add_subplot()
    im = ax.imshow(matrix, vmin=limits[0], vmax=limits[1], cmap="viridis", aspect="auto")
    ax.set_ylabel("child capsule type")
    if li == len(report.kinds) - 1:
        ax.set_xlabel("class")
        ax.set_xticks(range(m), report.classes, rotation=45, ha="right")
    else:
        ax.set_xlabel("parent capsule type")
    t = ti + 1
    ax.set_title(f"{_layer_name(report, li)}, iteration {t}/{report.iterations}")
    fig.colorbar(im, ax=ax, label="mean routing coefficient (this layer's range)")
    fig.tight_layout()
    vmin, vmax = im.get_clim()
    path = out / heatmap_name(li, t)
    metadata = {
        "Title": f"capsctl routing layer {li} iteration {t}",
        "capsctl:kind": "coefficients",
        "capsctl:layer": str(li),
        "capsctl:iteration": str(t),
        "capsctl:vmin": repr(float(vmin)),
        "capsctl:vmax": repr(float(vmax)),
    }
    _save_png(fig, path, metadata)
    return path


def write_overlay(
    figure: Any, record: ImageRouting, sm: Tensor, picture: Tensor, out: Path, i: int
) -> Path:
    """``image{i}_routing.png``: the routing ``sm [h, w]`` into the predicted class of image
    ``i`` (``record``) over its ``picture [H, W, C]``."""
    height, width = picture.shape[:2]
    up = F.interpolate(sm[None, None], size=(height, width), mode="bilinear", align_corners=False)
    fig = figure(figsize=(4.2, 3.6))
    ax = fig.add_subplot()
    if picture.shape[-1] == 1:
        ax.imshow(picture[..., 0].numpy(), cmap="gray", vmin=0.0, vmax=1.0)
    else:
        ax.imshow(picture.numpy())
    top = float(sm.max())
    vmax = top if top > 0 else 1.0
    im = ax.imshow(up[0, 0].numpy(), cmap="inferno", alpha=0.5, vmin=0.0, vmax=vmax)
    truth = "" if record.label_class is None else f" (label {record.label_class})"
    ax.set_title(f"image {i}: routing into {record.predicted_class}{truth}", fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])
    fig.colorbar(im, ax=ax, label=f"routing into {record.predicted_class}")
    fig.tight_layout()
    vmin, vmax = im.get_clim()
    path = out / overlay_name(i)
    metadata = {
        "Title": f"capsctl routing into the predicted class, image {i}",
        "capsctl:kind": "overlay",
        "capsctl:image": str(i),
        "capsctl:vmin": repr(float(vmin)),
        "capsctl:vmax": repr(float(vmax)),
    }
    _save_png(fig, path, metadata)
    return path


def make_folder(out_dir: str | os.PathLike[str]) -> Path:
    """``out_dir``, created if missing (:class:`CapsctlError` naming it where it cannot be)."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CapsctlError(f"cannot create the folder {out}: {e.strerror or e}") from None
    return out


def write_pngs(
    report: RoutingReport,
    images: Tensor | Any,
    out_dir: str | os.PathLike[str],
    *,
    heatmaps: bool = True,
    overlays: bool = True,
    on_event: EventFn = None,
) -> list[Path]:
    """Write routing pictures (module docstring) to ``out_dir``, created if missing.

    ``images``: the un-normalized inputs (uint8 0..255 or floats in [0, 1]), ``[N, C, H, W]``,
    in the report's order. ``heatmaps``/``overlays`` switch the two kinds of picture off.
    Emits a ``progress`` event (``task="pictures"``, ``step``, ``steps``) after each file.
    Returns the paths written. Needs matplotlib (:class:`CapsctlError` with the pip hint).
    """
    figure = figure_class()
    pictures = images_hwc(images)
    if pictures.shape[0] != len(report.images):
        raise UsageError(
            f"got {pictures.shape[0]} images for a report on {len(report.images)}; pass the "
            "same images"
        )
    out = make_folder(out_dir)
    heatmap_count = sum(len(per) for per in report.coefficients) if heatmaps else 0
    steps = heatmap_count + (len(report.images) if overlays else 0)
    written: list[Path] = []

    def done(path: Path) -> None:
        written.append(path)
        emit(on_event, "progress", task="pictures", step=len(written), steps=steps)

    for li in range(len(report.coefficients) if heatmaps else 0):
        matrices = [_mean_matrix(report, li, ti) for ti in range(len(report.coefficients[li]))]
        limits = layer_limits(matrices)
        for ti, matrix in enumerate(matrices):
            done(write_heatmap(figure, report, matrix, li, ti, out, limits))
    for i in range(len(report.images) if overlays else 0):
        sm = spatial_map(report, i)  # [h, w]
        done(write_overlay(figure, report.images[i], sm, pictures[i], out, i))
    return written
