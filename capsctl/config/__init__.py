"""Presets: YAML files describing a model, its data and its training, parsed into dataclasses.

A preset file has the top-level keys ``name``, ``description``, ``model``, ``data``, ``train``
and ``log``. ``model`` is either a registered model name (a string) or a mapping of
:class:`~capsctl.models.spec.ModelConfig` fields, optionally with ``base: <registered name>``
whose fields it overrides. Every value is checked strictly: unknown keys, wrong types and
out-of-range values raise :class:`~capsctl.errors.ConfigError` naming the dotted path of the
field (``train.lr``, ``model.layers[1].kernel``). Command-line overrides (``train.lr=0.05``)
are applied to the raw mapping before validation, so their errors name the same paths.

One module per concern:

- :mod:`.schema`: the dataclasses (:class:`Preset`, :class:`DataConfig`, ...) and their range
  checks;
- :mod:`.convert`: :func:`from_dict`, the strict converter from plain data to dataclasses;
- :mod:`.yaml_io`: safe YAML reading and writing (YAML 1.2 floats, no duplicate keys);
- :mod:`.overrides`: :func:`apply_overrides` (``dotted.path=value``);
- :mod:`.model_refs`: models given by registered name or ``base:``, looked up in
  :mod:`capsctl.registry`; :func:`build_model`;
- :mod:`.presets`: finding, loading and dumping preset files.
"""

from __future__ import annotations

from capsctl.config.convert import from_dict
from capsctl.config.model_refs import build_model, model_from_mapping, resolve_config
from capsctl.config.overrides import apply_overrides
from capsctl.config.presets import (
    dump_yaml,
    list_presets,
    load_preset,
    preset_dirs,
    preset_from_dict,
    preset_from_yaml,
    preset_to_dict,
)
from capsctl.config.schema import AugmentConfig, DataConfig, LogConfig, Preset, TrainConfig

__all__ = [
    "AugmentConfig",
    "DataConfig",
    "LogConfig",
    "Preset",
    "TrainConfig",
    "apply_overrides",
    "build_model",
    "dump_yaml",
    "from_dict",
    "list_presets",
    "load_preset",
    "model_from_mapping",
    "preset_dirs",
    "preset_from_dict",
    "preset_from_yaml",
    "preset_to_dict",
    "resolve_config",
]
