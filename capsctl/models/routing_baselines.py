"""Capsule networks with the baseline routings: dynamic routing and EM routing.

The math lives in capsctl/layers/dynamic_routing.py (Sabour, Frosst, Hinton, NeurIPS 2017,
arXiv:1710.09829) and capsctl/layers/em_routing.py (Hinton, Sabour, Frosst, "Matrix capsules
with EM routing", ICLR 2018); this module assembles those layers into networks built from
capsctl's layer lists.

Both models reuse :func:`capsctl.models.capsnet.plan_layers` (grids, child counts, the class
capsules) and the backbone and 1x1 primary-capsule convolution of :class:`CapsNet`, and expose the
same API: ``forward(x, trace=False)`` returns ``[b, classes]`` or ``(outputs, RoutingTrace)``,
``set_routing(iterations, mode)``, ``parameter_counts()``, ``capsules`` (the capsule layers, each
with ``out_types``), ``iterations`` and ``routing``.

Both procedures are *sequential* by construction (each layer runs all its iterations before the
next layer starts): ``cfg.routing`` is ignored, ``routing`` is always ``"sequential"``, and
``set_routing(mode="concurrent")`` raises ``ValueError``. ``cfg.dropout``, ``cfg.layer_norm``,
``cfg.agreement_scale`` and ``cfg.head`` belong to inverted dot-product routing and are ignored.
Both papers route 3 times; the registered ``*-dynamic*`` and ``*-em*`` models do too.

Outputs are not logits in the cross-entropy sense; ``output_kind`` says what they are:

- :class:`DynamicCapsNet` (``output_kind = "length"``): ``logit_scale * |v_c|``, the lengths of
  the class capsules (``logit_scale`` defaults to 1.0, so the outputs lie in ``[0, 1)`` and suit
  :func:`capsctl.losses.margin_loss`; for cross-entropy raise ``logit_scale``, e.g. to 10, since
  a softmax over values in ``[0, 1)`` is nearly flat).
- :class:`EMCapsNet` (``output_kind = "activation"``): the class activations ``a_c`` in ``(0, 1)``
  for :func:`capsctl.losses.spread_loss`; for cross-entropy use ``logit(a_c)``.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch
from torch import Tensor, nn

from capsctl.errors import ConfigError
from capsctl.layers.capsules import PrimaryCapsules
from capsctl.layers.dynamic_routing import DynamicCapsules, squash
from capsctl.layers.em_routing import EM_FC_LAMBDA_FACTOR, EMCapsules
from capsctl.layers.poses import PoseKind, pose_shape
from capsctl.models.backbones import BACKBONE_CHANNELS, build_backbone
from capsctl.models.capsnet import RoutingTrace, plan_layers
from capsctl.models.spec import CapsLayerSpec, ModelConfig


def _check_iterations(iterations: int) -> None:
    if iterations < 1:
        raise ConfigError("model.iterations: must be >= 1")


class _BaselineNet(nn.Module):
    """Backbone, primary capsules, capsule layers, routing settings and parameter groups."""

    arch = ""
    output_kind = ""
    capsules: nn.ModuleList

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.arch != self.arch:
            raise ConfigError(
                f"model.arch: {type(self).__name__} builds arch {self.arch!r}, got {cfg.arch!r}"
            )
        _check_iterations(cfg.iterations)
        self.config = cfg
        self.iterations = cfg.iterations
        self.routing = "sequential"
        self.backbone = build_backbone(cfg.backbone, cfg.in_channels)
        self.primary = PrimaryCapsules(
            BACKBONE_CHANNELS[cfg.backbone], cfg.primary_types, cfg.primary_dim, layer_norm=False
        )
        self._child_grids: list[tuple[int, int, int] | None] = []

    def _add_grid(self, item: dict[str, object]) -> None:
        g = item["in_grid"] if item["spec"].kind == "fc" else None  # type: ignore[attr-defined]
        self._child_grids.append((g, g, item["child_types"]) if g is not None else None)  # type: ignore[arg-type]

    def set_routing(self, iterations: int | None = None, mode: str | None = None) -> None:
        """Change T; ``mode`` may only be ``"sequential"`` (the only schedule these have)."""
        if iterations is not None:
            if iterations < 1:
                raise ValueError("iterations must be >= 1")
            self.iterations = iterations
        if mode is not None and mode != "sequential":
            if mode == "concurrent":
                raise ValueError(
                    f"{self.arch} routes layer by layer; only mode 'sequential' applies"
                )
            raise ValueError(f"unknown routing mode {mode!r}")

    def _new_trace(self) -> RoutingTrace:
        n = len(self.capsules)
        return RoutingTrace(
            coefficients=[[] for _ in range(n)],
            poses=[[] for _ in range(n)],
            kinds=[layer.kind for layer in self.capsules],
            child_grids=list(self._child_grids),
        )

    def parameter_counts(self) -> dict[str, int]:
        """Parameter counts of the backbone and of the capsule part."""
        backbone = sum(p.numel() for p in self.backbone.parameters())
        total = sum(p.numel() for p in self.parameters())
        return {"total": total, "backbone": backbone, "capsules": total - backbone}


class DynamicCapsNet(_BaselineNet):
    """Backbone -> squashed primary capsules -> dynamic-routing capsule layers -> lengths.

    Built from ``cfg.layers`` as :class:`CapsNet` is, with every pose a vector of the layer's
    ``pose_dim`` (a matrix spec becomes a vector of the same dim). The primary capsules are the
    main model's 1x1 convolution, squashed instead of LayerNorm-ed. ``forward`` returns
    ``logit_scale * |v_c|`` (``output_kind = "length"``; see the module docstring).
    """

    arch = "capsnet-dynamic"
    output_kind = "length"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.logit_scale = 1.0
        layers: list[nn.Module] = []
        for item in plan_layers(_as_vectors(cfg)):
            spec: CapsLayerSpec = item["spec"]  # type: ignore[assignment]
            layers.append(
                DynamicCapsules(
                    spec.kind,
                    item["in_types"],  # type: ignore[arg-type]
                    item["in_dim"],  # type: ignore[arg-type]
                    spec.types,
                    spec.pose_dim,
                    kernel=spec.kernel if spec.kind == "conv" else 1,
                    stride=spec.stride if spec.kind == "conv" else 1,
                )
            )
            self._add_grid(item)
        self.capsules = nn.ModuleList(layers)

    def class_poses(self, x: Tensor, trace: RoutingTrace | None = None) -> Tensor:
        """Class capsules ``v[b, classes, d]``, routing layer by layer."""
        child = squash(self.primary(self.backbone(x)))  # [b, h, w, n, d]
        for i, layer in enumerate(self.capsules):
            child, coeffs, poses = layer.route(child, self.iterations)
            if trace is not None:
                trace.coefficients[i] = [c.detach() for c in coeffs]
                trace.poses[i] = [p.detach() for p in poses]
        return child

    def forward(self, x: Tensor, trace: bool = False) -> Tensor | tuple[Tensor, RoutingTrace]:
        rt = self._new_trace() if trace else None
        v = self.class_poses(x, rt)  # [b, classes, d]
        out = torch.linalg.vector_norm(v, dim=-1) * self.logit_scale  # [b, classes]
        return (out, rt) if rt is not None else out


class EMCapsNet(_BaselineNet):
    """Backbone -> primary capsules (pose conv + sigmoid activation conv) -> EM-routing layers.

    Poses are matrices as in the main model (4x4 for pose dim 16; a vector spec is a ``1 x d``
    row). The primary capsules are the main model's 1x1 pose convolution (no LayerNorm) plus a
    1x1 convolution (with bias) to one sigmoid activation per capsule type. ``forward`` returns
    the class activations ``a_c`` (``output_kind = "activation"``).

    Routing knobs from the config: ``em_lambda`` (``lambda_inf`` of conv layers; FC layers,
    the class capsules included, use a quarter of it), ``em_assignment`` and
    ``em_standardize_costs`` (see :class:`EMCapsules`). The paper routes 3 times
    (``iterations = 3`` in the registered models).
    """

    arch = "capsnet-em"
    output_kind = "activation"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        if not cfg.em_lambda > 0:
            raise ConfigError(f"model.em_lambda: must be > 0, got {cfg.em_lambda}")
        self.primary_act = nn.Conv2d(
            BACKBONE_CHANNELS[cfg.backbone], cfg.primary_types, kernel_size=1
        )
        layers: list[nn.Module] = []
        for item in plan_layers(cfg):
            spec: CapsLayerSpec = item["spec"]  # type: ignore[assignment]
            in_dim: int = item["in_dim"]  # type: ignore[assignment]
            rows, _ = pose_shape(in_dim, spec.pose)
            if spec.pose_dim % rows:
                raise ConfigError(f"model: pose dim {spec.pose_dim} is not a {rows}-row matrix")
            factor = EM_FC_LAMBDA_FACTOR if spec.kind == "fc" else 1.0
            layers.append(
                EMCapsules(
                    spec.kind,
                    item["in_types"],  # type: ignore[arg-type]
                    in_dim,
                    spec.types,
                    spec.pose_dim,
                    rows=rows,
                    kernel=spec.kernel if spec.kind == "conv" else 1,
                    stride=spec.stride if spec.kind == "conv" else 1,
                    final_lambda=cfg.em_lambda * factor,
                    assignment=cfg.em_assignment,
                    standardize_costs=cfg.em_standardize_costs,
                )
            )
            self._add_grid(item)
        self.capsules = nn.ModuleList(layers)

    def class_capsules(self, x: Tensor, trace: RoutingTrace | None = None) -> tuple[Tensor, Tensor]:
        """Class poses ``[b, classes, d]`` and activations ``[b, classes]``."""
        feats = self.backbone(x)  # [b, C, H, W]
        pose = self.primary(feats)  # [b, h, w, n, d]
        act = torch.sigmoid(self.primary_act(feats)).permute(0, 2, 3, 1)  # [b, h, w, n]
        for i, layer in enumerate(self.capsules):
            pose, act, rs, mus, _ = layer.route(pose, act, self.iterations)
            if trace is not None:
                trace.coefficients[i] = [r.detach() for r in rs]
                trace.poses[i] = [p.detach() for p in mus]
        return pose, act

    def forward(self, x: Tensor, trace: bool = False) -> Tensor | tuple[Tensor, RoutingTrace]:
        rt = self._new_trace() if trace else None
        _, act = self.class_capsules(x, rt)  # [b, classes]
        return (act, rt) if rt is not None else act


# --------------------------------------------------------------------------------------------
# Config helpers
# --------------------------------------------------------------------------------------------


def _as_vectors(cfg: ModelConfig) -> ModelConfig:
    layers = [dataclasses.replace(s, pose="vector") for s in cfg.layers]
    return cfg.replace(layers=layers, class_pose="vector")


def dynamic_config(base: ModelConfig) -> ModelConfig:
    """A copy of ``base`` for :class:`DynamicCapsNet`: arch ``capsnet-dynamic``, every pose a
    vector of the same dim, routing ``sequential`` (the only schedule dynamic routing has)."""
    cfg = _as_vectors(copy.deepcopy(base))
    return cfg.replace(arch="capsnet-dynamic", routing="sequential")


def em_config(base: ModelConfig) -> ModelConfig:
    """A copy of ``base`` for :class:`EMCapsNet`: arch ``capsnet-em``, routing ``sequential``,
    and matrix poses wherever the pose dim allows them (a square dim equal to the input's);
    other layers keep vector poses (``1 x d`` rows)."""
    cfg = copy.deepcopy(base)
    dim = cfg.primary_dim
    layers: list[CapsLayerSpec] = []
    for spec in cfg.layers:
        layers.append(dataclasses.replace(spec, pose=_em_pose(dim, spec.pose_dim)))
        dim = spec.pose_dim
    class_dim = cfg.class_pose_dim if cfg.class_pose_dim is not None else dim
    return cfg.replace(
        arch="capsnet-em",
        routing="sequential",
        layers=layers,
        class_pose=_em_pose(dim, class_dim),
    )


def _em_pose(in_dim: int, out_dim: int) -> PoseKind:
    if in_dim == out_dim and math.isqrt(in_dim) ** 2 == in_dim:
        return "matrix"
    return "vector"
