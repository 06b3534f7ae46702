"""Strict conversion of plain data (parsed YAML or JSON) into dataclasses.

:func:`from_dict` follows the type annotations of a dataclass: unknown keys (with a "did you
mean" hint), wrong types and out-of-range values raise a :class:`~capsctl.errors.ConfigError`
naming the dotted path of the field (``train.lr``, ``model.layers[1].kernel``). Keys listed in
a class's ``RETIRED_FIELDS`` are dropped silently, and a class's ``upgrade_mapping`` classmethod
rewrites older layouts first (older files still load).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union

from capsctl.config.schema import VALIDATORS, check, check_limit, join_path
from capsctl.errors import ConfigError
from capsctl.models.spec import ModelConfig

__all__ = ["describe_type", "from_dict", "show_value", "type_error"]

T = TypeVar("T")

_SCALAR_NAMES = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "a list",
}
_PLURALS = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_union(origin: Any) -> bool:
    return origin is Union or origin is types.UnionType


def show_value(value: Any) -> str:
    """A short one-line rendering of a value for error messages (YAML spelling of scalars)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return "a mapping"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe_type(tp: Any) -> str:
    """Human description of an annotation: ``a number``, ``one of 'sgd', 'adamw'``..."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        values = typing.get_args(tp)
        if len(values) == 1:
            return repr(values[0])
        return "one of " + ", ".join(repr(a) for a in values)
    if _is_union(origin):
        args = typing.get_args(tp)
        text = " or ".join(describe_type(a) for a in args if a is not type(None))
        return f"{text} or null" if type(None) in args else text
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return "a list" if item is Any else f"a list of {_plural(item)}"
    if origin is dict or tp is dict or dataclasses.is_dataclass(tp):
        return "a mapping"
    return _SCALAR_NAMES.get(tp, getattr(tp, "__name__", str(tp)))


def _plural(tp: Any) -> str:
    if dataclasses.is_dataclass(tp):
        return "mappings"
    return _PLURALS.get(tp, describe_type(tp))


def type_error(path: str, expected: str, value: Any) -> ConfigError:
    """``"<path>: expected <expected>, got <value>"``."""
    return ConfigError(f"{path}: expected {expected}, got {show_value(value)}")


def _convert(tp: Any, value: Any, path: str, expected: str | None = None) -> Any:
    """Convert ``value`` to annotation ``tp``; ``expected`` overrides the type description."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    expected = expected or describe_type(tp)
    if _is_union(origin):
        return _convert_union(tp, value, path, expected)
    if origin is Literal:
        return _convert_literal(tp, value, path, expected)
    if origin is list or tp is list:
        return _convert_list(tp, value, path, expected)
    if origin is dict or tp is dict:
        return _convert_dict(tp, value, path, expected)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise type_error(path, expected, value)
        return from_dict(tp, value, path)
    if tp is float:
        return _convert_float(value, path, expected)
    if isinstance(tp, type):
        return _convert_instance(tp, value, path, expected)
    raise TypeError(f"from_dict does not support the annotation {tp!r} (at {path})")


def _convert_union(tp: Any, value: Any, path: str, expected: str) -> Any:
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    candidates = [a for a in args if a is not type(None)]
    if len(candidates) == 1:
        return _convert(candidates[0], value, path, expected)
    for candidate in candidates:
        try:
            return _convert(candidate, value, path)
        except ConfigError:
            continue
    raise type_error(path, expected, value)


def _convert_literal(tp: Any, value: Any, path: str, expected: str) -> Any:
    for allowed in typing.get_args(tp):
        if type(value) is type(allowed) and value == allowed:
            return value
    raise type_error(path, expected, value)


def _convert_list(tp: Any, value: Any, path: str, expected: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise type_error(path, expected, value)
    (item,) = typing.get_args(tp) or (Any,)
    return [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]


def _convert_dict(tp: Any, value: Any, path: str, expected: str) -> dict[Any, Any]:
    if not isinstance(value, Mapping):
        raise type_error(path, expected, value)
    key_tp, value_tp = typing.get_args(tp) or (Any, Any)
    return {
        _convert(key_tp, k, path): _convert(value_tp, v, join_path(path, str(k)))
        for k, v in value.items()
    }


def _convert_float(value: Any, path: str, expected: str) -> float:
    """Integers are accepted for numbers when exactly representable; inf and nan are not."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise type_error(path, expected, value)
    try:
        number = float(value)
    except OverflowError:
        raise ConfigError(f"{path}: {show_value(value)} is too large for a number") from None
    if isinstance(value, int) and number != value:
        raise ConfigError(
            f"{path}: {show_value(value)} cannot be represented exactly as a number; "
            "use a smaller value"
        )
    if not math.isfinite(number):
        raise ConfigError(f"{path}: expected a finite number, got {show_value(value)}")
    return number


def _convert_instance(tp: type, value: Any, path: str, expected: str) -> Any:
    """Plain classes (``bool``, ``int``, ``str``...): no coercion; ``bool`` is not an ``int``."""
    if tp is int and isinstance(value, bool):
        raise type_error(path, expected, value)
    if isinstance(value, tp):
        return value
    raise type_error(path, expected, value)


def _check_keys(keys: typing.Iterable[Any], fields: list[str], path: str) -> None:
    """Every key must name one of ``fields``; the error suggests the closest name."""
    for key in keys:
        if not isinstance(key, str) or key not in fields:
            near = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ConfigError(
                f"{join_path(path, str(key))}: unknown field; expected one of "
                f"{', '.join(fields)}{hint}"
            )


def validate_router(cfg: ModelConfig, path: str) -> None:
    """``model.router``: a known algorithm name and that algorithm's parameters (checked like
    any other fields); ``cfg.router`` is rewritten with every parameter spelled out."""
    from capsctl.layers.routers import ROUTERS  # torch: only when a model config is read

    name = cfg.router.get("name")
    if name not in ROUTERS:
        near = f"; use one of {', '.join(ROUTERS)}"
        what = "missing" if name is None else f"unknown routing algorithm {name!r}"
        raise ConfigError(f"{join_path(path, 'name')}: {what}{near}")
    cls = ROUTERS[name]
    params = from_dict(cls.Params, {k: v for k, v in cfg.router.items() if k != "name"}, path)
    iterations = getattr(params, "iterations", 1)
    check(iterations >= 1, join_path(path, "iterations"), f"must be >= 1, got {iterations}")
    check_limit(iterations, path, "iterations")
    cfg.router = {"name": name, **dataclasses.asdict(params)}


def _validate(obj: Any, path: str) -> None:
    """Run the range checks of ``obj``: :data:`VALIDATORS`, then its ``validate`` method."""
    check = VALIDATORS.get(type(obj))
    if check is not None:
        check(obj, path)
    if isinstance(obj, ModelConfig):
        validate_router(obj, join_path(path, "router"))
    hook = getattr(obj, "validate", None)
    if callable(hook):
        if len(inspect.signature(hook).parameters) >= 1:
            hook(path)
        else:
            hook()


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Build dataclass ``cls`` from plain data (a mapping), strictly.

    Unknown keys, wrong types and out-of-range values raise :class:`ConfigError` naming the
    dotted path (``path`` is the path of ``data`` itself, ``""`` at the top level). Missing
    fields take their defaults. Range checks come from ``cls.validate(self, path)`` when the
    class defines it, and from :data:`capsctl.config.schema.VALIDATORS`.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"from_dict needs a dataclass, got {cls!r}")
    if not isinstance(data, Mapping):
        raise type_error(path or "top level", "a mapping", data)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    upgrade = getattr(cls, "upgrade_mapping", None)
    if callable(upgrade):  # files written by older versions
        data = upgrade(data)
    retired = getattr(cls, "RETIRED_FIELDS", ())
    data = {k: v for k, v in data.items() if k not in retired}
    _check_keys(data, list(fields), path)
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], join_path(path, name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{join_path(path, name)}: missing required field; add it")
    obj = cls(**kwargs)
    _validate(obj, path)
    return obj
