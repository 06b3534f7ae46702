"""EM routing (Hinton, Sabour, Frosst, "Matrix capsules with EM routing", ICLR 2018) as a
routing algorithm of capsctl: pose matrices with activations, routed by EM (the math:
capsctl/layers/routers/em/), trained with the spread loss (margin 0.2 -> 0.9).

Parameters (``model.router``): ``iterations`` (the paper's 3); ``lambda_inf`` of the
inverse-temperature schedule ``lambda_t = lambda_inf * (1 - 0.95^(t+1))`` of conv layers (FC
layers, the class capsules included, use a quarter of it; 0.02 is the authors' published
implementation's, see capsctl/layers/routers/em/procedure.py); ``assignment``: ``parents``
(the paper's: a conv child's assignments are normalized over every parent it votes for) or
``window`` (each window routed on its own); ``standardize_costs``: a stabilizer not in the paper,
off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from torch import Tensor, nn

from capsctl.layers.algorithm import (
    Capsules,
    LayerPlan,
    NetworkPlan,
    RoutingAlgorithm,
    RoutingTrace,
)
from capsctl.layers.poses import pose_shape
from capsctl.layers.primary import PrimaryCapsulesWithActivations
from capsctl.layers.routers.em.fused import keeping_assignments
from capsctl.layers.routers.em.layer import EMLayer
from capsctl.layers.routers.em.procedure import EM_FC_LAMBDA_FACTOR, EM_FINAL_LAMBDA


@dataclass
class EMParams:
    """See the module docstring."""

    iterations: int = 3
    lambda_inf: float = EM_FINAL_LAMBDA
    assignment: Literal["parents", "window"] = "parents"
    standardize_costs: bool = False

    def validate(self, path: str) -> None:
        from capsctl.errors import ConfigError

        if not self.lambda_inf > 0:
            raise ConfigError(f"{path}.lambda_inf: must be > 0, got {self.lambda_inf}")


class EMPrimary(PrimaryCapsulesWithActivations):
    def forward(self, feats: Tensor) -> Capsules:  # type: ignore[override]
        return Capsules(*super().forward(feats))


class ActivationHead(nn.Module):
    """Outputs the class activations ``a_c`` in (0, 1) (for the spread loss)."""

    def forward(self, caps: Capsules) -> Tensor:
        assert caps.activations is not None
        return caps.activations  # [b, classes]


class EMRouting(RoutingAlgorithm):
    name = "em"
    title = "EM routing"
    reference = "Hinton, Sabour, Frosst, ICLR 2018"
    coefficient_name = "assignment probabilities"
    summary = (
        "EM routing (Hinton, Sabour and Frosst, ICLR 2018), one of the routing baselines of "
        "the paper below"
    )
    Params = EMParams
    output_kind = "activation"
    loss = "spread"
    scores = ("activation-share", "activation")

    def make_primary(self, plan: NetworkPlan) -> nn.Module:
        return EMPrimary(
            plan.channels,
            plan.primary_types,
            plan.primary_dim,
            kernel=plan.primary_kernel,
            stride=plan.primary_stride,
        )

    def make_layer(self, layer: LayerPlan, plan: NetworkPlan) -> nn.Module:
        p: EMParams = self.params
        rows, _ = pose_shape(layer.in_dim, layer.pose)  # type: ignore[arg-type]
        factor = EM_FC_LAMBDA_FACTOR if layer.kind == "fc" else 1.0
        return EMLayer(
            layer.kind,
            layer.in_types,
            layer.in_dim,
            layer.out_types,
            layer.out_dim,
            rows=rows,
            kernel=layer.kernel,
            stride=layer.stride,
            final_lambda=p.lambda_inf * factor,
            assignment=p.assignment,
            standardize_costs=p.standardize_costs,
        )

    def make_head(self, dim: int, plan: NetworkPlan) -> nn.Module:
        return ActivationHead()

    def run(
        self,
        layers: Sequence[nn.Module],
        caps: Capsules,
        iterations: int,
        schedule: str,
        trace: RoutingTrace | None,
    ) -> Capsules:
        """Layer by layer; a trace gets every iteration's assignments, which a GPU's fused
        E-step otherwise never stores (:func:`keeping_assignments`)."""
        if trace is None:
            return super().run(layers, caps, iterations, schedule, trace)
        with keeping_assignments():
            return super().run(layers, caps, iterations, schedule, trace)
