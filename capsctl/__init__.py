"""capsctl: capsule networks with inverted dot-product attention routing."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from capsctl.version import __version__

__all__ = ["__version__", "build_model", "from_pretrained", "list_models", "load_checkpoint"]

if TYPE_CHECKING:  # pragma: no cover
    from capsctl.checkpoint import load_checkpoint
    from capsctl.config import build_model
    from capsctl.hub import from_pretrained
    from capsctl.registry import list_models


def __getattr__(name: str) -> Any:
    # torch is imported lazily so that `capsctl --help` stays fast.
    if name == "build_model":
        from capsctl import config

        return config.build_model
    if name == "list_models":
        from capsctl import registry

        return registry.list_models
    if name == "load_checkpoint":
        from capsctl import checkpoint

        return checkpoint.load_checkpoint
    if name == "from_pretrained":
        from capsctl import hub

        return hub.from_pretrained
    raise AttributeError(f"module 'capsctl' has no attribute {name!r}")
