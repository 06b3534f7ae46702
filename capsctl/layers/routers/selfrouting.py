"""Self-routing (Hahn, Pyeon, Kim, "Self-Routing Capsule Networks", NeurIPS 2019) as a routing
algorithm of capsctl: each child's routing weights come from its own learned gating (a linear
map of its pose and a softmax over the parents), with no iterations and no agreement between
capsules (the math: capsctl/layers/self_routing.py).

Capsules carry poses and activations (primary capsules: a pose convolution and a sigmoid
activation convolution). The class capsules' activations ``a_c = sum_i c_ic a_i / sum_i a_i``
sum to one over the classes, so the model outputs ``log a_c`` as logits and trains with
cross-entropy (the negative log-likelihood of the class activations).
"""

from __future__ import annotations

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
)
from capsctl.layers.capsules import PrimaryCapsulesWithActivations
from capsctl.layers.poses import pose_shape
from capsctl.layers.self_routing import SelfRoutingCapsules

# Floor of the class activations before the log: an activation underflowing to 0 would give
# an infinite logit and a NaN loss.
LOG_FLOOR = 1e-30


@dataclass
class SelfParams:
    """Self-routing has no iterations. ``primary_norm``: ``batch`` (the default) normalizes
    the primary capsules' poses and activation logits with BatchNorm, as the authors'
    published code does (SR-CapsNet, ``models/resnet.py``); ``none`` leaves the 1x1
    convolutions bare, as capsctl did before 0.2 (checkpoints that do not name the knob load
    so).

    Why it matters: the routing weights start at zero, as in the authors' code, so every
    class activation starts at exactly ``1/classes`` and nothing below the routing logits
    receives a gradient until the routing weights have grown; their gradient is proportional
    to the child poses. Bare poses on the ``fast`` backbone have a standard deviation of
    about 0.38, and the loss stays near ``ln 10`` for the first epoch; normalized poses
    leave that plateau several times sooner (README, "Self-routing's plateau")."""

    primary_norm: Literal["batch", "none"] = "batch"


class SelfLayer(SelfRoutingCapsules):
    """A self-routing capsule layer speaking the routing interface (one pass)."""

    def forward(self, caps: Capsules, iterations: int) -> LayerRouting:
        assert caps.activations is not None, "self-routing needs child activations"
        pose, act, coeff = self.route(caps.poses, caps.activations)
        return LayerRouting(Capsules(pose, act), [coeff], [] if pose is None else [pose], [act])


class SelfPrimary(PrimaryCapsulesWithActivations):
    def forward(self, feats: Tensor) -> Capsules:  # type: ignore[override]
        return Capsules(*super().forward(feats))


class LogActivationHead(nn.Module):
    """Outputs ``log a_c`` (floored at ``LOG_FLOOR``): log-probabilities of the classes."""

    def forward(self, caps: Capsules) -> Tensor:
        assert caps.activations is not None
        return torch.log(caps.activations.clamp_min(LOG_FLOOR))  # [b, classes]


class SelfRouting(RoutingAlgorithm):
    name = "self"
    title = "self-routing"
    reference = "Hahn, Pyeon, Kim, NeurIPS 2019"
    coefficient_name = "gating weights"
    summary = (
        "self-routing (Hahn, Pyeon and Kim, NeurIPS 2019), in which each child capsule's "
        "routing weights come from its own learned gating, compared with the paper below"
    )
    Params = SelfParams
    iterative = False

    def make_primary(self, plan: NetworkPlan) -> nn.Module:
        p: SelfParams = self.params
        return SelfPrimary(
            plan.channels,
            plan.primary_types,
            plan.primary_dim,
            batch_norm=p.primary_norm == "batch",
        )

    def make_layer(self, layer: LayerPlan, plan: NetworkPlan) -> nn.Module:
        rows, _ = pose_shape(layer.in_dim, layer.pose)  # type: ignore[arg-type]
        return SelfLayer(
            layer.kind,
            layer.in_types,
            layer.in_dim,
            layer.out_types,
            layer.out_dim,
            rows=rows,
            kernel=layer.kernel,
            stride=layer.stride,
            poses=not layer.last,  # the class capsules are their activations
        )

    def make_head(self, dim: int, plan: NetworkPlan) -> nn.Module:
        return LogActivationHead()
