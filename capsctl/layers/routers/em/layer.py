"""The EM capsule layer (Hinton, Sabour, Frosst, ICLR 2018): weights, activations' biases, the
child sites (capsctl/layers/baseline_capsules.py) and the choice between the routing over the
whole votes and the chunked one (capsctl/layers/routers/em/procedure.py)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from capsctl.layers.algorithm import Capsules, LayerRouting
from capsctl.layers.backend.dispatch import choose
from capsctl.layers.baseline_capsules import BaselineCapsules
from capsctl.layers.passes.flops import add_routing_flops
from capsctl.layers.routers.em.procedure import (
    EM_ASSIGNMENTS,
    EM_FC_LAMBDA_FACTOR,
    EM_FINAL_LAMBDA,
    EM_INIT_STD,
    em_routing,
    em_routing_chunked,
)
from capsctl.layers.routers.em.windows import WindowGrid

__all__ = ["EMCapsules", "EMLayer"]


class EMCapsules(BaselineCapsules):
    """A capsule layer with pose matrices, activations and EM routing (Hinton et al. 2018).

    Votes ``V_ij = M_i W_ij`` (the pose times a learned ``x x c`` matrix, the convention of the
    main model; a vector pose is a ``1 x d`` row). ``beta_u``, ``beta_a``: one per parent type,
    shared over positions, initialized to 0 (the paper gives no initial value; the authors' code
    starts its biases at 0.5 to 2 in a rescaled parametrization that has no counterpart here).
    Init: ``W`` from a normal with std ``EM_INIT_STD[kind]`` (0.3 conv, 0.01 FC) truncated at
    2 std, as the authors' implementation (capsule_em/em_layers.py) does.

    ``final_lambda``: ``lambda_inf`` of the inverse-temperature schedule (:func:`em_routing`);
    default ``EM_FINAL_LAMBDA`` (0.02) for conv layers and a quarter of it for FC layers.
    ``assignment`` (conv layers): ``"parents"`` (default, the paper's) normalizes a child's
    assignments over every parent it votes for, in all the windows it falls in; ``"window"``
    routes each window on its own, normalizing over the ``m`` parent types there (as the main
    model and the dynamic-routing baseline do; cheaper to reason about, not the paper's).
    ``standardize_costs``: see :func:`em_routing` (off by default; not in the paper).
    No coordinate addition: the class layer has separate weights for every child position, like
    the main model's FC layer, so positions are already distinguishable.
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
        final_lambda: float | None = None,
        assignment: str = "parents",
        standardize_costs: bool = False,
    ) -> None:
        super().__init__(
            kind, in_types, in_dim, out_types, out_dim, rows=rows, kernel=kernel, stride=stride
        )
        if assignment not in EM_ASSIGNMENTS:
            raise ValueError(f"assignment must be one of {EM_ASSIGNMENTS}, got {assignment!r}")
        if final_lambda is None:
            factor = EM_FC_LAMBDA_FACTOR if kind == "fc" else 1.0
            final_lambda = EM_FINAL_LAMBDA * factor
        self.final_lambda = final_lambda
        self.assignment = assignment
        self.standardize_costs = standardize_costs
        self.beta_u = nn.Parameter(torch.zeros(out_types))
        self.beta_a = nn.Parameter(torch.zeros(out_types))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = EM_INIT_STD[self.kind]
        with torch.no_grad():
            nn.init.trunc_normal_(self.weight, 0.0, std, -2.0 * std, 2.0 * std)
            self.beta_u.zero_()
            self.beta_a.zero_()

    def route(
        self, child: Tensor, act: Tensor, iterations: int, final_lambda: float | None = None
    ) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor], list[Tensor]]:
        """Child poses and activations -> parent poses (``[b, h, w, m, d]`` / ``[b, m, d]``),
        activations (``[b, h, w, m]`` / ``[b, m]``), and per iteration ``R`` (``[b, h, w, k,
        l, n, m]`` / ``[b, n, m]``), the parent poses and the parent activations.
        ``final_lambda`` overrides the layer's ``lambda_inf`` for this call."""
        xs, site = self.sites(child)  # [B, J, d_in]
        a_in = self.child_activations(act)  # [B, J]
        grid = None
        if self.kind == "conv" and self.assignment == "parents":
            grid = WindowGrid.of(act, self.kernel, self.stride)
        lam = self.final_lambda if final_lambda is None else final_lambda
        knobs = {"grid": grid, "standardize_costs": self.standardize_costs}
        # per vote entry, 2 multiply-accumulates in each M-step (the moments sum_J R V and
        # sum_J R V^2) and in each E-step but the last (the quadratic form of the Gaussian);
        # per assignment, 1 in each M-step (the mass sum_J R a)
        bsz, j = a_in.shape
        entries = bsz * j * self.out_types * self.out_dim
        add_routing_flops(2 * 2 * entries * (2 * iterations - 1))
        add_routing_flops(2 * bsz * j * self.out_types * iterations)
        dt = self.weight.dtype
        with torch.autocast(xs.device.type, enabled=False):  # routing stays in float32
            xs, a_in = xs.to(dt), a_in.to(dt)
            if choose(xs, a_in).backend == "dense":
                votes = self.votes(xs)  # [B, m, J, d]
                out = em_routing(votes, a_in, self.beta_u, self.beta_a, iterations, lam, **knobs)
            else:
                w, beta_u, beta_a = self.weight, self.beta_u, self.beta_a
                out = em_routing_chunked(
                    xs, w, a_in, beta_u, beta_a, iterations, lam, rows=self.rows, **knobs
                )
        mu, a_out, rs, mus, acts = out
        return (
            self.unsite(mu, site),
            self.unsite(a_out, site),
            [self.unsite_coefficients(r, site) for r in rs],
            [self.unsite(p, site) for p in mus],
            [self.unsite(a, site) for a in acts],
        )


class EMLayer(EMCapsules):
    """An EM capsule layer speaking the routing interface."""

    def forward(self, caps: Capsules, iterations: int) -> LayerRouting:
        assert caps.activations is not None, "EM routing needs child activations"
        pose, act, rs, mus, acts = self.route(caps.poses, caps.activations, iterations)
        return LayerRouting(Capsules(pose, act), rs, mus, acts)
