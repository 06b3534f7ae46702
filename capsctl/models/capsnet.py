"""Capsule network with inverted dot-product attention routing (Tsai et al., ICLR 2020)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from capsctl.errors import ConfigError
from capsctl.layers.capsules import ConvCapsules, FCCapsules, PrimaryCapsules
from capsctl.layers.poses import pose_shape
from capsctl.models.backbones import BACKBONE_CHANNELS, backbone_grid, build_backbone
from capsctl.models.spec import CapsLayerSpec, ModelConfig


@dataclass
class RoutingTrace:
    """Routing coefficients of every capsule layer at every iteration.

    ``coefficients[l][t]`` is layer ``l``'s (0 = first capsule layer after the primary capsules)
    coefficients at iteration ``t`` (0 = the uniform pass): ``[b, h, w, k, l, n, m]`` for conv
    layers, ``[b, n, m]`` for FC layers. ``poses[l][t]`` holds the parent poses after that pass.
    ``child_grids[l]`` is the ``(h, w, n)`` grid that an FC layer's flat children come from, or
    None.
    """

    coefficients: list[list[Tensor]] = field(default_factory=list)
    poses: list[list[Tensor]] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    child_grids: list[tuple[int, int, int] | None] = field(default_factory=list)


def _class_capsules(cfg: ModelConfig) -> CapsLayerSpec:
    """The class capsules as an FC layer spec (pose dim: ``class_pose_dim``, else the last
    layer's, else the primary capsules')."""
    dim = cfg.class_pose_dim
    if dim is None:
        dim = cfg.layers[-1].pose_dim if cfg.layers else cfg.primary_dim
    return CapsLayerSpec(kind="fc", types=cfg.num_classes, pose_dim=dim, pose=cfg.class_pose)


def _check_matrix_pose(where: str, spec: CapsLayerSpec, dim: int) -> None:
    """A matrix-pose layer needs a square input pose dim and keeps it."""
    if spec.pose != "matrix":
        return
    try:
        pose_shape(dim, "matrix")
    except ValueError:
        raise ConfigError(
            f"{where}: matrix poses need a square input pose dim, got {dim}"
        ) from None
    if spec.pose_dim != dim:
        raise ConfigError(
            f"{where}.pose_dim: matrix poses keep their dim ({dim}); use pose: vector to change it"
        )


def plan_layers(cfg: ModelConfig) -> list[dict[str, object]]:
    """Resolve grid sizes and child counts of every capsule layer, class capsules included.

    Raises ConfigError when the input size leaves no grid or the layer list is inconsistent.
    """
    size = backbone_grid(cfg.backbone, cfg.input_size)
    if size < 1:
        raise ConfigError(
            f"model.input_size: {cfg.input_size} leaves no feature grid; use a larger input"
        )
    types, dim, kind = cfg.primary_types, cfg.primary_dim, "conv"
    plan: list[dict[str, object]] = []
    for i, spec in enumerate([*cfg.layers, _class_capsules(cfg)]):
        where = f"model.layers[{i}]" if i < len(cfg.layers) else "model (class capsules)"
        _check_matrix_pose(where, spec, dim)
        if spec.kind == "conv":
            if kind != "conv":
                raise ConfigError(f"{where}.kind: a conv capsule layer cannot follow an fc one")
            out = (size - spec.kernel) // spec.stride + 1
            if out < 1:
                raise ConfigError(
                    f"{where}: a {size}x{size} grid is too small for kernel {spec.kernel}; "
                    "use a larger model.input_size or a smaller kernel"
                )
            plan.append(dict(spec=spec, in_types=types, in_dim=dim, in_grid=size, out_grid=out))
            size = out
        else:
            plan.append(
                dict(
                    spec=spec,
                    in_types=types * size * size if kind == "conv" else types,
                    in_dim=dim,
                    in_grid=size if kind == "conv" else None,
                    child_types=types,
                    out_grid=None,
                )
            )
            kind = "fc"
        types, dim = spec.types, spec.pose_dim
    return plan


class PerClassHead(nn.Module):
    """``logit_c = w_c . p_c + b_c``: a separate linear read-out per class capsule."""

    def __init__(self, classes: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(classes, dim))
        self.bias = nn.Parameter(torch.zeros(classes))
        nn.init.uniform_(self.weight, -(dim**-0.5), dim**-0.5)

    def forward(self, poses: Tensor) -> Tensor:
        return (poses * self.weight).sum(-1, keepdim=True) + self.bias[:, None]  # [b, classes, 1]


class CapsNet(nn.Module):
    """Backbone -> primary capsules -> capsule layers -> class capsules -> shared linear head.

    ``forward(x)`` returns logits ``[b, classes]``. ``forward(x, trace=True)`` also returns a
    :class:`RoutingTrace` with every layer's coefficients at every iteration (all passes are then
    computed, including those that cannot reach the output).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.iterations < 1:
            raise ConfigError("model.iterations: must be >= 1")
        self.config = cfg
        self.iterations = cfg.iterations
        self.routing = cfg.routing
        self.backbone = build_backbone(cfg.backbone, cfg.in_channels)
        self.primary = PrimaryCapsules(
            BACKBONE_CHANNELS[cfg.backbone],
            cfg.primary_types,
            cfg.primary_dim,
            layer_norm=cfg.layer_norm,
        )
        common = dict(
            dropout=cfg.dropout, layer_norm=cfg.layer_norm, agreement_scale=cfg.agreement_scale
        )
        layers: list[nn.Module] = []
        self._child_grids: list[tuple[int, int, int] | None] = []
        for item in plan_layers(cfg):
            spec: CapsLayerSpec = item["spec"]  # type: ignore[assignment]
            if spec.kind == "conv":
                layers.append(
                    ConvCapsules(
                        item["in_types"],
                        item["in_dim"],
                        spec.types,
                        spec.pose_dim,  # type: ignore[arg-type]
                        kernel=spec.kernel,
                        stride=spec.stride,
                        pose=spec.pose,
                        **common,
                    )
                )
                self._child_grids.append(None)
            else:
                layers.append(
                    FCCapsules(
                        item["in_types"],
                        item["in_dim"],
                        spec.types,
                        spec.pose_dim,  # type: ignore[arg-type]
                        pose=spec.pose,
                        **common,
                    )
                )
                g = item["in_grid"]
                self._child_grids.append((g, g, item["child_types"]) if g is not None else None)  # type: ignore[arg-type]
        self.capsules = nn.ModuleList(layers)
        dim = self.capsules[-1].out_dim
        self.head = (
            nn.Linear(dim, 1) if cfg.head == "shared" else PerClassHead(cfg.num_classes, dim)
        )

    def set_routing(self, iterations: int | None = None, mode: str | None = None) -> None:
        """Change T or the schedule without touching the weights."""
        if iterations is not None:
            if iterations < 1:
                raise ValueError("iterations must be >= 1")
            self.iterations = iterations
        if mode is not None:
            if mode not in ("concurrent", "sequential"):
                raise ValueError(f"unknown routing mode {mode!r}")
            self.routing = mode

    def class_poses(self, x: Tensor, trace: RoutingTrace | None = None) -> Tensor:
        feats = self.backbone(x)
        child = self.primary(feats)  # [b, h, w, n, d]
        layers = list(self.capsules)
        big_l, big_t = len(layers), self.iterations
        if trace is not None:
            trace.kinds = ["conv" if isinstance(m, ConvCapsules) else "fc" for m in layers]
            trace.child_grids = list(self._child_grids)
            trace.coefficients = [[] for _ in layers]
            trace.poses = [[] for _ in layers]

        def record(i: int, pose: Tensor, coeff: Tensor) -> None:
            if trace is not None:
                trace.coefficients[i].append(coeff.detach())
                trace.poses[i].append(pose.detach())

        if self.routing == "sequential":
            for i, layer in enumerate(layers):
                parent = layer.uniform(child)
                if trace is not None:
                    record(i, parent, layer.uniform_coefficients(child))
                for _ in range(2, big_t + 1):
                    parent, coeff = layer.route(child, parent)
                    record(i, parent, coeff)
                child = parent
            return child

        # Concurrent: iteration 1 is one uniform bottom-up pass; every later iteration updates
        # all layers at once from the poses of the previous iteration.
        poses: list[Tensor] = [child]
        for i, layer in enumerate(layers):
            poses.append(layer.uniform(poses[-1]))
            if trace is not None:
                record(i, poses[-1], layer.uniform_coefficients(poses[-2]))
        for t in range(2, big_t + 1):
            new = list(poses)
            for i, layer in enumerate(layers):
                # Pass t of layer i+1 (1-based) reaches the output only if t <= T - (L - (i+1)).
                if trace is None and t > big_t - (big_l - (i + 1)):
                    continue
                new[i + 1], coeff = layer.route(poses[i], poses[i + 1])
                record(i, new[i + 1], coeff)
            poses = new
        return poses[-1]

    def forward(self, x: Tensor, trace: bool = False) -> Tensor | tuple[Tensor, RoutingTrace]:
        rt = RoutingTrace() if trace else None
        poses = self.class_poses(x, rt)  # [b, classes, d]
        logits = self.head(poses).squeeze(-1)  # [b, classes]
        if rt is not None:
            return logits, rt
        return logits

    def parameter_counts(self) -> dict[str, int]:
        """Parameter counts of the backbone and of the capsule part."""
        backbone = sum(p.numel() for p in self.backbone.parameters())
        total = sum(p.numel() for p in self.parameters())
        return {"total": total, "backbone": backbone, "capsules": total - backbone}


def architecture_summary(cfg: ModelConfig) -> str:
    """One line naming the backbone, the primary capsules, every capsule layer with its output
    grid, and the routing schedule, e.g. ``resnet backbone, primary 32x16, conv 32x16 k3s2 ->
    7x7, conv 32x16 k3s1 -> 5x5, fc 800->10; T=2 concurrent``."""
    plan = plan_layers(cfg)
    parts = [f"{cfg.backbone} backbone", f"primary {cfg.primary_types}x{cfg.primary_dim}"]
    for item in plan:
        spec: CapsLayerSpec = item["spec"]  # type: ignore[assignment]
        if spec.kind == "conv":
            parts.append(
                f"conv {spec.types}x{spec.pose_dim} k{spec.kernel}s{spec.stride} "
                f"-> {item['out_grid']}x{item['out_grid']}"
            )
        else:
            parts.append(f"fc {item['in_types']}->{spec.types}")
    return ", ".join(parts) + f"; T={cfg.iterations} {cfg.routing}"
