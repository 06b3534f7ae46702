"""Dynamic routing (Sabour, Frosst, Hinton, "Dynamic routing between capsules", NeurIPS 2017,
arXiv:1710.09829): routing by agreement with squashed vector capsules.

Procedure 1 of the paper, per parent site (letters as in capsctl/layers/passes/routed.py): ``b_ij =
0``; each iteration ``c_ij = softmax_j(b_ij)`` over the parents ``j`` of the site, ``s_j =
sum_i c_ij u_hat_ij``, ``v_j = squash(s_j)`` (eq. 1), and ``b_ij += <u_hat_ij, v_j>`` before
the next iteration. 3 iterations (the paper's); gradients flow through every iteration.

Since ``b_ij`` after iteration ``t`` is ``<u_hat_ij, v_j^1 + ... + v_j^t>``, each iteration
after the first is one routed pass of inverted dot-product attention
(capsctl/layers/passes/routed.py) with the running sum of the parent poses as its query, scale 1 and
no LayerNorm: the votes are never stored (chunked, recomputed in the backward pass), and the
first iteration (uniform coefficients ``1/m``) is one convolution or matrix product. Conv
layers (the paper has none) route every ``k x k`` window on its own, normalizing over the
parent types at each output position, as the main model does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from capsctl.layers.algorithm import (
    Capsules,
    LayerPlan,
    LayerRouting,
    NetworkPlan,
    RoutingAlgorithm,
)
from capsctl.layers.backend.dispatch import run_fused, takes_triton
from capsctl.layers.capsules import CapsuleLayer, ConvCapsules, FCCapsules
from capsctl.layers.primary import PrimaryCapsules


def squash(s: Tensor, dim: int = -1) -> Tensor:
    """``squash(s) = |s|^2 / (1 + |s|^2) * s / |s| = s |s| / (1 + |s|^2)`` (Sabour et al. 2017,
    eq. 1), exactly; ``torch.linalg.vector_norm`` has gradient 0 at ``s = 0``, so no epsilon.
    Where the Triton kernels run (a GPU), over the last dimension, one kernel forward and one
    backward (capsctl/layers/backend/triton/squash.py; these torch operators if it fails)."""
    if dim in (-1, s.dim() - 1) and takes_triton(s):
        fused = run_fused("squash", _triton_squash, s)
        if fused is not None:
            return fused
    norm = torch.linalg.vector_norm(s, dim=dim, keepdim=True)
    return s * (norm / (1.0 + norm * norm))


def _triton_squash(s: Tensor) -> Tensor:
    from capsctl.layers.backend.triton.squash_ops import triton_squash

    return triton_squash(s)


@dataclass
class DynamicParams:
    """``iterations``: routing iterations (the paper's: 3)."""

    iterations: int = 3


def route_by_agreement(layer: CapsuleLayer, caps: Capsules, iterations: int) -> LayerRouting:
    """Procedure 1 on one layer: uniform pass, then ``T - 1`` routed passes whose query is the
    sum of the parent poses so far (the logits ``b_ij`` are agreements with that sum). Where
    the compiled loops run, all of them as one pass (capsctl/layers/passes/agreement.py)."""
    child = caps.poses
    fused = layer.agreement(child, iterations)  # every iteration in one pass, where it runs
    if fused is not None:
        poses, coeffs = fused
        first = layer.uniform_coefficients(child)
        return LayerRouting(Capsules(poses[-1]), [first, *coeffs], poses)
    v = squash(layer.uniform_sum(child))  # [b, (h, w,) m, d]
    out = LayerRouting(Capsules(v), [layer.uniform_coefficients(child)], [v])
    total = v
    with layer.same_children():
        for t in range(1, iterations):
            s, coeff = layer.routed_sum(child, total, 1.0)
            v = squash(s)
            out.coefficients.append(coeff)
            out.poses.append(v)
            if t + 1 < iterations:
                total = total + v
    out.capsules = Capsules(v)
    return out


def _dynamic_init(layer: CapsuleLayer, fan: int) -> None:
    """``W ~ N(0, std^2)``, ``std = 2 m / sqrt(J * d_out)`` with ``J`` the children per parent
    site: with the uniform coefficients ``1/m`` of the first iteration ``E|s_j|^2 = 4 |u|^2``,
    so a uniform pass maps capsules of length 0.5 to length 0.5 after the squash (gain 2 is the
    smallest for which lengths have a fixed point; below it they shrink layer after layer, as
    they do with the paper's ``N(0, 0.01)`` on these layer sizes)."""
    layer._init_std = 2.0 * layer.out_types / math.sqrt(fan * layer.out_dim)
    layer.reset_parameters()


class DynamicConv(ConvCapsules):
    """Conv capsule layer with vector poses and dynamic routing; weights ``W[k, l, n, x, m, c]``."""

    def __init__(self, layer: LayerPlan) -> None:
        super().__init__(
            layer.in_types,
            layer.in_dim,
            layer.out_types,
            layer.out_dim,
            kernel=layer.kernel,
            stride=layer.stride,
            pose="vector",
            layer_norm=False,
            agreement_scale=False,
        )
        _dynamic_init(self, layer.in_types * layer.kernel * layer.kernel)

    def forward(self, caps: Capsules, iterations: int) -> LayerRouting:
        return route_by_agreement(self, caps, iterations)


class DynamicFC(FCCapsules):
    """FC capsule layer with vector poses and dynamic routing; weights ``W[n, x, m, c]``."""

    def __init__(self, layer: LayerPlan) -> None:
        super().__init__(
            layer.in_types,
            layer.in_dim,
            layer.out_types,
            layer.out_dim,
            pose="vector",
            layer_norm=False,
            agreement_scale=False,
        )
        _dynamic_init(self, layer.in_types)

    def forward(self, caps: Capsules, iterations: int) -> LayerRouting:
        return route_by_agreement(self, caps, iterations)


class SquashedPrimary(PrimaryCapsules):
    """The main model's convolution to capsules, squashed instead of LayerNorm-ed."""

    def forward(self, feats: Tensor) -> Capsules:  # type: ignore[override]
        return Capsules(squash(super().forward(feats)))


class LengthHead(nn.Module):
    """Outputs ``logit_scale * |v_c|``: the class capsules' lengths (``logit_scale`` 1 by
    default, so outputs lie in [0, 1) for the margin loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = 1.0

    def forward(self, caps: Capsules) -> Tensor:
        return torch.linalg.vector_norm(caps.poses, dim=-1) * self.logit_scale  # [b, classes]


class DynamicRouting(RoutingAlgorithm):
    """Every pose is a vector (a matrix spec is read as a vector of the same dim)."""

    name = "dynamic"
    title = "dynamic routing"
    reference = "Sabour, Frosst, Hinton, NeurIPS 2017, arXiv:1710.09829"
    coefficient_name = "coupling coefficients"
    summary = (
        "dynamic routing (Sabour, Frosst and Hinton, NeurIPS 2017, arXiv:1710.09829), one of "
        "the routing baselines of the paper below"
    )
    Params = DynamicParams
    output_kind = "length"
    loss = "margin"
    scores = ("length-share", "length")
    vector_poses = True

    def make_primary(self, plan: NetworkPlan) -> nn.Module:
        return SquashedPrimary(
            plan.channels,
            plan.primary_types,
            plan.primary_dim,
            layer_norm=False,
            kernel=plan.primary_kernel,
            stride=plan.primary_stride,
        )

    def make_layer(self, layer: LayerPlan, plan: NetworkPlan) -> nn.Module:
        return DynamicConv(layer) if layer.kind == "conv" else DynamicFC(layer)

    def make_head(self, dim: int, plan: NetworkPlan) -> nn.Module:
        return LengthHead()
