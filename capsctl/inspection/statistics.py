"""Routing statistics computed from a capsule network's routing trace.

Indexing as in capsctl/inspection/report.py (layers 0-based, iterations 1-based, ``t = 1`` the
uniform pass with every coefficient ``1/M``); letters as in capsctl/layers/routing.py.

A *child* is one coefficient vector ``r`` over the ``M`` parent types: for an FC layer one child
capsule of one image (``[b, n, m]``), for a conv layer one child type at one window offset of
one output position of one image (``[b, h, w, k, l, n, m]``: coefficients are normalized per
window). Per layer and iteration (:class:`~capsctl.inspection.report.IterationStats`):

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
strongly into it (child type, grid position when the children come from a grid, coefficient).
:func:`spatial_map` gives, per child grid position, the routing flowing into the predicted
class summed over child types; when the class layer's children are the outputs of further FC
capsule layers, the flow is carried back through them (the flow into a child is the sum over
its parents of coefficient times the parent's flow) down to the last layer whose children lie
on a grid.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from capsctl.errors import UsageError
from capsctl.inspection.report import (
    ChildRoute,
    ImageRouting,
    IterationStats,
    LayerRouting,
    RoutingReport,
)

__all__ = [
    "changed_children",
    "class_flow",
    "image_routings",
    "iteration_stats",
    "layer_routings",
    "max_coefficient",
    "normalized_entropy",
    "pose_cosines",
    "spatial_map",
    "top_parents",
]

Grid = tuple[int, int, int]


def _exact_mean(values: Tensor) -> float:
    """Mean that is exact when all values are equal (shifted by the first value)."""
    flat = values.reshape(-1).double()  # [children]
    first = flat[0]
    return float(first + (flat - first).mean())


def _children(coeff: Tensor) -> Tensor:
    """Coefficients as ``[children, M]`` in float64."""
    return coeff.reshape(-1, coeff.shape[-1]).double()  # [..., m] -> [children, m]


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


def max_coefficient(coeff: Tensor) -> Tensor:
    r = _children(coeff)
    return (r / r.sum(-1, keepdim=True)).amax(-1)


def changed_children(prev: Tensor, cur: Tensor) -> Tensor:
    """Per child 1.0 where its top parent at ``cur`` is not a top parent at ``prev`` (float64)."""
    p, c = _children(prev), _children(cur)
    top = c.argmax(-1, keepdim=True)
    was_top = p.gather(-1, top).squeeze(-1) >= p.amax(-1)
    return (~was_top).double()


def _top_changed(prev: Tensor, cur: Tensor) -> float:
    return float(changed_children(prev, cur).mean())


def pose_cosines(prev: Tensor, cur: Tensor) -> Tensor:
    """Per parent the cosine similarity of its poses ``cur`` and ``prev`` (float64)."""
    d = cur.shape[-1]
    # [..., d] -> [parents, d]
    return F.cosine_similarity(cur.reshape(-1, d).double(), prev.reshape(-1, d).double(), dim=-1)


def _pose_stability(prev: Tensor, cur: Tensor) -> float:
    return _exact_mean(pose_cosines(prev, cur))


def iteration_stats(coeffs: Sequence[Tensor], poses: Sequence[Tensor]) -> list[IterationStats]:
    """One layer's statistics per iteration from its coefficients and poses after each pass."""
    stats = []
    for ti, c in enumerate(coeffs):
        stats.append(
            IterationStats(
                iteration=ti + 1,
                mean_entropy=_exact_mean(normalized_entropy(c)),
                mean_max=_exact_mean(max_coefficient(c)),
                top_changed=None if ti == 0 else _top_changed(coeffs[ti - 1], c),
                pose_stability=None if ti == 0 else _pose_stability(poses[ti - 1], poses[ti]),
            )
        )
    return stats


def top_parents(coeff: Tensor, top: int) -> list[tuple[int, float]]:
    """The ``top`` parent types receiving the most routing: ``(parent type, share)``, largest
    first; a share is the parent type's part of all routing (the shares of all types sum to 1)."""
    received = _children(coeff).sum(0)  # [m]
    shares = received / received.sum()
    values, index = shares.topk(min(top, shares.numel()))
    return [(int(j), float(v)) for v, j in zip(values, index, strict=True)]


def layer_routings(
    coefficients: list[list[Tensor]],
    poses: list[list[Tensor]],
    kinds: list[str],
    child_grids: list[Grid | None],
    top: int,
) -> list[LayerRouting]:
    """Per layer: shape, statistics per iteration and the ``top`` most-receiving parents."""
    layers: list[LayerRouting] = []
    for li, (kind, grid) in enumerate(zip(kinds, child_grids, strict=True)):
        last = coefficients[li][-1]
        layers.append(
            LayerRouting(
                index=li,
                kind=kind,
                child_types=int(last.shape[-2]),
                parent_types=int(last.shape[-1]),
                child_grid=grid,
                out_grid=(int(last.shape[1]), int(last.shape[2])) if kind == "conv" else None,
                iterations=iteration_stats(coefficients[li], poses[li]),
                parents_receiving=top_parents(last, top),
            )
        )
    return layers


def _unflatten(flat: int, grid: Grid | None) -> tuple[int, int | None, int | None]:
    """A flat child index in ``(h, w, n)`` order -> ``(type, h, w)``; no position off a grid."""
    if grid is None:
        return flat, None, None
    _, gw, gn = grid
    return flat % gn, flat // (gw * gn), (flat // gn) % gw


def image_routings(
    class_coeff: Tensor,
    class_grid: Grid | None,
    logits: Tensor,
    labels: Tensor | None,
    classes: list[str],
    top: int,
) -> list[ImageRouting]:
    """Per image: predicted class, its probability, the label and the ``top`` children routing
    into the predicted class. ``class_coeff``: the class layer's last coefficients
    ``[b, n, classes]``; ``class_grid``: the grid its flat children come from, or None."""
    probs = torch.softmax(logits.double(), dim=-1)  # [b, classes]
    predicted = logits.argmax(-1)  # [b]
    records = []
    for i in range(logits.shape[0]):
        pred = int(predicted[i])
        column = class_coeff[i, :, pred]  # [n]
        values, index = column.topk(min(top, column.numel()))
        children = []
        for v, f in zip(values, index, strict=True):
            t, h, w = _unflatten(int(f), class_grid)
            children.append(ChildRoute(type=t, h=h, w=w, coefficient=float(v)))
        label = None if labels is None else int(labels[i])
        label_class = None
        if label is not None and 0 <= label < len(classes):
            label_class = classes[label]
        records.append(
            ImageRouting(
                index=i,
                predicted=pred,
                predicted_class=classes[pred],
                probability=float(probs[i, pred]),
                label=label,
                label_class=label_class,
                top_children=children,
            )
        )
    return records


def class_flow(
    report: RoutingReport, image_index: int, class_index: int | None = None
) -> tuple[Tensor, Grid]:
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
    return flow.view(h, w, n).sum(-1).float()  # [h*w*n] -> [h, w, n] -> [h, w]
