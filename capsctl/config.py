"""Presets: YAML files describing a model, its data and its training, parsed into dataclasses.

A preset file has the top-level keys ``name``, ``description``, ``model``, ``data`` and
``train``. ``model`` is either a registered model name (a string) or a mapping of
:class:`~capsctl.models.spec.ModelConfig` fields, optionally with ``base: <registered name>``
whose fields it overrides. Every value is checked strictly by :func:`from_dict`: unknown keys,
wrong types and out-of-range values raise :class:`~capsctl.errors.ConfigError` naming the
dotted path of the field (``train.lr``, ``model.layers[1].kernel``).

Command-line overrides (``train.lr=0.05``, ``model.layers[0].kernel=5``) are applied to the raw
mapping before validation (:func:`apply_overrides`), so their errors name the same paths.

YAML is read with a subclass of ``yaml.SafeLoader`` (never an unsafe loader) that additionally
reads ``1e-3`` as a float (plain PyYAML reads it as a string) and rejects duplicate keys.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import importlib
import inspect
import math
import os
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, Union

import yaml

from capsctl.errors import CapsctlError, ConfigError
from capsctl.models.spec import CapsLayerSpec, ModelConfig

__all__ = [
    "AugmentConfig",
    "DataConfig",
    "Preset",
    "TrainConfig",
    "apply_overrides",
    "dump_yaml",
    "from_dict",
    "list_presets",
    "load_preset",
    "model_from_mapping",
    "preset_dirs",
    "preset_from_dict",
    "preset_from_yaml",
    "preset_to_dict",
]

T = TypeVar("T")

#: Turns a registered model name into its configuration; raises ``KeyError`` when unknown.
ModelResolver = Callable[[str], ModelConfig]


# --------------------------------------------------------------------------------------------
# Dataclasses
# --------------------------------------------------------------------------------------------


def _check(ok: bool, path: str, message: str) -> None:
    """Raise a :class:`ConfigError` ``"<path>: <message>"`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{path}: {message}")


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _is_square(n: int) -> bool:
    return n >= 1 and math.isqrt(n) ** 2 == n


@dataclass
class AugmentConfig:
    """Training-time augmentation: random crop with ``crop_padding`` pixels, horizontal flips."""

    crop_padding: int = 4
    hflip: bool = True

    def validate(self, path: str) -> None:
        """Check value ranges; ``path`` is this object's dotted path."""
        _check(
            self.crop_padding >= 0,
            _join(path, "crop_padding"),
            f"must be >= 0 (0 disables cropping), got {self.crop_padding}",
        )


@dataclass
class DataConfig:
    """Which data set to use and how to prepare it.

    ``dataset``: ``cifar10``, ``cifar100``, ``mnist``, ``fashion-mnist``,
    ``fashion-mnist-quickstart`` or ``imagefolder:<path>``. ``test_file`` picks one test file
    in npz folders holding several. ``val_size`` images are held out from the training set
    (seeded); 0 means no validation split. ``normalization`` names an entry of
    ``capsctl.data.NORMALIZATION`` (or a dataset, standing for its normalization). Names are
    checked against ``capsctl.data.catalog``.
    """

    dataset: str = "cifar10"
    data_dir: str | None = None
    test_file: str | None = None
    val_size: int = 5000
    normalization: str = "cifar10"
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    download: bool = True

    def validate(self, path: str) -> None:
        """Check value ranges; ``path`` is this object's dotted path."""
        _check(bool(self.dataset.strip()), _join(path, "dataset"), "must not be empty")
        if self.dataset.startswith("imagefolder:"):
            _check(
                bool(self.dataset[len("imagefolder:") :].strip()),
                _join(path, "dataset"),
                "imagefolder needs a folder, e.g. imagefolder:/data/images",
            )
        _check(
            self.val_size >= 0,
            _join(path, "val_size"),
            f"must be >= 0 (0 = no validation split), got {self.val_size}",
        )
        catalog = _catalog()
        if catalog is None:
            return
        try:
            catalog.dataset_info(self.dataset)
        except CapsctlError as e:
            raise ConfigError(f"{_join(path, 'dataset')}: {e}") from None
        if self.normalization not in catalog.NORMALIZATION:
            try:  # a dataset name stands for that dataset's normalization
                catalog.dataset_info(self.normalization)
            except CapsctlError:
                raise ConfigError(
                    f"{_join(path, 'normalization')}: unknown normalization "
                    f"{self.normalization!r}; expected one of {', '.join(catalog.NORMALIZATION)} "
                    "or a dataset name"
                ) from None


def _catalog() -> Any:
    """``capsctl.data.catalog`` (dataset names, normalizations), or None if unavailable."""
    try:
        catalog = importlib.import_module("capsctl.data.catalog")
    except ImportError:  # pragma: no cover - the package ships it
        return None
    if hasattr(catalog, "dataset_info") and hasattr(catalog, "NORMALIZATION"):
        return catalog
    return None  # pragma: no cover


@dataclass
class TrainConfig:
    """Optimisation settings. The defaults are the CIFAR recipe of the capsule-network paper.

    ``time_limit`` (seconds) stops training after the epoch that crosses it;
    ``steps_per_epoch`` caps the batches per epoch (smoke tests, quick runs).
    """

    # Keys that older versions wrote and that are ignored when read: ``workers`` never had an
    # effect (batches are gathered and augmented on the device inside the training process).
    RETIRED_FIELDS: ClassVar[tuple[str, ...]] = ("workers",)

    epochs: int = 350
    batch_size: int = 128
    eval_batch_size: int = 100
    optimizer: Literal["sgd", "adamw"] = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-4
    schedule: Literal["multistep", "cosine", "onecycle", "constant"] = "multistep"
    milestones: list[int] = field(default_factory=lambda: [150, 250])
    gamma: float = 0.1
    warmup_epochs: float = 0.0
    label_smoothing: float = 0.0
    loss: Literal["auto", "cross_entropy", "bce", "margin", "spread"] = "auto"
    grad_clip: float | None = None
    ema_decay: float | None = None
    amp: bool = False
    channels_last: bool = False
    compile: bool = False
    seed: int = 0
    deterministic: bool = False
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    sync_bn: bool = False
    time_limit: float | None = None
    steps_per_epoch: int | None = None

    def validate(self, path: str) -> None:
        """Check value ranges; ``path`` is this object's dotted path."""

        def at(name: str) -> str:
            return _join(path, name)

        _check(self.epochs >= 1, at("epochs"), f"must be >= 1, got {self.epochs}")
        _check(self.batch_size >= 1, at("batch_size"), f"must be >= 1, got {self.batch_size}")
        _check(
            self.eval_batch_size >= 1,
            at("eval_batch_size"),
            f"must be >= 1, got {self.eval_batch_size}",
        )
        _check(self.lr > 0, at("lr"), f"must be > 0, got {self.lr}")
        _check(0 <= self.momentum < 1, at("momentum"), f"must be in [0, 1), got {self.momentum}")
        _check(self.weight_decay >= 0, at("weight_decay"), f"must be >= 0, got {self.weight_decay}")
        for i, milestone in enumerate(self.milestones):
            _check(milestone >= 1, f"{at('milestones')}[{i}]", f"must be >= 1, got {milestone}")
        for i in range(1, len(self.milestones)):
            _check(
                self.milestones[i] > self.milestones[i - 1],
                at("milestones"),
                f"must be strictly increasing, got {self.milestones}",
            )
        _check(self.gamma > 0, at("gamma"), f"must be > 0, got {self.gamma}")
        _check(
            self.warmup_epochs >= 0,
            at("warmup_epochs"),
            f"must be >= 0, got {self.warmup_epochs}",
        )
        _check(
            0 <= self.label_smoothing < 1,
            at("label_smoothing"),
            f"must be in [0, 1), got {self.label_smoothing}",
        )
        if self.grad_clip is not None:
            _check(
                self.grad_clip > 0,
                at("grad_clip"),
                f"must be > 0 (null disables clipping), got {self.grad_clip}",
            )
        if self.ema_decay is not None:
            _check(
                0 < self.ema_decay < 1,
                at("ema_decay"),
                f"must be in (0, 1) (null disables EMA), got {self.ema_decay}",
            )
        _check(0 <= self.seed < 2**32, at("seed"), f"must be in [0, 2**32), got {self.seed}")
        if self.time_limit is not None:
            _check(
                self.time_limit > 0,
                at("time_limit"),
                f"must be > 0 seconds (null = no limit), got {self.time_limit}",
            )
        if self.steps_per_epoch is not None:
            _check(
                self.steps_per_epoch >= 1,
                at("steps_per_epoch"),
                f"must be >= 1 (null = whole epochs), got {self.steps_per_epoch}",
            )


@dataclass
class LogConfig:
    """What a run records besides its run folder's own files.

    ``tensorboard``: also write the per-epoch scalars as TensorBoard event files into the run
    folder (needs ``pip install 'capsctl[tensorboard]'``). ``curves``: draw ``curves.png`` into
    the run folder at the end (skipped without matplotlib).
    """

    tensorboard: bool = False
    curves: bool = True


@dataclass
class Preset:
    """A complete, validated experiment description."""

    name: str = ""
    description: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)


def _validate_layer(spec: CapsLayerSpec, path: str) -> None:
    for name in ("types", "pose_dim", "kernel", "stride"):
        value = getattr(spec, name)
        _check(value >= 1, _join(path, name), f"must be >= 1, got {value}")
    if spec.pose == "matrix":
        _check(
            _is_square(spec.pose_dim),
            _join(path, "pose_dim"),
            f"must be a perfect square (4, 9, 16, ...) for matrix poses, got {spec.pose_dim}; "
            "change it or use pose: vector",
        )


def _validate_model(cfg: ModelConfig, path: str) -> None:
    for name in ("num_classes", "in_channels", "input_size", "primary_types", "primary_dim"):
        value = getattr(cfg, name)
        _check(value >= 1, _join(path, name), f"must be >= 1, got {value}")
    _check(cfg.iterations >= 1, _join(path, "iterations"), f"must be >= 1, got {cfg.iterations}")
    _check(0 <= cfg.dropout < 1, _join(path, "dropout"), f"must be in [0, 1), got {cfg.dropout}")
    if cfg.class_pose_dim is not None:
        _check(
            cfg.class_pose_dim >= 1,
            _join(path, "class_pose_dim"),
            f"must be >= 1 (null = the last layer's pose_dim), got {cfg.class_pose_dim}",
        )
        if cfg.class_pose == "matrix":
            _check(
                _is_square(cfg.class_pose_dim),
                _join(path, "class_pose_dim"),
                "must be a perfect square (4, 9, 16, ...) for matrix poses, "
                f"got {cfg.class_pose_dim}; change it or use class_pose: vector",
            )


#: Range checks for dataclasses defined elsewhere (called as ``check(obj, path)``). Our own
#: dataclasses define a ``validate(self, path)`` method instead; both are honoured.
VALIDATORS: dict[type, Callable[[Any, str], None]] = {
    CapsLayerSpec: _validate_layer,
    ModelConfig: _validate_model,
}


# --------------------------------------------------------------------------------------------
# Strict conversion of plain data into dataclasses
# --------------------------------------------------------------------------------------------


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _show(value: Any) -> str:
    """A short one-line rendering of a value for error messages (YAML spelling of scalars)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return "a mapping"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _describe(tp: Any) -> str:
    """Human description of an annotation: ``a number``, ``one of 'sgd', 'adamw'``..."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is Union or origin is types.UnionType:
        args = typing.get_args(tp)
        parts = [_describe(a) for a in args if a is not type(None)]
        text = " or ".join(parts)
        return f"{text} or null" if type(None) in args else text
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return "a list" if item is Any else f"a list of {_plural(item)}"
    if origin is dict or tp is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
    }.get(tp, getattr(tp, "__name__", str(tp)))


def _plural(tp: Any) -> str:
    return {bool: "booleans", int: "integers", float: "numbers", str: "strings"}.get(
        tp, "mappings" if dataclasses.is_dataclass(tp) else _describe(tp)
    )


def _type_error(path: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(f"{path}: expected {expected}, got {_show(value)}")


def _convert(tp: Any, value: Any, path: str, expected: str | None = None) -> Any:
    """Convert ``value`` to annotation ``tp``; ``expected`` overrides the type description."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin is Union or origin is types.UnionType:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        candidates = [a for a in args if a is not type(None)]
        if len(candidates) == 1:
            return _convert(candidates[0], value, path, expected or _describe(tp))
        for candidate in candidates:
            try:
                return _convert(candidate, value, path)
            except ConfigError:
                continue
        raise _type_error(path, expected or _describe(tp), value)
    if origin is Literal:
        for allowed in typing.get_args(tp):
            if type(value) is type(allowed) and value == allowed:
                return value
        raise _type_error(path, expected or _describe(tp), value)
    if origin is list or tp is list:
        if not isinstance(value, (list, tuple)):
            raise _type_error(path, expected or _describe(tp), value)
        (item,) = typing.get_args(tp) or (Any,)
        return [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise _type_error(path, expected or _describe(tp), value)
        key_tp, value_tp = typing.get_args(tp) or (Any, Any)
        return {
            _convert(key_tp, k, path): _convert(value_tp, v, _join(path, str(k)))
            for k, v in value.items()
        }
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise _type_error(path, expected or "a mapping", value)
        return from_dict(tp, value, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(path, expected or "true or false", value)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _type_error(path, expected or "an integer", value)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:
                raise ConfigError(f"{path}: {_show(value)} is too large for a number") from None
            if isinstance(value, int) and number != value:
                raise ConfigError(
                    f"{path}: {_show(value)} cannot be represented exactly as a number; "
                    "use a smaller value"
                )
            if not math.isfinite(number):
                raise ConfigError(f"{path}: expected a finite number, got {_show(value)}")
            return number
        raise _type_error(path, expected or "a number", value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _type_error(path, expected or "a string", value)
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise _type_error(path, expected or _describe(tp), value)
    raise TypeError(f"from_dict does not support the annotation {tp!r} (at {path})")


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Build dataclass ``cls`` from plain data (a mapping), strictly.

    Unknown keys, wrong types and out-of-range values raise :class:`ConfigError` naming the
    dotted path (``path`` is the path of ``data`` itself, ``""`` at the top level). Missing
    fields take their defaults. Range checks come from ``cls.validate(self, path)`` when the
    class defines it, and from :data:`VALIDATORS`.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"from_dict needs a dataclass, got {cls!r}")
    if not isinstance(data, Mapping):
        raise _type_error(path or "top level", "a mapping", data)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    retired = getattr(cls, "RETIRED_FIELDS", ())
    data = {k: v for k, v in data.items() if k not in retired}
    for key in data:
        if not isinstance(key, str) or key not in fields:
            near = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ConfigError(
                f"{_join(path, str(key))}: unknown field; expected one of {', '.join(fields)}{hint}"
            )
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], _join(path, name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{_join(path, name)}: missing required field; add it")
    obj = cls(**kwargs)
    check = VALIDATORS.get(cls)
    if check is not None:
        check(obj, path)
    hook = getattr(obj, "validate", None)
    if callable(hook):
        if len(inspect.signature(hook).parameters) >= 1:
            hook(path)
        else:
            hook()
    return obj


# --------------------------------------------------------------------------------------------
# YAML
# --------------------------------------------------------------------------------------------

# YAML 1.2 style floats without a dot, such as 1e-3 or 5E+4, which YAML 1.1 reads as strings.
_EXP_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that reads ``1e-3`` as a float and rejects duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[str] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key_node.value!r}", key_node.start_mark
                    )
                seen.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


class _Dumper(yaml.SafeDumper):
    """``yaml.SafeDumper`` that quotes strings which :class:`_Loader` would read as floats."""


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _EXP_FLOAT, list("-+0123456789"))


def _yaml_load(text: str) -> Any:
    """Parse YAML safely (no arbitrary objects); see :class:`_Loader`."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader


def _yaml_problem(error: yaml.YAMLError) -> str:
    problem = getattr(error, "problem", None) or str(error)
    return " ".join(str(problem).split())


def _parse_yaml_text(text: str, source: str) -> dict[str, Any]:
    try:
        raw = _yaml_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        column = f", column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(
            f"{where}: invalid YAML ({_yaml_problem(e)}{column}); fix the syntax"
        ) from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{source}: expected a mapping of preset fields (name, description, model, data, "
            f"train) at the top level, got {_show(raw)}"
        )
    return raw


def _read_yaml_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file; pass a YAML preset") from None
    except OSError as e:
        raise ConfigError(f"cannot read preset {path}: {e.strerror or e}") from None
    return _parse_yaml_text(text, str(path))


# --------------------------------------------------------------------------------------------
# Model references
# --------------------------------------------------------------------------------------------


def _registry_resolver(name: str) -> ModelConfig:
    registry = importlib.import_module("capsctl.registry")
    return registry.get_config(name)


def _registry_names() -> list[str]:
    """Registered model names, best effort (empty when the registry cannot tell)."""
    try:
        registry = importlib.import_module("capsctl.registry")
        items = list(registry.list_models())
    except Exception:  # noqa: BLE001 - only used to enrich an error message
        return []
    names = []
    for item in items:
        if isinstance(item, str):
            names.append(item)
        elif isinstance(item, (tuple, list)) and item and isinstance(item[0], str):
            names.append(item[0])
        elif isinstance(getattr(item, "name", None), str):
            names.append(item.name)
    return names


def _resolve_model(
    name: Any, resolve_model: ModelResolver | Mapping[str, ModelConfig] | None, path: str
) -> dict[str, Any]:
    """The registered configuration ``name`` as a plain mapping."""
    if not isinstance(name, str):
        raise _type_error(path, "a registered model name", name)
    if isinstance(resolve_model, Mapping):
        known = [str(k) for k in resolve_model]
        cfg = resolve_model.get(name)
    else:
        resolver = resolve_model or _registry_resolver
        try:
            cfg = resolver(name)
        except LookupError:
            cfg = None
        except CapsctlError as e:
            raise ConfigError(f"{path}: {e}") from None
        known = _registry_names() if resolve_model is None else []
    if cfg is None:
        listing = ", ".join(sorted(known)) if known else "(none found)"
        raise ConfigError(f"{path}: unknown model {name!r}; known models: {listing}")
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return dataclasses.asdict(cfg)
    if isinstance(cfg, Mapping):
        return copy.deepcopy(dict(cfg))
    raise TypeError(f"model resolver returned {type(cfg).__name__} for {name!r}")


def _expand_model(
    value: Any, resolve_model: ModelResolver | Mapping[str, ModelConfig] | None, path: str
) -> Any:
    """Turn ``name`` or ``{base: name, ...}`` into a full mapping; leave other values as is."""
    if isinstance(value, str):
        return _resolve_model(value, resolve_model, path)
    if isinstance(value, Mapping) and "base" in value:
        merged = _resolve_model(value["base"], resolve_model, _join(path, "base"))
        merged.update({k: v for k, v in value.items() if k != "base"})
        return merged
    return value


def model_from_mapping(
    data: Mapping[str, Any],
    path: str = "model",
    *,
    resolve_model: ModelResolver | Mapping[str, ModelConfig] | None = None,
) -> ModelConfig:
    """A validated :class:`ModelConfig` from a mapping, which may carry ``base: <name>``."""
    if not isinstance(data, Mapping):
        raise _type_error(path, "a mapping", data)
    return from_dict(ModelConfig, _expand_model(dict(data), resolve_model, path), path)


# --------------------------------------------------------------------------------------------
# Overrides
# --------------------------------------------------------------------------------------------

_NAME = r"[A-Za-z_][A-Za-z0-9_-]*"
_KEY = re.compile(rf"^{_NAME}(?:\[\d+\])*(?:\.{_NAME}(?:\[\d+\])*)*$")
_TOKEN = re.compile(rf"({_NAME})|\[(\d+)\]")


def _parse_key(key: str) -> list[str | int]:
    return [m.group(1) if m.group(1) is not None else int(m.group(2)) for m in _TOKEN.finditer(key)]


def _render(tokens: Sequence[str | int]) -> str:
    text = ""
    for token in tokens:
        text = f"{text}[{token}]" if isinstance(token, int) else _join(text, token)
    return text


def apply_overrides(
    raw: Mapping[str, Any],
    overrides: Sequence[str],
    *,
    resolve_model: ModelResolver | Mapping[str, ModelConfig] | None = None,
) -> dict[str, Any]:
    """Return a copy of the raw preset mapping with ``dotted.path=value`` overrides applied.

    Values are parsed as YAML (``train.lr=0.05``, ``train.milestones=[10,20]``,
    ``data.test_file=null``); list items are addressed as ``model.layers[0].kernel``. Missing
    intermediate mappings are created. When an override reaches into a model given by name
    (``model: capsnet`` or ``model: {base: capsnet}``), the registered configuration is expanded
    into a mapping first (via ``resolve_model``, default: ``capsctl.registry.get_config``).
    The result is not validated; :func:`preset_from_dict` does that.
    """
    if isinstance(overrides, str):
        overrides = [overrides]
    result: dict[str, Any] = copy.deepcopy(dict(raw))
    for override in overrides:
        if not isinstance(override, str) or "=" not in override:
            raise ConfigError(
                f"override {override!r}: expected dotted.path=value, e.g. train.lr=0.05"
            )
        key, text = override.split("=", 1)
        key = key.strip()
        if not _KEY.match(key):
            raise ConfigError(
                f"override {override!r}: {key!r} is not a dotted path; expected names joined by "
                "dots with optional [index], e.g. model.layers[0].kernel=5"
            )
        try:
            value = _yaml_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(
                f"override {override!r}: the value is not valid YAML ({_yaml_problem(e)}); "
                "quote it or fix it"
            ) from None
        _set_path(result, _parse_key(key), value, override, resolve_model)
    return result


def _set_path(
    root: dict[str, Any],
    tokens: list[str | int],
    value: Any,
    override: str,
    resolve_model: ModelResolver | Mapping[str, ModelConfig] | None,
) -> None:
    if tokens[0] == "model" and len(tokens) > 1:
        model = root.get("model")
        if isinstance(model, str):
            model = root["model"] = {"base": model}
        if (
            isinstance(model, dict)
            and "base" in model
            and len(tokens) > 2
            and tokens[1] != "base"
            and tokens[1] not in model
        ):
            root["model"] = _expand_model(model, resolve_model, "model")
    node: Any = root
    for i, token in enumerate(tokens):
        last = i == len(tokens) - 1
        where = _render(tokens[:i]) or "the preset"
        if isinstance(token, str):
            if not isinstance(node, dict):
                raise ConfigError(
                    f"override {override!r}: {where} is not a mapping (it is {_show(node)}); "
                    f"cannot set {_render(tokens[: i + 1])}"
                )
            if last:
                node[token] = value
            else:
                if token not in node or node[token] is None:
                    if isinstance(tokens[i + 1], int):
                        raise ConfigError(
                            f"override {override!r}: {_render(tokens[: i + 1])} is not a list; "
                            "set the whole list instead, e.g. key=[...]"
                        )
                    node[token] = {}
                node = node[token]
        else:
            if not isinstance(node, list):
                raise ConfigError(
                    f"override {override!r}: {where} is not a list (it is {_show(node)})"
                )
            if not 0 <= token < len(node):
                raise ConfigError(
                    f"override {override!r}: index {token} is out of range ({where} has "
                    f"{len(node)} items)"
                )
            if last:
                node[token] = value
            else:
                node = node[token]


# --------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------


def preset_dirs() -> list[Path]:
    """Folders searched for presets, in order; only those that exist.

    The bundled ``capsctl/presets/`` (inside an installed wheel) and the source checkout's
    top-level ``presets/`` (editable installs). A name found in several is taken from the first.
    """
    package = Path(__file__).resolve().parent
    candidates = [package / "presets"]
    if package.parent.name not in ("site-packages", "dist-packages"):
        candidates.append(package.parent / "presets")
    return [d for d in candidates if d.is_dir()]


def _preset_files() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder in preset_dirs():
        for file in sorted(folder.iterdir()):
            if file.suffix in (".yaml", ".yml") and file.is_file():
                found.setdefault(file.stem, file)
    return dict(sorted(found.items()))


def list_presets() -> list[tuple[str, str]]:
    """``(name, description)`` of every preset in :func:`preset_dirs`, sorted by name.

    A preset that cannot be read is listed with its error as the description.
    """
    result = []
    for name, file in _preset_files().items():
        try:
            description = _read_yaml_file(file).get("description", "")
        except ConfigError as e:
            description = f"(invalid: {e})"
        result.append((name, description if isinstance(description, str) else ""))
    return result


def _find_preset(name_or_path: str | os.PathLike[str]) -> Path:
    name_or_path = os.fspath(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.suffix in (".yaml", ".yml") or "/" in name_or_path or "\\" in name_or_path:
        if not path.is_file():
            raise ConfigError(
                f"preset file {name_or_path} does not exist; pass a preset name or the path "
                "of a .yaml file"
            )
        return path
    files = _preset_files()
    if name_or_path in files:
        return files[name_or_path]
    near = difflib.get_close_matches(name_or_path, list(files), n=1)
    hint = f" (did you mean {near[0]}?)" if near else ""
    known = ", ".join(files) if files else "(none found)"
    raise ConfigError(
        f"unknown preset {name_or_path!r}{hint}; known presets: {known}; "
        "or pass the path of a .yaml file"
    )


def load_preset(
    name_or_path: str | os.PathLike[str],
    overrides: Sequence[str] = (),
    *,
    resolve_model: ModelResolver | Mapping[str, ModelConfig] | None = None,
) -> Preset:
    """Load a preset by name (see :func:`preset_dirs`) or from a ``.yaml`` path.

    ``overrides`` are ``dotted.path=value`` strings (:func:`apply_overrides`).
    ``resolve_model`` turns registered model names into configs (a callable raising
    ``KeyError`` for unknown names, or a mapping); default: ``capsctl.registry.get_config``.
    A preset without ``name`` is named after its file.
    """
    file = _find_preset(name_or_path)
    raw = _read_yaml_file(file)
    raw.setdefault("name", file.stem)
    return _finish(raw, overrides, resolve_model)


def preset_from_yaml(
    text: str,
    overrides: Sequence[str] = (),
    *,
    source: str = "<string>",
    resolve_model: ModelResolver | Mapping[str, ModelConfig] | None = None,
) -> Preset:
    """Like :func:`load_preset`, from YAML text; ``source`` names it in error messages."""
    return _finish(_parse_yaml_text(text, source), overrides, resolve_model)


def _finish(
    raw: dict[str, Any],
    overrides: Sequence[str],
    resolve_model: ModelResolver | Mapping[str, ModelConfig] | None,
) -> Preset:
    raw = apply_overrides(raw, overrides, resolve_model=resolve_model)
    return preset_from_dict(raw, resolve_model=resolve_model)


def preset_from_dict(
    data: Mapping[str, Any],
    *,
    resolve_model: ModelResolver | Mapping[str, ModelConfig] | None = None,
) -> Preset:
    """Validate a raw preset mapping (as from YAML or :func:`preset_to_dict`) into a Preset.

    ``model`` may be a registered name or carry ``base:``; the resolver is only consulted then.
    """
    if not isinstance(data, Mapping):
        raise _type_error("preset", "a mapping", data)
    raw = dict(data)
    if "model" in raw:
        raw["model"] = _expand_model(raw["model"], resolve_model, "model")
    return from_dict(Preset, raw, "")


def preset_to_dict(preset: Preset) -> dict[str, Any]:
    """Plain JSON/YAML-able data; :func:`preset_from_dict` gives back an equal Preset."""
    return dataclasses.asdict(preset)


def dump_yaml(preset: Preset) -> str:
    """The preset as YAML text, loadable again with :func:`load_preset`."""
    return yaml.dump(
        preset_to_dict(preset),
        Dumper=_Dumper,
        sort_keys=False,
        allow_unicode=True,
        default_flow_style=None,
    )
