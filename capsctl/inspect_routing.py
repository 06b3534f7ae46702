"""Routing statistics, raw coefficients and pictures of a capsule network's routing.

:func:`inspect_routing` runs ``model(images, trace=True)`` once (eval mode, no grad) and
summarizes the :class:`~capsctl.models.capsnet.RoutingTrace`.

Indexing: capsule layers ``l`` are 0-based as in the trace (0 = the first capsule layer after
the primary capsules; the last one holds the class capsules). Iterations ``t`` are 1-based:
``t = 1`` is the uniform pass (every coefficient ``1/M``), ``t = T`` the last routed pass.

A *child* is one coefficient vector ``r`` over the ``M`` parent types: for an FC layer one child
capsule of one image (``[b, n, m]``), for a conv layer one child type at one window offset of
one output position of one image (``[b, h, w, k, l, n, m]``: coefficients are normalized per
window). Per layer and iteration (:class:`IterationStats`):

* ``mean_entropy``: mean over children of the normalized entropy ``H(r) / log M`` (1 for
  uniform coefficients, 0 when a child routes everything to one parent; 1 when ``M = 1``).
  Computed in float64 as ``1 - KL(r || uniform) / log M``, which is exactly 1.0 for uniform
  coefficients;
* ``mean_max``: mean over children of ``max_j r_j`` (``1/M`` for uniform coefficients);
* ``top_changed``: share of children whose top parent (``argmax r``) at ``t`` is not a top
  parent at ``t - 1`` (ties count as top parents, so ``t = 2`` compares with a uniform pass in
  which every parent is a top parent and gives 0; it is informative from ``t = 3`` on). None
  at ``t = 1``;
* ``pose_stability``: mean over parents (and positions, and images) of the cosine similarity
  ``<p^(t), p^(t-1)> / (|p^(t)| |p^(t-1)|)`` between a parent's pose after pass ``t`` and after
  pass ``t - 1``; 1 means the poses no longer move. None at ``t = 1``.

``parents_receiving`` (per layer, last iteration): the parent types that receive the most
routing, ``(parent type, share)``, where a parent type's share is the sum of its coefficients
over all children (and positions), averaged over the images and divided by the number of
children (so the shares of all parent types sum to 1).

For the class layer each image gets its predicted class and the child capsules routing most
strongly into it (:class:`ChildRoute`: child type, grid position when the children come from a
grid, coefficient). :func:`spatial_map` gives, per child grid position, the routing flowing
into the predicted class summed over child types; when the class layer's children are the
outputs of further FC capsule layers, the flow is carried back through them (the flow into a
child is the sum over its parents of coefficient times the parent's flow) down to the last
layer whose children lie on a grid.

Nothing is printed; matplotlib is only imported by :func:`write_pngs`.
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from capsctl.atomic import write_atomic
from capsctl.errors import CapsctlError, UsageError

__all__ = [
    "ChildRoute",
    "ImageRouting",
    "IterationStats",
    "LayerRouting",
    "RoutingReport",
    "class_flow",
    "inspect_routing",
    "normalized_entropy",
    "spatial_map",
    "write_pngs",
]

_PLOT_MISSING = "routing pictures need matplotlib: pip install 'capsctl[plot]'"


@dataclass
class IterationStats:
    """Statistics of one layer at one iteration (definitions in the module docstring).

    ``iteration``: 1-based (1 = uniform pass). ``mean_entropy``: mean normalized entropy
    ``H(r)/log M`` of the children's coefficient vectors, in [0, 1]. ``mean_max``: mean largest
    coefficient, in [1/M, 1]. ``top_changed``: share of children whose top parent changed since
    iteration ``t - 1`` (None at ``t = 1``). ``pose_stability``: mean cosine similarity of each
    parent's pose with its pose at ``t - 1`` (None at ``t = 1``).
    """

    iteration: int
    mean_entropy: float
    mean_max: float
    top_changed: float | None
    pose_stability: float | None


@dataclass
class LayerRouting:
    """One capsule layer: its shape, per-iteration statistics and most-receiving parents.

    ``index``: 0-based layer index (the last layer holds the class capsules). ``kind``:
    ``conv``/``fc``. ``child_types``/``parent_types``: ``n``/``m`` (for an FC layer over a grid,
    ``n`` counts flat children ``h*w*types``). ``child_grid``: ``(h, w, types)`` an FC layer's
    flat children come from, or None. ``out_grid``: ``(h, w)`` of a conv layer's parents.
    ``parents_receiving``: ``(parent type, share)`` of the top parent types at the last
    iteration, shares summing to 1 over all parent types.
    """

    index: int
    kind: str
    child_types: int
    parent_types: int
    child_grid: tuple[int, int, int] | None
    out_grid: tuple[int, int] | None
    iterations: list[IterationStats] = field(default_factory=list)
    parents_receiving: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class ChildRoute:
    """A child capsule routing into a class: its type, grid position (or None) and coefficient."""

    type: int
    h: int | None
    w: int | None
    coefficient: float


@dataclass
class ImageRouting:
    """One image: predicted class (and its softmax probability), label if known, top children."""

    index: int
    predicted: int
    predicted_class: str
    probability: float
    label: int | None = None
    label_class: str | None = None
    top_children: list[ChildRoute] = field(default_factory=list)


@dataclass
class RoutingReport:
    """Result of :func:`inspect_routing`.

    ``iterations``/``routing``: the T and schedule used. ``layers``: per-layer statistics.
    ``images``: per-image class routing. ``coefficients[l][t - 1]`` and ``poses[l][t - 1]``:
    the raw trace on the CPU (not part of :meth:`to_dict`; see :meth:`dump`). ``logits``:
    ``[N, classes]``.
    """

    iterations: int
    routing: str
    classes: list[str]
    layers: list[LayerRouting]
    images: list[ImageRouting]
    coefficients: list[list[Tensor]] = field(default_factory=list, repr=False)
    poses: list[list[Tensor]] = field(default_factory=list, repr=False)
    kinds: list[str] = field(default_factory=list)
    child_grids: list[tuple[int, int, int] | None] = field(default_factory=list)
    logits: Tensor | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (lists, dicts, numbers, strings, None; no tensors)."""
        return {
            "iterations": self.iterations,
            "routing": self.routing,
            "classes": list(self.classes),
            "layers": [
                {
                    "index": layer.index,
                    "kind": layer.kind,
                    "child_types": layer.child_types,
                    "parent_types": layer.parent_types,
                    "child_grid": None if layer.child_grid is None else list(layer.child_grid),
                    "out_grid": None if layer.out_grid is None else list(layer.out_grid),
                    "iterations": [
                        {
                            "iteration": s.iteration,
                            "mean_entropy": s.mean_entropy,
                            "mean_max": s.mean_max,
                            "top_changed": s.top_changed,
                            "pose_stability": s.pose_stability,
                        }
                        for s in layer.iterations
                    ],
                    "parents_receiving": [[j, share] for j, share in layer.parents_receiving],
                }
                for layer in self.layers
            ],
            "images": [
                {
                    "index": im.index,
                    "predicted": im.predicted,
                    "predicted_class": im.predicted_class,
                    "probability": im.probability,
                    "label": im.label,
                    "label_class": im.label_class,
                    "top_children": [
                        {"type": c.type, "h": c.h, "w": c.w, "coefficient": c.coefficient}
                        for c in im.top_children
                    ],
                }
                for im in self.images
            ],
        }

    def dump(self, path: str | os.PathLike[str]) -> Path:
        """Write the raw coefficients as safetensors, keys ``layer{l}.iter{t}``, atomically.

        Shapes as in the trace (conv ``[b, h, w, k, l, n, m]``, FC ``[b, n, m]``); the string
        metadata holds ``kinds``, ``child_grids``, ``classes``, ``iterations`` and ``routing``
        as JSON. Raises :class:`CapsctlError` naming the path when it cannot be written.
        """
        from safetensors.torch import save

        path = Path(path)
        if not path.parent.is_dir():
            raise CapsctlError(
                f"cannot write {path}: the folder {path.parent} does not exist; create it first"
            )
        tensors = {
            f"layer{li}.iter{ti + 1}": c.detach().to("cpu", torch.float32).contiguous()
            for li, per_layer in enumerate(self.coefficients)
            for ti, c in enumerate(per_layer)
        }
        metadata = {
            "format": "capsctl-routing",
            "kinds": json.dumps(self.kinds),
            "child_grids": json.dumps([None if g is None else list(g) for g in self.child_grids]),
            "classes": json.dumps(self.classes, ensure_ascii=False),
            "iterations": json.dumps(self.iterations),
            "routing": json.dumps(self.routing),
        }
        write_atomic(path, save(tensors, metadata=metadata))
        return path


# --------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------


def _exact_mean(values: Tensor) -> float:
    """Mean that is exact when all values are equal (shifted by the first value)."""
    flat = values.reshape(-1).double()
    first = flat[0]
    return float(first + (flat - first).mean())


def _children(coeff: Tensor) -> Tensor:
    """Coefficients as ``[children, M]`` in float64."""
    return coeff.reshape(-1, coeff.shape[-1]).double()


def normalized_entropy(coeff: Tensor) -> Tensor:
    """Per child ``H(r) / log M`` (float64), as ``1 - KL(r || uniform) / log M``.

    ``r`` is renormalized to sum to one; with ``M = 1`` the result is 1.
    """
    r = _children(coeff)
    m = r.shape[-1]
    if m == 1:
        return torch.ones(r.shape[0], dtype=torch.float64)
    total = r.sum(-1, keepdim=True)
    p = r / total
    ratio = r / (total / m)  # p * M, exactly 1 for uniform coefficients
    kl = torch.where(p > 0, p * torch.log(torch.where(p > 0, ratio, 1.0)), 0.0).sum(-1)
    return 1.0 - kl / math.log(m)


def _max_coefficient(coeff: Tensor) -> Tensor:
    r = _children(coeff)
    return (r / r.sum(-1, keepdim=True)).amax(-1)


def _top_changed(prev: Tensor, cur: Tensor) -> float:
    p, c = _children(prev), _children(cur)
    top = c.argmax(-1, keepdim=True)
    was_top = p.gather(-1, top).squeeze(-1) >= p.amax(-1)
    return float((~was_top).double().mean())


def _pose_stability(prev: Tensor, cur: Tensor) -> float:
    d = cur.shape[-1]
    cos = F.cosine_similarity(cur.reshape(-1, d).double(), prev.reshape(-1, d).double(), dim=-1)
    return _exact_mean(cos)


def _iteration_stats(coeffs: Sequence[Tensor], poses: Sequence[Tensor]) -> list[IterationStats]:
    stats = []
    for ti, c in enumerate(coeffs):
        stats.append(
            IterationStats(
                iteration=ti + 1,
                mean_entropy=_exact_mean(normalized_entropy(c)),
                mean_max=_exact_mean(_max_coefficient(c)),
                top_changed=None if ti == 0 else _top_changed(coeffs[ti - 1], c),
                pose_stability=None if ti == 0 else _pose_stability(poses[ti - 1], poses[ti]),
            )
        )
    return stats


def _parent_shares(coeff: Tensor) -> Tensor:
    """Share of all routing received by each parent type ``[M]`` (sums to 1)."""
    received = _children(coeff).sum(0)
    return received / received.sum()


def _top_parents(coeff: Tensor, top: int) -> list[tuple[int, float]]:
    shares = _parent_shares(coeff)
    k = min(top, shares.numel())
    values, index = shares.topk(k)
    return [(int(j), float(v)) for v, j in zip(values, index, strict=True)]


def _unflatten(flat: int, grid: tuple[int, int, int] | None) -> tuple[int, int | None, int | None]:
    if grid is None:
        return flat, None, None
    _, gw, gn = grid
    return flat % gn, flat // (gw * gn), (flat // gn) % gw


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


def _check_model(model: nn.Module) -> None:
    from capsctl.models.capsnet import CapsNet

    if not isinstance(model, CapsNet):
        arch = getattr(getattr(model, "config", None), "arch", type(model).__name__)
        raise UsageError(
            f"routing inspection needs a capsule network, but this model is {arch!r} "
            "(it has no routing); pass a capsnet checkpoint"
        )


def inspect_routing(
    model: nn.Module,
    images: Tensor,
    *,
    labels: Tensor | None = None,
    classes: list[str],
    iterations: int | None = None,
    routing: str | None = None,
    top: int = 5,
) -> RoutingReport:
    """Run ``model`` on normalized ``images [N, C, H, W]`` with a routing trace and summarize it.

    ``labels``: optional true classes ``[N]``. ``classes``: class names (one per logit).
    ``iterations``/``routing``: temporarily override T and the schedule (``concurrent`` or
    ``sequential``); the model's settings and train/eval mode are restored afterwards.
    ``top``: how many parents/children to list. Raises :class:`UsageError` for a model that is
    not a capsule network and for inconsistent arguments.
    """
    _check_model(model)
    if not isinstance(images, Tensor) or images.dim() != 4 or images.shape[0] < 1:
        raise UsageError("images must be a tensor [N, C, H, W] with N >= 1; pass a batch")
    n_images = images.shape[0]
    cfg = model.config  # type: ignore[union-attr]
    wanted = (cfg.in_channels, cfg.input_size, cfg.input_size)
    if tuple(images.shape[1:]) != wanted:
        raise UsageError(
            f"images have shape {list(images.shape)} but the model takes [N, {wanted[0]}, "
            f"{wanted[1]}, {wanted[2]}]; pass images of the model's input size"
        )
    if labels is not None and (labels.dim() != 1 or labels.shape[0] != n_images):
        raise UsageError(
            f"labels must be a vector of {n_images} class indices, got shape {list(labels.shape)}"
        )
    if top < 1:
        raise UsageError(f"top must be >= 1, got {top}")
    if iterations is not None and iterations < 1:
        raise UsageError(f"routing iterations must be >= 1, got {iterations}")
    if routing is not None and routing not in ("concurrent", "sequential"):
        raise UsageError(f"unknown routing mode {routing!r}; use concurrent or sequential")
    num_classes = model.capsules[-1].out_types  # type: ignore[union-attr,index]
    if len(classes) != num_classes:
        raise UsageError(
            f"got {len(classes)} class names for a model with {num_classes} classes; "
            "pass one name per class"
        )

    saved = (model.iterations, model.routing, model.training)
    device = next(model.parameters()).device
    try:
        model.set_routing(iterations, routing)  # type: ignore[operator]
        model.eval()
        with torch.no_grad():
            logits, trace = model(images.to(device), trace=True)
    finally:
        model.iterations, model.routing = saved[0], saved[1]
        model.train(saved[2])

    coefficients = [[c.detach().cpu() for c in per] for per in trace.coefficients]
    poses = [[p.detach().cpu() for p in per] for per in trace.poses]
    logits = logits.detach().cpu().float()
    used_t = len(coefficients[0])
    used_mode = routing or saved[1]

    layers: list[LayerRouting] = []
    for li, (kind, grid) in enumerate(zip(trace.kinds, trace.child_grids, strict=True)):
        last = coefficients[li][-1]
        out_grid = (int(last.shape[1]), int(last.shape[2])) if kind == "conv" else None
        child_types = int(last.shape[-2])
        layers.append(
            LayerRouting(
                index=li,
                kind=kind,
                child_types=child_types,
                parent_types=int(last.shape[-1]),
                child_grid=None if grid is None else tuple(int(g) for g in grid),  # type: ignore[arg-type]
                out_grid=out_grid,
                iterations=_iteration_stats(coefficients[li], poses[li]),
                parents_receiving=_top_parents(last, top),
            )
        )

    probs = torch.softmax(logits.double(), dim=-1)
    predicted = logits.argmax(-1)
    class_coeff = coefficients[-1][-1]  # [b, n, classes]
    class_grid = trace.child_grids[-1]
    records = []
    for i in range(n_images):
        pred = int(predicted[i])
        column = class_coeff[i, :, pred]
        k = min(top, column.numel())
        values, index = column.topk(k)
        children = []
        for v, f in zip(values, index, strict=True):
            t, h, w = _unflatten(int(f), class_grid)
            children.append(ChildRoute(type=t, h=h, w=w, coefficient=float(v)))
        label = None if labels is None else int(labels[i])
        records.append(
            ImageRouting(
                index=i,
                predicted=pred,
                predicted_class=classes[pred],
                probability=float(probs[i, pred]),
                label=label,
                label_class=None
                if label is None or not 0 <= label < num_classes
                else classes[label],
                top_children=children,
            )
        )

    return RoutingReport(
        iterations=used_t,
        routing=used_mode,
        classes=list(classes),
        layers=layers,
        images=records,
        coefficients=coefficients,
        poses=poses,
        kinds=list(trace.kinds),
        child_grids=[None if g is None else tuple(g) for g in trace.child_grids],
        logits=logits,
    )


# --------------------------------------------------------------------------------------------
# Spatial maps
# --------------------------------------------------------------------------------------------


def class_flow(
    report: RoutingReport, image_index: int, class_index: int | None = None
) -> tuple[Tensor, tuple[int, int, int]]:
    """Routing flowing into a class (default: the predicted one) from each grid child.

    Returns ``(flow [h*w*n] in (h, w, n) order, (h, w, n))`` at the last layer whose children
    lie on a grid, carrying the flow back through FC layers with flat children (module
    docstring). Raises :class:`UsageError` for a bad index or when no layer has grid children.
    """
    if not 0 <= image_index < len(report.images):
        raise UsageError(
            f"image index {image_index} is out of range (the report has {len(report.images)} "
            "images)"
        )
    if class_index is None:
        class_index = report.images[image_index].predicted
    li = len(report.coefficients) - 1
    flow = report.coefficients[li][-1][image_index, :, class_index].double()  # [children]
    while report.child_grids[li] is None:
        li -= 1
        if li < 0 or report.kinds[li] != "fc":
            raise UsageError("this model's class capsules have no spatial grid of children")
        coeff = report.coefficients[li][-1][image_index].double()  # [children, parents]
        flow = coeff @ flow
    grid = report.child_grids[li]
    assert grid is not None
    return flow, grid


def spatial_map(report: RoutingReport, image_index: int) -> Tensor:
    """``[h, w]`` routing into image ``image_index``'s predicted class per child grid position.

    The sum over child types of the coefficients (or carried-back flow, see :func:`class_flow`)
    into the predicted class; float32, on the CPU, ready to upsample onto the image.
    """
    flow, (h, w, n) = class_flow(report, image_index)
    return flow.view(h, w, n).sum(-1).float()


# --------------------------------------------------------------------------------------------
# Pictures
# --------------------------------------------------------------------------------------------


def _mean_matrix(report: RoutingReport, li: int, ti: int) -> Tensor:
    """Batch-mean coefficients aggregated to ``[child types, parent types]``."""
    coeff = report.coefficients[li][ti].double()
    m = coeff.shape[-1]
    grid = report.child_grids[li]
    if report.kinds[li] == "conv":
        n = coeff.shape[-2]
        return coeff.reshape(-1, n, m).mean(0)
    if grid is not None:
        return coeff.reshape(coeff.shape[0], -1, grid[2], m).mean((0, 1))
    return coeff.mean(0)


def _images_hwc(images: Tensor | Any) -> Tensor:
    """Images as float ``[N, H, W, C]`` in [0, 1] (C = 1 or 3)."""
    x = torch.as_tensor(images).detach().cpu()
    if x.dim() == 3:
        x = x.unsqueeze(1)
    if x.dim() != 4:
        raise UsageError("images for pictures must be [N, C, H, W] (uint8 or floats in [0, 1])")
    if x.shape[1] not in (1, 3) and x.shape[-1] in (1, 3):
        x = x.permute(0, 3, 1, 2)
    if x.shape[1] not in (1, 3):
        raise UsageError(f"images for pictures need 1 or 3 channels, got shape {list(x.shape)}")
    x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float().clamp(0.0, 1.0)
    return x.permute(0, 2, 3, 1)


def _save_png(fig: Any, path: Path, metadata: dict[str, str]) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata=metadata)
    write_atomic(path, buf.getvalue())


def _layer_name(report: RoutingReport, li: int) -> str:
    last = li == len(report.coefficients) - 1
    return f"layer {li} ({report.kinds[li]}{', class capsules' if last else ''})"


def write_pngs(
    report: RoutingReport,
    images: Tensor | Any,
    out_dir: str | os.PathLike[str],
    *,
    heatmaps: bool = True,
    overlays: bool = True,
) -> list[Path]:
    """Write routing pictures to ``out_dir`` (created if missing); returns the paths.

    * ``routing_layer{l}_iter{t}.png`` per layer and iteration: the batch-mean coefficients as
      a child type x parent type heatmap (conv layers and FC layers over a grid aggregate
      children per type), colour scale fixed to [0, 1];
    * ``image{i}_routing.png`` per image: :func:`spatial_map` upsampled onto the image, with a
      colorbar (scale 0 .. the map's maximum).

    ``images``: the un-normalized inputs (uint8 0..255 or floats in [0, 1]), ``[N, C, H, W]``,
    in the report's order. Each PNG carries text metadata ``capsctl:vmin``/``capsctl:vmax``
    (the colour limits actually used), ``capsctl:kind`` and the layer/iteration or image.
    ``heatmaps``/``overlays`` switch the two kinds of picture off. Needs matplotlib
    (:class:`CapsctlError` with the pip hint otherwise).
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise CapsctlError(_PLOT_MISSING) from None
    pictures = _images_hwc(images)
    if pictures.shape[0] != len(report.images):
        raise UsageError(
            f"got {pictures.shape[0]} images for a report on {len(report.images)}; pass the "
            "same images"
        )
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CapsctlError(f"cannot create the folder {out}: {e.strerror or e}") from None
    written: list[Path] = []
    last_layer = len(report.coefficients) - 1

    for li in range(len(report.coefficients) if heatmaps else 0):
        for ti in range(len(report.coefficients[li])):
            matrix = _mean_matrix(report, li, ti).float().numpy()
            n, m = matrix.shape
            fig = Figure(figsize=(max(4.0, 1.0 + 0.3 * m), max(3.0, 1.0 + 0.25 * n)))
            ax = fig.add_subplot()
            im = ax.imshow(matrix, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
            ax.set_ylabel("child capsule type")
            if li == last_layer:
                ax.set_xlabel("class")
                ax.set_xticks(range(m), report.classes, rotation=45, ha="right")
            else:
                ax.set_xlabel("parent capsule type")
            t = ti + 1
            ax.set_title(f"{_layer_name(report, li)}, iteration {t}/{len(report.coefficients[li])}")
            fig.colorbar(im, ax=ax, label="mean routing coefficient")
            fig.tight_layout()
            vmin, vmax = im.get_clim()
            path = out / f"routing_layer{li}_iter{t}.png"
            _save_png(
                fig,
                path,
                {
                    "Title": f"capsctl routing layer {li} iteration {t}",
                    "capsctl:kind": "coefficients",
                    "capsctl:layer": str(li),
                    "capsctl:iteration": str(t),
                    "capsctl:vmin": repr(float(vmin)),
                    "capsctl:vmax": repr(float(vmax)),
                },
            )
            written.append(path)

    for i, record in enumerate(report.images if overlays else []):
        picture = pictures[i]
        height, width = picture.shape[:2]
        sm = spatial_map(report, i)
        up = F.interpolate(
            sm[None, None], size=(height, width), mode="bilinear", align_corners=False
        )[0, 0].numpy()
        fig = Figure(figsize=(4.2, 3.6))
        ax = fig.add_subplot()
        if picture.shape[-1] == 1:
            ax.imshow(picture[..., 0].numpy(), cmap="gray", vmin=0.0, vmax=1.0)
        else:
            ax.imshow(picture.numpy())
        top = float(sm.max())
        im = ax.imshow(up, cmap="inferno", alpha=0.5, vmin=0.0, vmax=top if top > 0 else 1.0)
        truth = "" if record.label_class is None else f" (label {record.label_class})"
        ax.set_title(f"image {i}: routing into {record.predicted_class}{truth}", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
        fig.colorbar(im, ax=ax, label=f"routing into {record.predicted_class}")
        fig.tight_layout()
        vmin, vmax = im.get_clim()
        path = out / f"image{i}_routing.png"
        _save_png(
            fig,
            path,
            {
                "Title": f"capsctl routing into the predicted class, image {i}",
                "capsctl:kind": "overlay",
                "capsctl:image": str(i),
                "capsctl:vmin": repr(float(vmin)),
                "capsctl:vmax": repr(float(vmax)),
            },
        )
        written.append(path)
    return written
