"""The routing-algorithm interface: what every routing algorithm provides to the capsule network.

A routing algorithm is one module (or package) in ``capsctl/layers/routers/`` with one subclass
of :class:`RoutingAlgorithm`, listed once in :data:`capsctl.layers.routers.ROUTERS`. The model
(:class:`capsctl.models.capsnet.CapsNet`) is the same for all of them: backbone -> the
algorithm's primary capsules -> the algorithm's capsule layers (one per entry of the config's
layer list, then the class capsules) -> the algorithm's read-out. Nothing outside the
algorithm's own module depends on which algorithm it is: losses, scores, schedules, the
inspection and the model card ask the class (:attr:`~RoutingAlgorithm.loss`,
:attr:`~RoutingAlgorithm.scores`, :attr:`~RoutingAlgorithm.schedules`,
:attr:`~RoutingAlgorithm.title`...).

A configuration names the algorithm and its parameters as data: ``model.router: {name: em,
iterations: 3, lambda_inf: 0.02}``. ``name`` picks the class; the other keys are the fields of
its :attr:`~RoutingAlgorithm.Params` dataclass (checked by capsctl.config like every other
field).

Capsules travel between layers as :class:`Capsules`: poses ``[b, h, w, n, d]`` (grid) or
``[b, n, d]`` (flat), and activations ``[b, h, w, n]`` / ``[b, n]`` for the algorithms that have
them (letters as in capsctl/layers/passes/routed.py). A capsule layer's
``forward(caps, iterations)`` returns a :class:`LayerRouting`: the parent capsules and, per
iteration, the coefficients (``[b, h, w, k, l, n, m]`` for conv layers, ``[b, n, m]`` for FC
layers; each child's coefficients over the parents of a site), the parent poses and the parent
activations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from torch import Tensor, nn


class Capsules(NamedTuple):
    """Poses ``[b, h, w, n, d]`` or ``[b, n, d]`` (None for class capsules that are their
    activations only, as self-routing's); activations ``[b, h, w, n]`` / ``[b, n]`` or None
    (algorithms without activations)."""

    poses: Tensor
    activations: Tensor | None = None


@dataclass
class LayerRouting:
    """What one capsule layer returns: the parent capsules, and per iteration ``t`` the
    coefficients used in that pass, the parent poses after it and (where the algorithm has
    them) the parent activations after it."""

    capsules: Capsules
    coefficients: list[Tensor] = field(default_factory=list)
    poses: list[Tensor] = field(default_factory=list)
    activations: list[Tensor] = field(default_factory=list)


@dataclass
class RoutingTrace:
    """Routing coefficients of every capsule layer at every iteration.

    ``coefficients[l][t]`` is layer ``l``'s (0 = first capsule layer after the primary capsules)
    coefficients at iteration ``t``: ``[b, h, w, k, l, n, m]`` for conv layers, ``[b, n, m]``
    for FC layers. ``poses[l][t]`` holds the parent poses after that pass and
    ``activations[l][t]`` the parent activations (empty lists for algorithms without them).
    ``child_grids[l]`` is the ``(h, w, n)`` grid that an FC layer's flat children come from, or
    None. ``algorithm``: the routing algorithm's name.
    """

    coefficients: list[list[Tensor]] = field(default_factory=list)
    poses: list[list[Tensor]] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    child_grids: list[tuple[int, int, int] | None] = field(default_factory=list)
    activations: list[list[Tensor]] = field(default_factory=list)
    algorithm: str = ""

    def record(self, layer: int, out: LayerRouting) -> None:
        """Store layer ``layer``'s per-iteration results (detached)."""
        self.coefficients[layer] = [c.detach() for c in out.coefficients]
        self.poses[layer] = [p.detach() for p in out.poses]
        self.activations[layer] = [a.detach() for a in out.activations]


@dataclass(frozen=True)
class LayerPlan:
    """One capsule layer to build: ``kind`` (``conv``/``fc``), child types ``in_types`` (for an
    FC layer over a grid: every capsule of the grid) of dim ``in_dim``, parent types
    ``out_types`` of dim ``out_dim``, ``pose`` kind, ``kernel``/``stride`` (conv; 1 for FC);
    ``last``: the class capsule layer."""

    kind: str
    in_types: int
    in_dim: int
    out_types: int
    out_dim: int
    pose: str
    kernel: int = 1
    stride: int = 1
    last: bool = False


@dataclass(frozen=True)
class NetworkPlan:
    """What the algorithm builds from: the backbone's channels, the primary capsules'
    ``types``, ``dim`` and convolution (``primary_kernel``, ``primary_stride``), the model
    config's generic capsule knobs and the class count."""

    channels: int
    primary_types: int
    primary_dim: int
    num_classes: int
    primary_kernel: int = 1
    primary_stride: int = 1
    dropout: float = 0.0
    layer_norm: bool = True
    agreement_scale: bool = True
    head: str = "shared"


class RoutingAlgorithm:
    """Base class of the routing algorithms (one subclass per algorithm of
    capsctl/layers/routers/).

    Class attributes every algorithm sets:

    - ``name``: its name in configs (``model.router.name``); ``title``: a short human name;
      ``reference``: the paper (authors, venue, arXiv id); ``summary``: a phrase for model
      cards ("a capsule network with <summary>"); ``coefficient_name``: what its per-child
      coefficients are called (shown by ``capsctl inspect-routing``).
    - ``Params``: a dataclass of its parameters (the keys of ``model.router`` besides
      ``name``), each with the paper's value as default; ``iterations`` among them when
      ``iterative``.
    - ``schedules``: the iteration schedules it has (``("sequential",)`` for all but inverted
      dot-product attention, which also runs all layers at once).
    - ``output_kind``: what ``model(x)`` returns: ``logits`` (cross-entropy applies),
      ``length`` (class capsule lengths in [0, 1)) or ``activation`` (class activations in
      (0, 1)); ``loss``: the loss it trains with on one-label data (``cross_entropy``,
      ``margin`` or ``spread``); ``scores``: the scores ``capsctl predict`` shows for one and
      for several labels per image (see capsctl/predict.py).
    - ``pose_kinds``: the pose kinds its layers accept (``None``: the config's as given;
      ``"vector"``: every pose is read as a vector of the same dim).
    """

    name: ClassVar[str] = ""
    title: ClassVar[str] = ""
    reference: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    coefficient_name: ClassVar[str] = "routing coefficients"
    Params: ClassVar[type] = object
    iterative: ClassVar[bool] = True
    schedules: ClassVar[tuple[str, ...]] = ("sequential",)
    output_kind: ClassVar[str] = "logits"
    loss: ClassVar[str] = "cross_entropy"
    scores: ClassVar[tuple[str, str]] = ("softmax", "sigmoid")
    vector_poses: ClassVar[bool] = False

    def __init__(self, params: Any) -> None:
        self.params = params

    @classmethod
    def params_from(cls, data: Mapping[str, Any]) -> Any:
        """The ``Params`` of a ``model.router`` mapping (``name`` dropped), range-checked by its
        ``validate(path)`` where it has one."""
        params = cls.Params(**{k: v for k, v in data.items() if k != "name"})
        check = getattr(params, "validate", None)
        if callable(check):
            check("model.router")
        iterations = getattr(params, "iterations", 1)
        if iterations < 1:
            from capsctl.errors import ConfigError

            raise ConfigError(f"model.router.iterations: must be >= 1, got {iterations}")
        return params

    @classmethod
    def resolved(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        """``model.router`` with every parameter spelled out (defaults filled in)."""
        params = cls.params_from(data)
        return {"name": cls.name, **dataclasses.asdict(params)}

    @property
    def iterations(self) -> int:
        """T of the config (1 for algorithms without iterations)."""
        return int(getattr(self.params, "iterations", 1))

    @property
    def schedule(self) -> str:
        """The config's schedule (``sequential`` for algorithms with only that one)."""
        return str(getattr(self.params, "schedule", "sequential"))

    # -- building --------------------------------------------------------------------------
    def make_primary(self, plan: NetworkPlan) -> nn.Module:
        """Module: backbone features ``[b, C, H, W]`` -> :class:`Capsules` on the grid."""
        raise NotImplementedError

    def make_layer(self, layer: LayerPlan, plan: NetworkPlan) -> nn.Module:
        """Module with ``kind``, ``out_types``, ``out_dim`` and ``forward(caps: Capsules,
        iterations: int) -> LayerRouting``."""
        raise NotImplementedError

    def make_head(self, dim: int, plan: NetworkPlan) -> nn.Module:
        """Module: class :class:`Capsules` ``[b, classes, ...]`` -> outputs ``[b, classes]``."""
        raise NotImplementedError

    # -- running ---------------------------------------------------------------------------
    def run_features(
        self,
        primary: nn.Module,
        layers: Sequence[nn.Module],
        feats: Tensor,
        iterations: int,
        schedule: str,
        trace: RoutingTrace | None,
    ) -> Capsules:
        """The class capsules from the backbone's features ``feats[b, C, H, W]``: the primary
        capsules, then :meth:`run`."""
        return self.run(layers, primary(feats), iterations, schedule, trace)

    def run(
        self,
        layers: Sequence[nn.Module],
        caps: Capsules,
        iterations: int,
        schedule: str,
        trace: RoutingTrace | None,
    ) -> Capsules:
        """Route through ``layers`` (the default: layer by layer, each running all its
        iterations before the next starts) and return the class capsules."""
        for i, layer in enumerate(layers):
            out: LayerRouting = layer(caps, iterations)
            if trace is not None:
                trace.record(i, out)
            caps = out.capsules
        return caps

    def check_routing(self, iterations: int | None, schedule: str | None) -> None:
        """ValueError unless the algorithm can run ``iterations`` with ``schedule``."""
        if iterations is not None:
            if iterations < 1:
                raise ValueError("iterations must be >= 1")
            if not self.iterative and iterations != 1:
                raise ValueError(f"{self.title} has no iterations; only 1 applies")
        if schedule is not None and schedule not in self.schedules:
            if schedule in ("concurrent", "sequential"):
                raise ValueError(
                    f"{self.title} routes layer by layer; only mode 'sequential' applies"
                )
            raise ValueError(f"unknown routing mode {schedule!r}")
