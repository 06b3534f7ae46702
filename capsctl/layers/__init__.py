"""The capsule layers and routing algorithms of capsctl: what code outside ``capsctl/layers/``
imports (``from capsctl.layers import ...``, or the registry from ``capsctl.layers.routers``),
as timm's ``timm/layers/__init__.py`` is for timm.

Inside, three floors (dependencies point down, checked by tests/test_house.py):

- ``routers/``: what each routing algorithm is, as readable torch code, one module or package
  per algorithm (its parameters, primary capsules, capsule layers, procedure, read-out), listed
  once in :data:`ROUTERS`; the capsule layers they share are the modules of this folder
  (algorithm.py: the interface; capsules.py, baseline_capsules.py, poses.py);
- ``passes/``: the vote-sized passes (routed, weighted, gated, EM's moments and quadratic form,
  the poses' LayerNorm, layout copies): equations, reference, dense and chunked versions;
- ``backend/``: how a pass runs: :mod:`dispatch` (the one switch), the compiled library and its
  C++ sources, chunk sizes and threads.

Exported here: the routing-algorithm interface and registry, the capsule layers, pose kinds, the
read-outs a model shares (:class:`PerClassHead`), the channels-last copy of a batch
(:func:`images_channels_last`), :mod:`dispatch` (``dispatch.use("dense")`` for export),
:func:`native_status` / :func:`native_summary` (the compiled loops), :mod:`chunks` (chunk sizes
and threads), :func:`routing_flop_tally` (FLOP counts), and the vote-sized passes on the
backend dispatch chooses (:func:`routed_pass`, :func:`weighted_pass`, :func:`gated_pass`,
:func:`vote_moments`, :func:`vote_quad`) and the steps around them that are kernels of their
own on a GPU (dynamic routing's :func:`squash`, EM's :func:`e_step` over a conv layer's
:class:`WindowGrid`, a whole :func:`em_routing_chunked`, a conv layer's :func:`window_copy`).
"""

from __future__ import annotations

from capsctl.layers.algorithm import (
    Capsules,
    LayerPlan,
    LayerRouting,
    NetworkPlan,
    RoutingAlgorithm,
    RoutingTrace,
)
from capsctl.layers.backend import chunks, dispatch
from capsctl.layers.backend.native import native_status, native_summary
from capsctl.layers.backend.triton import aot as gpu_aot
from capsctl.layers.baseline_capsules import BaselineCapsules
from capsctl.layers.capsules import CapsuleLayer, ConvCapsules, FCCapsules
from capsctl.layers.passes.em_moments import vote_moments, vote_quad
from capsctl.layers.passes.flops import routing_flop_tally
from capsctl.layers.passes.gated import gated_pass
from capsctl.layers.passes.layout import images_channels_last, window_copy
from capsctl.layers.passes.routed import routed_pass
from capsctl.layers.passes.weighted import weighted_pass
from capsctl.layers.poses import PoseKind, pose_shape
from capsctl.layers.primary import PrimaryCapsules, PrimaryCapsulesWithActivations
from capsctl.layers.routers import ROUTERS, get_router, list_routers, make_router
from capsctl.layers.routers.dynamic import squash
from capsctl.layers.routers.em.procedure import em_routing_chunked
from capsctl.layers.routers.em.windows import WindowGrid, e_step
from capsctl.layers.routers.idpa import PerClassHead

__all__ = [
    "ROUTERS",
    "BaselineCapsules",
    "CapsuleLayer",
    "Capsules",
    "ConvCapsules",
    "FCCapsules",
    "LayerPlan",
    "LayerRouting",
    "NetworkPlan",
    "PerClassHead",
    "PoseKind",
    "PrimaryCapsules",
    "PrimaryCapsulesWithActivations",
    "RoutingAlgorithm",
    "RoutingTrace",
    "WindowGrid",
    "chunks",
    "dispatch",
    "e_step",
    "em_routing_chunked",
    "get_router",
    "gated_pass",
    "gpu_aot",
    "images_channels_last",
    "list_routers",
    "make_router",
    "native_status",
    "native_summary",
    "pose_shape",
    "routed_pass",
    "routing_flop_tally",
    "squash",
    "vote_moments",
    "vote_quad",
    "weighted_pass",
    "window_copy",
]
