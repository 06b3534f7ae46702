"""Inverted dot-product attention routing (Tsai, Srivastava, Goh, Salakhutdinov, ICLR 2020,
arXiv:2002.04764), the method of the paper: each child's votes are weighted by a softmax over
the parents of the (scaled) agreement between the vote and the parent's pose of the previous
iteration; parent poses are LayerNorm-ed.

Layers: capsctl/layers/capsules.py (the routed pass: capsctl/layers/passes/routed.py). Schedules:
``sequential`` (each layer runs its T iterations before the next starts) and ``concurrent``
(the paper's: iteration 1 is one uniform bottom-up pass; every later iteration updates all
layers at once from the poses of the previous iteration).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from capsctl.layers.algorithm import (
    Capsules,
    LayerPlan,
    LayerRouting,
    NetworkPlan,
    RoutingAlgorithm,
    RoutingTrace,
)
from capsctl.layers.backend.dispatch import autocast_dtype, choose
from capsctl.layers.capsules import CapsuleLayer, ConvCapsules, FCCapsules
from capsctl.layers.passes.rows_first import SIDE
from capsctl.layers.primary import PrimaryCapsules


@dataclass
class IDPAParams:
    """``iterations``: T (the paper's CIFAR models: 2); ``schedule``: ``concurrent`` (the
    paper's) or ``sequential``."""

    iterations: int = 2
    schedule: Literal["concurrent", "sequential"] = "concurrent"


class LayerNormPrimary(PrimaryCapsules):
    """Convolution to capsules (1x1 by default), LayerNorm over each pose (no activations)."""

    def forward(self, feats: Tensor) -> Capsules:  # type: ignore[override]
        return Capsules(super().forward(feats))


def sequential_layer(layer: CapsuleLayer, caps: Capsules, iterations: int) -> LayerRouting:
    """One layer's T passes: uniform, then T - 1 routed passes against its own last poses."""
    child = caps.poses
    parent = layer.uniform(child)
    out = LayerRouting(Capsules(parent), [layer.uniform_coefficients(child)], [parent])
    with layer.same_children():
        for _ in range(2, iterations + 1):
            parent, coeff = layer.route(child, parent)
            out.coefficients.append(coeff)
            out.poses.append(parent)
    out.capsules = Capsules(parent)
    return out


class IDPAConv(ConvCapsules):
    def forward(self, caps: Capsules, iterations: int) -> LayerRouting:
        return sequential_layer(self, caps, iterations)


class IDPAFC(FCCapsules):
    def forward(self, caps: Capsules, iterations: int) -> LayerRouting:
        return sequential_layer(self, caps, iterations)


class SharedHead(nn.Linear):
    """The paper's read-out: one ``Linear(D, 1)`` shared by every class capsule -> logits."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim, 1)

    def forward(self, caps: Capsules) -> Tensor:  # type: ignore[override]
        return super().forward(caps.poses).squeeze(-1)  # [b, classes, 1] -> [b, classes]


class PerClassHead(nn.Module):
    """``logit_c = w_c . p_c + b_c``: a separate linear read-out per class capsule."""

    def __init__(self, classes: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(classes, dim))
        self.bias = nn.Parameter(torch.zeros(classes))
        nn.init.uniform_(self.weight, -(dim**-0.5), dim**-0.5)

    def forward(self, caps: Capsules) -> Tensor:
        return (caps.poses * self.weight).sum(-1) + self.bias  # [b, classes]


class InvertedDotProductAttention(RoutingAlgorithm):
    name = "idpa"
    title = "inverted dot-product attention routing"
    reference = "Tsai, Srivastava, Goh, Salakhutdinov, ICLR 2020, arXiv:2002.04764"
    summary = (
        "inverted dot-product attention routing, in which parent capsules compete for each "
        "child capsule's vote (a softmax over parents of the agreement between the vote and "
        "the parent's pose)"
    )
    Params = IDPAParams
    schedules = ("concurrent", "sequential")

    def make_primary(self, plan: NetworkPlan) -> nn.Module:
        return LayerNormPrimary(
            plan.channels,
            plan.primary_types,
            plan.primary_dim,
            layer_norm=plan.layer_norm,
            kernel=plan.primary_kernel,
            stride=plan.primary_stride,
        )

    def make_layer(self, layer: LayerPlan, plan: NetworkPlan) -> nn.Module:
        common = dict(
            pose=layer.pose,
            dropout=plan.dropout,
            layer_norm=plan.layer_norm,
            agreement_scale=plan.agreement_scale,
        )
        if layer.kind == "conv":
            return IDPAConv(
                layer.in_types,
                layer.in_dim,
                layer.out_types,
                layer.out_dim,
                kernel=layer.kernel,
                stride=layer.stride,
                **common,  # type: ignore[arg-type]
            )
        return IDPAFC(layer.in_types, layer.in_dim, layer.out_types, layer.out_dim, **common)  # type: ignore[arg-type]

    def make_head(self, dim: int, plan: NetworkPlan) -> nn.Module:
        return SharedHead(dim) if plan.head == "shared" else PerClassHead(plan.num_classes, dim)

    def run_features(
        self,
        primary: nn.Module,
        layers: Sequence[nn.Module],
        feats: Tensor,
        iterations: int,
        schedule: str,
        trace: RoutingTrace | None,
    ) -> Capsules:
        rows = None
        if schedule == "concurrent" and trace is None:
            rows = rows_first_plan(primary, layers, iterations, feats)
        if rows is None:
            return super().run_features(primary, layers, feats, iterations, schedule, trace)
        child = primary.rows_first(feats, SIDE) if rows[0] else primary(feats).poses
        return Capsules(_concurrent(layers, child, iterations, None, rows))

    def run(
        self,
        layers: Sequence[nn.Module],
        caps: Capsules,
        iterations: int,
        schedule: str,
        trace: RoutingTrace | None,
    ) -> Capsules:
        if schedule == "sequential":
            return super().run(layers, caps, iterations, schedule, trace)
        return Capsules(_concurrent(layers, caps.poses, iterations, trace))


def _routed(i: int, big_l: int, big_t: int) -> bool:
    """Whether layer ``i`` (0-based) of ``big_l`` has a routed pass that reaches the output
    under the concurrent schedule of ``big_t`` iterations (pass t of layer i+1 does if
    ``t <= T - (L - (i+1))``)."""
    return big_t - (big_l - (i + 1)) >= 2


def rows_first_plan(
    primary: nn.Module, layers: Sequence[nn.Module], big_t: int, feats: Tensor
) -> list[bool] | None:
    """For the concurrent schedule without a trace: which poses (the primary capsules', then
    each layer's output) travel rows-first (capsctl/layers/passes/rows_first.py), or None where none
    would. Poses go rows-first when their readers are uniform passes and FC routed passes
    only: a conv layer's routed pass reads windows of standard poses, and the query of a routed
    pass is standard. 4x4 poses, LayerNorm, float32 on a CPU only (elsewhere the layout copies
    would come back)."""
    if not isinstance(primary, LayerNormPrimary) or primary.dim != SIDE * SIDE:
        return None
    if not all(isinstance(m, CapsuleLayer) and m.rows == m.cols_in == SIDE for m in layers):
        return None
    if not all(isinstance(m.norm, nn.LayerNorm) for m in [primary, *layers]):
        return None
    if choose(feats, primary.conv.weight, autocast=autocast_dtype(feats)).backend != "native":
        return None  # export's and compile's plain ops, other devices and dtypes
    big_l = len(layers)
    rows = [
        (layer.kind == "fc" or not _routed(i, big_l, big_t))
        and (i == 0 or not _routed(i - 1, big_l, big_t))
        for i, layer in enumerate(layers)
    ]
    return [*rows, False] if any(rows) else None


def _concurrent(
    layers: Sequence[nn.Module],
    child: Tensor,
    big_t: int,
    trace: RoutingTrace | None,
    rows: Sequence[bool] | None = None,
) -> Tensor:
    """Iteration 1 is one uniform bottom-up pass; every later iteration updates all layers at
    once from the poses of the previous iteration. Passes that cannot reach the output are
    skipped unless a trace is requested. ``rows[i]``: the ``i``-th poses (0: the children
    ``child``) are rows-first (:func:`rows_first_plan`)."""
    big_l = len(layers)
    rows = rows if rows is not None else [False] * (big_l + 1)

    def record(i: int, pose: Tensor, coeff: Tensor) -> None:
        if trace is not None:
            trace.coefficients[i].append(coeff.detach())
            trace.poses[i].append(pose.detach())

    poses: list[Tensor] = [child]
    for i, layer in enumerate(layers):
        poses.append(layer.uniform(poses[-1], rows_in=rows[i], rows_out=rows[i + 1]))
        if trace is not None:
            record(i, poses[-1], layer.uniform_coefficients(poses[-2]))
    for t in range(2, big_t + 1):
        new = list(poses)
        for i, layer in enumerate(layers):
            # Pass t of layer i+1 (1-based) reaches the output only if t <= T - (L - (i+1)).
            if trace is None and t > big_t - (big_l - (i + 1)):
                continue
            new[i + 1], coeff = layer.route(poses[i], poses[i + 1], rows_in=rows[i])
            record(i, new[i + 1], coeff)
        poses = new
    return poses[-1]
