"""The capsule layers and routing algorithms of capsctl: what code outside ``capsctl/layers/``
imports (``from capsctl.layers import ...``), as timm's ``timm/layers/__init__.py`` does.

- the routing-algorithm interface and registry: :class:`RoutingAlgorithm`, :class:`Capsules`,
  :class:`LayerPlan`, :class:`NetworkPlan`, :class:`RoutingTrace`, :data:`ROUTERS`,
  :func:`get_router`, :func:`list_routers`, :func:`make_router`;
- pose kinds (:data:`PoseKind`, :func:`pose_shape`) and the read-outs a model shares
  (:class:`PerClassHead`), the channels-last copy of a batch (:func:`images_channels_last`);
- how the vote-sized passes run: :func:`native_summary` / :func:`native_status` (the compiled
  loops), :mod:`chunks` (chunk sizes and threads), :func:`routing_flop_tally` (FLOP counts).
"""

from __future__ import annotations

from capsctl.layers import chunks
from capsctl.layers.algorithm import (
    Capsules,
    LayerPlan,
    LayerRouting,
    NetworkPlan,
    RoutingAlgorithm,
    RoutingTrace,
)
from capsctl.layers.flops import routing_flop_tally
from capsctl.layers.layout import images_channels_last
from capsctl.layers.native import native_status, native_summary
from capsctl.layers.poses import PoseKind, pose_shape
from capsctl.layers.routers import ROUTERS, get_router, list_routers, make_router
from capsctl.layers.routers.idpa import PerClassHead

__all__ = [
    "ROUTERS",
    "Capsules",
    "LayerPlan",
    "LayerRouting",
    "NetworkPlan",
    "PerClassHead",
    "PoseKind",
    "RoutingAlgorithm",
    "RoutingTrace",
    "chunks",
    "get_router",
    "images_channels_last",
    "list_routers",
    "make_router",
    "native_status",
    "native_summary",
    "pose_shape",
    "routing_flop_tally",
]
