"""The result of a routing inspection as plain dataclasses, each with ``to_dict``.

Indexing: capsule layers ``l`` are 0-based as in the model's routing trace (0 = the first
capsule layer after the primary capsules; the last one holds the class capsules). Iterations
``t`` are 1-based: ``t = 1`` is the uniform pass, ``t = T`` the last routed pass. The statistics
themselves are defined in capsctl/inspection/statistics.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

__all__ = ["ChildRoute", "ImageRouting", "IterationStats", "LayerRouting", "RoutingReport"]


@dataclass
class IterationStats:
    """Statistics of one layer at one iteration.

    ``iteration``: 1-based (1 = uniform pass). ``mean_entropy``: mean normalized entropy
    ``H(r)/log M`` of the children's coefficient vectors, in [0, 1]. ``mean_max``: mean largest
    coefficient, in [1/M, 1]. ``top_changed``: share of children whose top parent changed since
    iteration ``t - 1`` (None at ``t = 1``). ``pose_stability``: mean cosine similarity of each
    parent's pose with its pose at ``t - 1`` (None at ``t = 1``).
    """

    iteration: int
    mean_entropy: float
    mean_max: float
    top_changed: float | None
    pose_stability: float | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields."""
        return {
            "iteration": self.iteration,
            "mean_entropy": self.mean_entropy,
            "mean_max": self.mean_max,
            "top_changed": self.top_changed,
            "pose_stability": self.pose_stability,
        }


@dataclass
class LayerRouting:
    """One capsule layer: its shape, per-iteration statistics and most-receiving parents.

    ``index``: 0-based layer index (the last layer holds the class capsules). ``kind``:
    ``conv``/``fc``. ``child_types``/``parent_types``: ``n``/``m`` (for an FC layer over a grid,
    ``n`` counts flat children ``h*w*types``). ``child_grid``: ``(h, w, types)`` an FC layer's
    flat children come from, or None. ``out_grid``: ``(h, w)`` of a conv layer's parents.
    ``parents_receiving``: ``(parent type, share)`` of the top parent types at the last
    iteration, largest first, shares summing to 1 over all parent types.
    """

    index: int
    kind: str
    child_types: int
    parent_types: int
    child_grid: tuple[int, int, int] | None
    out_grid: tuple[int, int] | None
    iterations: list[IterationStats] = field(default_factory=list)
    parents_receiving: list[tuple[int, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields (tuples become lists)."""
        return {
            "index": self.index,
            "kind": self.kind,
            "child_types": self.child_types,
            "parent_types": self.parent_types,
            "child_grid": None if self.child_grid is None else list(self.child_grid),
            "out_grid": None if self.out_grid is None else list(self.out_grid),
            "iterations": [s.to_dict() for s in self.iterations],
            "parents_receiving": [[j, share] for j, share in self.parents_receiving],
        }


@dataclass
class ChildRoute:
    """A child capsule routing into a class: its type, grid position (or None) and coefficient."""

    type: int
    h: int | None
    w: int | None
    coefficient: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields."""
        return {"type": self.type, "h": self.h, "w": self.w, "coefficient": self.coefficient}


@dataclass
class ImageRouting:
    """One image: predicted class (and its softmax probability), label if known, top children.

    ``top_children``: the child capsules routing most strongly into the predicted class,
    largest coefficient first.
    """

    index: int
    predicted: int
    predicted_class: str
    probability: float
    label: int | None = None
    label_class: str | None = None
    top_children: list[ChildRoute] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields."""
        return {
            "index": self.index,
            "predicted": self.predicted,
            "predicted_class": self.predicted_class,
            "probability": self.probability,
            "label": self.label,
            "label_class": self.label_class,
            "top_children": [c.to_dict() for c in self.top_children],
        }


@dataclass
class RoutingReport:
    """Result of :func:`capsctl.inspection.trace.inspect_routing`.

    ``iterations``/``routing``: the T and schedule used. ``algorithm``: the routing
    algorithm's name, ``algorithm_title`` its title and ``coefficient_name`` what its
    coefficients are (``gating weights`` for self-routing). ``layers``: per-layer statistics.
    ``images``: per-image class routing. ``coefficients[l][t - 1]``, ``poses[l][t - 1]`` and
    ``activations[l][t - 1]`` (empty for algorithms without activations): the raw trace on the
    CPU (conv ``[b, h, w, k, l, n, m]``, FC ``[b, n, m]``; not part of :meth:`to_dict`).
    ``kinds``/``child_grids``: per layer, as in the trace. ``logits``: ``[N, classes]``.
    """

    iterations: int
    routing: str
    classes: list[str]
    layers: list[LayerRouting]
    images: list[ImageRouting]
    coefficients: list[list[Tensor]] = field(default_factory=list, repr=False)
    poses: list[list[Tensor]] = field(default_factory=list, repr=False)
    kinds: list[str] = field(default_factory=list)
    child_grids: list[tuple[int, int, int] | None] = field(default_factory=list)
    logits: Tensor | None = field(default=None, repr=False)
    algorithm: str = "idpa"
    algorithm_title: str = "inverted dot-product attention routing"
    coefficient_name: str = "routing coefficients"
    activations: list[list[Tensor]] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (lists, dicts, numbers, strings, None; no tensors)."""
        return {
            "algorithm": self.algorithm,
            "coefficients": self.coefficient_name,
            "iterations": self.iterations,
            "routing": self.routing,
            "classes": list(self.classes),
            "layers": [layer.to_dict() for layer in self.layers],
            "images": [im.to_dict() for im in self.images],
        }
