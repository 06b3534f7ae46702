"""Run a capsule network once with a routing trace and summarize it: :func:`inspect_routing`.

The model runs ``model(images, trace=True)`` in eval mode without gradients, with T and the
routing schedule temporarily overridden; the trace (capsctl/models/capsnet.py,
``RoutingTrace``) is moved to the CPU and turned into a
:class:`~capsctl.inspection.report.RoutingReport` by capsctl/inspection/statistics.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from capsctl.errors import UsageError
from capsctl.inspection.report import RoutingReport
from capsctl.inspection.statistics import image_routings, layer_routings

__all__ = ["inspect_routing"]


def _check_model(model: nn.Module) -> None:
    from capsctl.models.capsnet import CapsNet

    if not isinstance(model, CapsNet):
        arch = getattr(getattr(model, "config", None), "arch", type(model).__name__)
        raise UsageError(
            f"routing inspection needs a capsule network, but this model is {arch!r} "
            "(it has no routing); pass a capsnet checkpoint"
        )


def _check_arguments(
    model: nn.Module,
    images: Tensor,
    labels: Tensor | None,
    classes: list[str],
    iterations: int | None,
    routing: str | None,
    top: int,
) -> None:
    """Raise :class:`UsageError` for inputs the model cannot take or inconsistent options."""
    _check_model(model)
    if not isinstance(images, Tensor) or images.dim() != 4 or images.shape[0] < 1:
        raise UsageError("images must be a tensor [N, C, H, W] with N >= 1; pass a batch")
    n_images = images.shape[0]
    cfg: Any = model.config
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
    num_classes = model.capsules[-1].out_types  # type: ignore[index,union-attr]
    if len(classes) != num_classes:
        raise UsageError(
            f"got {len(classes)} class names for a model with {num_classes} classes; "
            "pass one name per class"
        )


def _traced_forward(
    model: Any, images: Tensor, iterations: int | None, routing: str | None
) -> tuple[Tensor, Any]:
    """``(logits, trace)`` of one eval-mode pass; the model's T, schedule and mode are restored."""
    saved = (model.iterations, model.routing, model.training)
    device = next(model.parameters()).device
    try:
        try:
            model.set_routing(iterations, routing)
        except ValueError as e:
            raise UsageError(f"{e}; change --iterations or --routing") from None
        model.eval()
        with torch.no_grad():
            logits, trace = model(images.to(device), trace=True)
    finally:
        model.iterations, model.routing = saved[0], saved[1]
        model.train(saved[2])
    return logits, trace


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
    _check_arguments(model, images, labels, classes, iterations, routing, top)
    default_routing = str(model.routing)
    logits, trace = _traced_forward(model, images, iterations, routing)
    coefficients = [[c.detach().cpu() for c in per] for per in trace.coefficients]
    poses = [[p.detach().cpu() for p in per] for per in trace.poses]
    logits = logits.detach().cpu().float()  # [N, classes]
    grids = [None if g is None else (int(g[0]), int(g[1]), int(g[2])) for g in trace.child_grids]
    algo = model.algorithm  # type: ignore[union-attr]
    return RoutingReport(
        algorithm=algo.name,
        algorithm_title=algo.title,
        coefficient_name=algo.coefficient_name,
        activations=[[a.detach().cpu() for a in per] for per in trace.activations],
        iterations=len(coefficients[0]),
        routing=routing or default_routing,
        classes=list(classes),
        layers=layer_routings(coefficients, poses, list(trace.kinds), grids, top),
        images=image_routings(coefficients[-1][-1], grids[-1], logits, labels, classes, top),
        coefficients=coefficients,
        poses=poses,
        kinds=list(trace.kinds),
        child_grids=grids,
        logits=logits,
    )
