"""Self-routing (Hahn, Pyeon, Kim, "Self-Routing Capsule Networks", NeurIPS 2019) as a routing
algorithm of capsctl: each child's routing weights come from its own learned gating (a linear
map of its pose and a softmax over the parents), with no iterations and no agreement between
capsules. This module holds the algorithm, its capsule layer (:class:`SelfRoutingCapsules`) and
its parameters; the vote-sized pass is capsctl/layers/passes/gated.py.

Capsules carry poses and activations (primary capsules: a pose convolution and a sigmoid
activation convolution). The class capsules' activations ``a_c = sum_i c_ic a_i / sum_i a_i``
sum to one over the classes, so the model outputs ``log a_c`` as logits and trains with
cross-entropy (the negative log-likelihood of the class activations).

The capsule layer: section 3 of the paper, per parent site (letters and the site layout as in
capsctl/layers/passes/routed.py and capsctl/layers/baseline_capsules.py), for its children ``i``
and parent types ``j``:

- votes ``u_hat_{j|i} = W^pose_ij u_i`` (a child pose is an ``a x x`` matrix and the vote is
  ``pose @ W``, as in :meth:`BaselineCapsules.votes`);
- coefficients from the child alone: ``c_ij = softmax_j((W^route_i u_i)_j + b^route_ij)``, the
  softmax over the ``m`` parent types of the site; ``W^route_i`` (``d_in x m``) and
  ``b^route_i`` are per child (per ``(k, l, n)`` in a conv layer, shared over positions);
- parent activation ``a_j = sum_i c_ij a_i / sum_i a_i``;
- parent pose ``u_j = sum_i c_ij a_i u_hat_{j|i} / sum_i c_ij a_i``.

A conv layer routes every output position's window on its own: a child that falls in several
windows has coefficients per window.

The layer's pass: capsctl/layers/passes/gated.py (the votes summed with the gating weights,
never kept).
"""

from __future__ import annotations

import math
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
from capsctl.layers.baseline_capsules import BaselineCapsules
from capsctl.layers.passes.gated import gate, gated_pass, parent_activations, routing_logits
from capsctl.layers.poses import pose_shape
from capsctl.layers.primary import PrimaryCapsulesWithActivations

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


class SelfRoutingCapsules(BaselineCapsules):
    """A capsule layer with self-routing (Hahn et al. 2019), matrix or vector poses.

    Parameters: ``weight`` (pose weights, as in :class:`BaselineCapsules`), ``route_weight``
    (``[k, l, n, d_in, m]`` conv, ``[n, d_in, m]`` FC) and ``route_bias`` (``[k, l, n, m]`` /
    ``[n, m]``). Init: pose weights ``N(0, m / (x * J))`` like
    :class:`capsctl.layers.capsules.CapsuleLayer`; routing weights and biases zero, so every
    coefficient starts uniform, ``1/m``. ``chunk_sites``: parent sites per chunk of the pose
    sum (None: by the chunk budget of capsctl/layers/backend/chunks.py).

    ``poses=False`` builds a layer whose parents carry activations only (the class capsules of
    Hahn et al., whose output is their activations): it has no pose weights (``weight`` is
    None) and routes no votes.
    """

    def __init__(
        self,
        kind: str,
        in_types: int,
        in_dim: int,
        out_types: int,
        out_dim: int,
        *,
        rows: int,
        kernel: int = 1,
        stride: int = 1,
        poses: bool = True,
    ) -> None:
        super().__init__(
            kind, in_types, in_dim, out_types, out_dim, rows=rows, kernel=kernel, stride=stride
        )
        lead = self.weight.shape[:-3]  # (k, l, n) or (n,)
        if not poses:
            self.weight = None  # type: ignore[assignment]
        self.route_weight = nn.Parameter(torch.empty(*lead, in_dim, out_types))
        self.route_bias = nn.Parameter(torch.empty(*lead, out_types))
        self.chunk_sites: int | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = math.sqrt(self.out_types / (self.cols_in * self.fan))
        with torch.no_grad():
            if self.weight is not None:
                self.weight.normal_(0.0, std)
            self.route_weight.zero_()
            self.route_bias.zero_()

    def routing_weights(self) -> tuple[Tensor, Tensor]:
        """``W^route`` as ``[J, d_in, m]`` and ``b^route`` as ``[J, m]``."""
        j, m = self.fan, self.out_types
        return self.route_weight.reshape(j, self.in_dim, m), self.route_bias.reshape(j, m)

    def route(self, child: Tensor, act: Tensor) -> tuple[Tensor | None, Tensor, Tensor]:
        """Child poses ``[b, H, W, n, d_in]`` / ``[b, ..., d_in]`` and activations
        ``[b, H, W, n]`` / ``[b, ...]`` -> parent poses ``[b, h, w, m, d]`` / ``[b, m, d]``
        (None without pose weights),
        parent activations ``[b, h, w, m]`` / ``[b, m]`` and the coefficients (detached)
        ``[b, h, w, k, l, n, m]`` / ``[b, n, m]``. Under autocast in float32, but for the votes
        where the Triton kernels build them (autocast's 16-bit dtype, float32 sums)."""
        device = child.device.type
        if torch.is_autocast_enabled(device):
            low = torch.get_autocast_dtype(device)
            with torch.autocast(device_type=device, enabled=False):
                return self._route(child.float(), act.float(), low)
        return self._route(child, act)

    def forward(self, child: Tensor, act: Tensor) -> tuple[Tensor | None, Tensor, Tensor]:
        """Same as :meth:`route`."""
        return self.route(child, act)

    def _route(
        self, child: Tensor, act: Tensor, low: torch.dtype | None = None
    ) -> tuple[Tensor | None, Tensor, Tensor]:
        xj, site = self.child_sites(child)  # [J, B, d_in]
        acts = self.child_activations(act)  # [B, J]
        wr, br = self.routing_weights()  # [J, d_in, m], [J, m]
        if self.weight is None:
            c, mass = gate(routing_logits(xj, wr, br), acts)  # [J, B, m] each
            parent = parent_activations(mass.sum(0), acts)  # [B, m]
            coeffs = self.unsite_coefficients(c.detach().permute(1, 2, 0), site)  # from [B, m, J]
            return None, self.unsite(parent, site), coeffs
        j, bsz = xj.shape[0], xj.shape[1]
        a, xd, m, c = self.rows, self.cols_in, self.out_types, self.cols_out
        wj = self.weight.reshape(j, xd, m, c)  # [J, x, m, c]
        xp = xj.view(j, bsz, a, xd)  # [J, B, a, x]
        u, parent, coef = gated_pass(acts, xp, wj, wr, br, self.chunk_sites, low)
        poses = self.unsite(u.reshape(bsz, m, a * c), site)  # [b, h, w, m, d] / [b, m, d]
        coeffs = self.unsite_coefficients(coef.permute(1, 2, 0), site)  # from [B, m, J]
        return poses, self.unsite(parent, site), coeffs


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
            kernel=plan.primary_kernel,
            stride=plan.primary_stride,
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
