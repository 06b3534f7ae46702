"""Models given by reference: a registered name, or a mapping with ``base: <registered name>``.

A preset's ``model`` is either the name of a model in :mod:`capsctl.registry` (a string) or a
mapping of :class:`~capsctl.models.spec.ModelConfig` fields, optionally with ``base:`` naming
the registered model whose fields it overrides. This module is the one place where such
references are looked up in the registry.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from capsctl.config.convert import from_dict, type_error
from capsctl.config.schema import join_path
from capsctl.errors import ConfigError, some_names
from capsctl.models.spec import ModelConfig
from capsctl.registry import get_config, list_models

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

__all__ = [
    "build_model",
    "expand_model",
    "model_from_mapping",
    "registered_model",
    "resolve_config",
]


def registered_model(name: Any, path: str) -> dict[str, Any]:
    """The registered configuration ``name`` as a plain mapping; ``path`` names it in errors."""
    if not isinstance(name, str):
        raise type_error(path, "a registered model name", name)
    known = list_models()
    if name not in known:
        listing = some_names(known, name, "capsctl models") if known else "(none found)"
        raise ConfigError(f"{path}: unknown model {name!r}; registered models: {listing}")
    return dataclasses.asdict(get_config(name))


def expand_model(value: Any, path: str) -> Any:
    """Turn ``name`` or ``{base: name, ...}`` into a full mapping; leave other values as is."""
    if isinstance(value, str):
        return registered_model(value, path)
    if isinstance(value, Mapping) and "base" in value:
        merged = registered_model(value["base"], join_path(path, "base"))
        merged.update({k: v for k, v in value.items() if k != "base"})
        return merged
    return value


def model_from_mapping(data: Mapping[str, Any], path: str = "model") -> ModelConfig:
    """A validated :class:`ModelConfig` from a mapping, which may carry ``base: <name>``."""
    if not isinstance(data, Mapping):
        raise type_error(path, "a mapping", data)
    return from_dict(ModelConfig, expand_model(dict(data), path), path)


def resolve_config(
    spec: str | ModelConfig | Mapping[str, Any], num_classes: int | None = None
) -> ModelConfig:
    """A name, a config or a mapping (validated; may hold ``base: <name>``) -> ModelConfig.

    ``num_classes`` replaces the configuration's number of classes when given.
    """
    if isinstance(spec, ModelConfig):
        cfg = copy.deepcopy(spec)
    elif isinstance(spec, str):
        cfg = get_config(spec)
    else:
        cfg = model_from_mapping(dict(spec), path="model")
    if num_classes is not None:
        cfg = cfg.replace(num_classes=num_classes)
    return cfg


def build_model(
    name_or_config: str | ModelConfig | Mapping[str, Any], num_classes: int | None = None
) -> nn.Module:
    """Build a randomly initialized model from a registered name, a config or a mapping.

    >>> model = build_model("cifar10-caps")          # doctest: +SKIP
    >>> model = build_model("resnet18", num_classes=100)  # doctest: +SKIP
    >>> model = build_model({"base": "cifar10-caps-simple", "input_size": 64})  # doctest: +SKIP
    """
    from capsctl.models import build_model_from_config  # torch: imported on first use

    return build_model_from_config(resolve_config(name_or_config, num_classes))
