"""The routing algorithms, by name: one line per algorithm.

Adding an algorithm is one new module or package here (a subclass of
:class:`capsctl.layers.algorithm.RoutingAlgorithm`) and one entry in :data:`ROUTERS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from capsctl.layers.algorithm import RoutingAlgorithm
from capsctl.layers.routers.dynamic import DynamicRouting
from capsctl.layers.routers.em import EMRouting
from capsctl.layers.routers.idpa import InvertedDotProductAttention
from capsctl.layers.routers.selfrouting import SelfRouting

ROUTERS: dict[str, type[RoutingAlgorithm]] = {
    cls.name: cls for cls in (InvertedDotProductAttention, DynamicRouting, EMRouting, SelfRouting)
}

__all__ = ["ROUTERS", "get_router", "list_routers", "make_router"]


def list_routers() -> list[str]:
    """The names of the routing algorithms (``model.router.name``)."""
    return list(ROUTERS)


def get_router(name: str) -> type[RoutingAlgorithm]:
    """The algorithm class named ``name``; ValueError naming the known ones otherwise."""
    try:
        return ROUTERS[name]
    except KeyError:
        raise ValueError(
            f"unknown routing algorithm {name!r}; use one of {', '.join(ROUTERS)}"
        ) from None


def make_router(router: Mapping[str, Any]) -> RoutingAlgorithm:
    """The algorithm of a ``model.router`` mapping, with its parameters."""
    cls = get_router(str(router.get("name", "")))
    return cls(cls.params_from(router))
