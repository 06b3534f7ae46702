"""Routing inspection of capsule networks: statistics, raw coefficients and pictures.

:func:`inspect_checkpoint` is the library call of ``capsctl inspect-routing``; the pieces:

* capsctl/inspection/report.py: the result dataclasses (:class:`RoutingReport` and its parts);
* capsctl/inspection/statistics.py: the statistics from a routing trace, their definitions,
  and the spatial map of the routing into the predicted class;
* capsctl/inspection/trace.py: :func:`inspect_routing`, one traced pass of a model;
* capsctl/inspection/images.py: which images to look at;
* capsctl/inspection/dump.py: raw coefficients as safetensors;
* capsctl/inspection/pictures.py: PNG heatmaps and overlays (matplotlib, lazily);
* capsctl/inspection/api.py: :func:`inspect_checkpoint` and :class:`InspectionResult`.
"""

from capsctl.inspection.api import InspectionResult, inspect_checkpoint
from capsctl.inspection.dump import dump_coefficients
from capsctl.inspection.images import parse_indices, select_images
from capsctl.inspection.pictures import write_pngs
from capsctl.inspection.report import (
    ChildRoute,
    ImageRouting,
    IterationStats,
    LayerRouting,
    RoutingReport,
)
from capsctl.inspection.statistics import class_flow, normalized_entropy, spatial_map
from capsctl.inspection.trace import inspect_routing

__all__ = [
    "ChildRoute",
    "ImageRouting",
    "InspectionResult",
    "IterationStats",
    "LayerRouting",
    "RoutingReport",
    "class_flow",
    "dump_coefficients",
    "inspect_checkpoint",
    "inspect_routing",
    "normalized_entropy",
    "parse_indices",
    "select_images",
    "spatial_map",
    "write_pngs",
]
