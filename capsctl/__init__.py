"""capsctl: capsule networks with inverted dot-product attention routing."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["__version__", "build_model", "from_pretrained", "list_models", "load_checkpoint"]

if TYPE_CHECKING:  # pragma: no cover
    from capsctl.checkpoint import load_checkpoint
    from capsctl.hub import from_pretrained
    from capsctl.registry import build_model, list_models


def __getattr__(name: str) -> Any:
    # torch is imported lazily so that `capsctl --help` stays fast.
    if name in ("build_model", "list_models"):
        from capsctl import registry

        return getattr(registry, name)
    if name == "load_checkpoint":
        from capsctl import checkpoint

        return checkpoint.load_checkpoint
    if name == "from_pretrained":
        from capsctl import hub

        return hub.from_pretrained
    raise AttributeError(f"module 'capsctl' has no attribute {name!r}")
