"""The capsule network, for every routing algorithm (capsctl/layers/routers/): inverted
dot-product attention routing (Tsai et al., ICLR 2020) by default."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor, nn

from capsctl.devices import in_float32
from capsctl.errors import ConfigError
from capsctl.layers import (
    Capsules,
    LayerPlan,
    NetworkPlan,
    PerClassHead,
    RoutingTrace,
    images_channels_last,
    pose_shape,
)
from capsctl.models.backbones import backbone_channels, backbone_grid, build_backbone
from capsctl.models.spec import CapsLayerSpec, ModelConfig


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


def primary_grid(cfg: ModelConfig) -> int:
    """Side of the primary capsules' grid: the backbone's, then the primary convolution's
    (``primary_kernel``, ``primary_stride``, no padding). ConfigError when none is left."""
    size = backbone_grid(cfg.backbone, cfg.input_size)
    if size < 1:
        raise ConfigError(
            f"model.input_size: {cfg.input_size} leaves no feature grid; use a larger input"
        )
    out = (size - cfg.primary_kernel) // cfg.primary_stride + 1
    if out < 1:
        raise ConfigError(
            f"model.primary_kernel: a {size}x{size} feature grid is too small for kernel "
            f"{cfg.primary_kernel}; use a smaller kernel or a larger model.input_size"
        )
    return out


def plan_layers(cfg: ModelConfig) -> list[dict[str, object]]:
    """Resolve grid sizes and child counts of every capsule layer, class capsules included.

    Raises ConfigError when the input size leaves no grid or the layer list is inconsistent.
    """
    size = primary_grid(cfg)
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


def _as_vectors(cfg: ModelConfig) -> ModelConfig:
    """Every pose a vector of the same dim (for algorithms with vector poses only)."""
    layers = [dataclasses.replace(s, pose="vector") for s in cfg.layers]
    return cfg.replace(layers=layers, class_pose="vector")


def layer_plans(cfg: ModelConfig, vector_poses: bool = False) -> list[LayerPlan]:
    """The capsule layers to build (class capsules last), from :func:`plan_layers`."""
    plans = []
    for item in plan_layers(_as_vectors(cfg) if vector_poses else cfg):
        spec: CapsLayerSpec = item["spec"]  # type: ignore[assignment]
        conv = spec.kind == "conv"
        plans.append(
            LayerPlan(
                kind=spec.kind,
                in_types=item["in_types"],  # type: ignore[arg-type]
                in_dim=item["in_dim"],  # type: ignore[arg-type]
                out_types=spec.types,
                out_dim=spec.pose_dim,
                pose=spec.pose,
                kernel=spec.kernel if conv else 1,
                stride=spec.stride if conv else 1,
            )
        )
    plans[-1] = dataclasses.replace(plans[-1], last=True)
    return plans


class CapsNet(nn.Module):
    """Backbone -> primary capsules -> capsule layers -> class capsules -> read-out, with the
    routing algorithm of ``cfg.router`` (capsctl/layers/routers/).

    ``forward(x)`` returns the algorithm's outputs ``[b, classes]`` (``output_kind``: logits,
    class capsule lengths or class activations). ``forward(x, trace=True)`` also returns a
    :class:`RoutingTrace` with every layer's coefficients at every iteration (all passes are
    then computed, including those that cannot reach the output). ``set_routing`` changes T or
    the schedule without touching the weights.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.arch != "capsnet":
            raise ConfigError(f"model.arch: CapsNet builds arch 'capsnet', got {cfg.arch!r}")
        try:
            self.algorithm = cfg.algorithm()
        except (ValueError, TypeError) as e:
            raise ConfigError(f"model.router: {e}") from None
        self.config = cfg
        self.iterations = self.algorithm.iterations
        self.routing = self.algorithm.schedule
        self.algorithm.check_routing(self.iterations, self.routing)
        self.output_kind = self.algorithm.output_kind
        plan = NetworkPlan(
            channels=backbone_channels(cfg.backbone, cfg.backbone_width),
            primary_types=cfg.primary_types,
            primary_dim=cfg.primary_dim,
            primary_kernel=cfg.primary_kernel,
            primary_stride=cfg.primary_stride,
            num_classes=cfg.num_classes,
            dropout=cfg.dropout,
            layer_norm=cfg.layer_norm,
            agreement_scale=cfg.agreement_scale,
            head=cfg.head,
        )
        self.backbone = build_backbone(cfg.backbone, cfg.in_channels, cfg.backbone_width)
        self.primary = self.algorithm.make_primary(plan)
        layers = layer_plans(cfg, self.algorithm.vector_poses)
        self.capsules = nn.ModuleList(self.algorithm.make_layer(p, plan) for p in layers)
        self._child_grids: list[tuple[int, int, int] | None] = []
        for item in plan_layers(cfg):
            g = item["in_grid"] if item["spec"].kind == "fc" else None  # type: ignore[attr-defined]
            self._child_grids.append((g, g, item["child_types"]) if g is not None else None)  # type: ignore[arg-type]
        self.head = self.algorithm.make_head(layers[-1].out_dim, plan)
        self._register_load_state_dict_pre_hook(_legacy_keys)

    @property
    def router(self) -> str:
        """The routing algorithm's name."""
        return self.algorithm.name

    def set_routing(self, iterations: int | None = None, mode: str | None = None) -> None:
        """Change T or the schedule without touching the weights (ValueError if the algorithm
        has no such setting)."""
        self.algorithm.check_routing(iterations, mode)
        if iterations is not None:
            self.iterations = iterations
        if mode is not None:
            self.routing = mode

    def class_capsules(self, x: Tensor, trace: RoutingTrace | None = None) -> Capsules:
        """The class capsules (poses ``[b, classes, d]``, activations ``[b, classes]`` or None)."""
        feats = self.backbone(images_channels_last(x))  # [b, C, H, W]
        if trace is not None:
            n = len(self.capsules)
            trace.kinds = [layer.kind for layer in self.capsules]
            trace.child_grids = list(self._child_grids)
            trace.coefficients = [[] for _ in range(n)]
            trace.poses = [[] for _ in range(n)]
            trace.activations = [[] for _ in range(n)]
            trace.algorithm = self.algorithm.name
        layers = list(self.capsules)
        return self.algorithm.run_features(
            self.primary, layers, feats, self.iterations, self.routing, trace
        )

    def class_poses(self, x: Tensor, trace: RoutingTrace | None = None) -> Tensor | None:
        """The class capsules' poses ``[b, classes, d]`` (None for an algorithm whose class
        capsules carry activations only, as self-routing's)."""
        return self.class_capsules(x, trace).poses

    def forward(self, x: Tensor, trace: bool = False) -> Tensor | tuple[Tensor, RoutingTrace]:
        rt = RoutingTrace() if trace else None
        out = in_float32(self.head, self.class_capsules(x, rt))  # [b, classes], float32
        if rt is not None:
            return out, rt
        return out

    @staticmethod
    def upgrade_state(state: dict[str, Any]) -> dict[str, Any]:
        """Weights of older checkpoints under today's names: EM models written before routers
        were data kept the primary activation convolution at ``primary_act``, now
        ``primary.act``."""
        old = "primary_act."
        return {
            ("primary.act." + k[len(old) :] if k.startswith(old) else k): v
            for k, v in state.items()
        }

    def parameter_counts(self) -> dict[str, int]:
        """Parameter counts of the backbone and of the capsule part."""
        backbone = sum(p.numel() for p in self.backbone.parameters())
        total = sum(p.numel() for p in self.parameters())
        return {"total": total, "backbone": backbone, "capsules": total - backbone}


def _legacy_keys(state: dict[str, Any], prefix: str, *args: Any) -> None:
    """Load-state pre-hook: :meth:`CapsNet.upgrade_state` on the keys under ``prefix``."""
    keys = [k for k in state if k.startswith(prefix)]
    renamed = CapsNet.upgrade_state({k[len(prefix) :]: state.pop(k) for k in keys})
    state.update({prefix + k: v for k, v in renamed.items()})


def architecture_summary(cfg: ModelConfig) -> str:
    """One line naming the backbone, the primary capsules, every capsule layer with its output
    grid, and the routing, e.g. ``resnet backbone, primary 32x16, conv 32x16 k3s2 -> 7x7, conv
    32x16 k3s1 -> 5x5, fc 800->10; inverted dot-product attention routing, T=2 concurrent``."""
    plan = plan_layers(cfg)
    backbone = f"{cfg.backbone} backbone"
    if cfg.backbone_width is not None:
        backbone += f" of {cfg.backbone_width} channels"
    primary = f"primary {cfg.primary_types}x{cfg.primary_dim}"
    if (cfg.primary_kernel, cfg.primary_stride) != (1, 1):
        side = primary_grid(cfg)
        primary += f" k{cfg.primary_kernel}s{cfg.primary_stride} -> {side}x{side}"
    parts = [backbone, primary]
    for item in plan:
        spec: CapsLayerSpec = item["spec"]  # type: ignore[assignment]
        if spec.kind == "conv":
            parts.append(
                f"conv {spec.types}x{spec.pose_dim} k{spec.kernel}s{spec.stride} "
                f"-> {item['out_grid']}x{item['out_grid']}"
            )
        else:
            parts.append(f"fc {item['in_types']}->{spec.types}")
    algo = cfg.algorithm()
    routing = f"T={cfg.iterations} {cfg.routing}" if algo.iterative else "one pass"
    return ", ".join(parts) + f"; {algo.title}, {routing}"


__all__ = [
    "CapsNet",
    "PerClassHead",
    "RoutingTrace",
    "architecture_summary",
    "plan_layers",
    "primary_grid",
]
