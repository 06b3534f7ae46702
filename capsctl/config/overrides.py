"""Command-line overrides ``dotted.path=value`` applied to a raw preset mapping.

Overrides are applied before validation, so their errors name the same dotted paths as errors
in preset files. Values are parsed as YAML (``train.lr=0.05``, ``train.milestones=[10,20]``,
``data.test_file=null``); list items are addressed as ``model.layers[0].kernel``.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from capsctl.config.convert import show_value
from capsctl.config.model_refs import expand_model
from capsctl.config.schema import join_path
from capsctl.config.yaml_io import load_yaml, yaml_problem
from capsctl.errors import ConfigError

__all__ = ["apply_overrides"]

_NAME = r"[A-Za-z_][A-Za-z0-9_-]*"
_KEY = re.compile(rf"^{_NAME}(?:\[\d+\])*(?:\.{_NAME}(?:\[\d+\])*)*$")
_TOKEN = re.compile(rf"({_NAME})|\[(\d+)\]")

#: A parsed dotted path: field names and list indexes, e.g. ``["model", "layers", 0, "kernel"]``.
Tokens = list[str | int]


def _parse_key(key: str) -> Tokens:
    return [m.group(1) if m.group(1) is not None else int(m.group(2)) for m in _TOKEN.finditer(key)]


def _render(tokens: Sequence[str | int]) -> str:
    text = ""
    for token in tokens:
        text = f"{text}[{token}]" if isinstance(token, int) else join_path(text, token)
    return text


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of the raw preset mapping with ``dotted.path=value`` overrides applied.

    Values are parsed as YAML (``train.lr=0.05``, ``train.milestones=[10,20]``,
    ``data.test_file=null``); list items are addressed as ``model.layers[0].kernel``. Missing
    intermediate mappings are created. When an override reaches into a model given by name
    (``model: capsnet`` or ``model: {base: capsnet}``), the registered configuration is expanded
    into a mapping first. The result is not validated; ``preset_from_dict`` does that.
    """
    if isinstance(overrides, str):
        overrides = [overrides]
    result: dict[str, Any] = copy.deepcopy(dict(raw))
    for override in overrides:
        tokens, value = _parse_override(override)
        _expand_named_model(result, tokens)
        tokens, value = _switch_router(result, tokens, value)
        _set_path(result, tokens, value, override)
    return result


def _switch_router(root: dict[str, Any], tokens: Tokens, value: Any) -> tuple[Tokens, Any]:
    """A router given by name starts from that router's own defaults.

    ``model.router=dynamic`` means ``model.router={name: dynamic}``, and ``model.router.name=X``
    for a router other than the one the model has drops the old router's parameters (its
    iterations, its schedule) with it: the new router fills in its own defaults, and a schedule
    only where it has one. Parameters set after the switch apply to the new router."""
    if tokens == ["model", "router"] and isinstance(value, str):
        return tokens, {"name": value}
    if tokens != ["model", "router", "name"]:
        return tokens, value
    model = root.get("model")
    router = model.get("router") if isinstance(model, dict) else None
    if isinstance(router, dict) and router.get("name") == value:
        return tokens, value  # the same router: its parameters stay
    if isinstance(model, dict) and "base" in model and "router" not in model:
        root["model"] = model = expand_model(model, "model")
        router = model.get("router")
    if isinstance(router, dict) and router.get("name") == value:
        return tokens, value
    return ["model", "router"], {"name": value}


def _parse_override(override: Any) -> tuple[Tokens, Any]:
    """``"a.b[0]=value"`` -> (``["a", "b", 0]``, the value parsed as YAML)."""
    if not isinstance(override, str) or "=" not in override:
        raise ConfigError(f"override {override!r}: expected dotted.path=value, e.g. train.lr=0.05")
    key, text = override.split("=", 1)
    key = key.strip()
    if not _KEY.match(key):
        raise ConfigError(
            f"override {override!r}: {key!r} is not a dotted path; expected names joined by "
            "dots with optional [index], e.g. model.layers[0].kernel=5"
        )
    try:
        value = load_yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(
            f"override {override!r}: the value is not valid YAML ({yaml_problem(e)}); "
            "quote it or fix it"
        ) from None
    return _parse_key(key), value


def _expand_named_model(root: dict[str, Any], tokens: Tokens) -> None:
    """Before setting a field inside a model given by name, spell the model out as a mapping.

    ``model: capsnet`` becomes ``{base: capsnet}`` (so ``model.iterations=3`` keeps the
    registered fields); an override that reaches deeper than a top-level field the mapping
    lacks (``model.layers[0].kernel``) expands the registered configuration first.
    """
    if tokens[0] != "model" or len(tokens) < 2:
        return
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
        root["model"] = expand_model(model, "model")


def _set_path(root: dict[str, Any], tokens: Tokens, value: Any, override: str) -> None:
    """Set ``root[tokens[0]][tokens[1]]... = value``, creating missing mappings on the way."""
    node: Any = root
    for i, token in enumerate(tokens):
        step = _step_into_mapping if isinstance(token, str) else _step_into_list
        node = step(node, tokens, i, value, override)


def _step_into_mapping(node: Any, tokens: Tokens, i: int, value: Any, override: str) -> Any:
    """Field ``tokens[i]`` of mapping ``node``; set to ``value`` when it is the last token."""
    token = tokens[i]
    if not isinstance(node, dict):
        raise ConfigError(
            f"override {override!r}: {_render(tokens[:i]) or 'the preset'} is not a mapping "
            f"(it is {show_value(node)}); cannot set {_render(tokens[: i + 1])}"
        )
    if i == len(tokens) - 1:
        node[token] = value
        return None
    if token not in node or node[token] is None:
        if isinstance(tokens[i + 1], int):
            raise ConfigError(
                f"override {override!r}: {_render(tokens[: i + 1])} is not a list; "
                "set the whole list instead, e.g. key=[...]"
            )
        node[token] = {}
    return node[token]


def _step_into_list(node: Any, tokens: Tokens, i: int, value: Any, override: str) -> Any:
    """Item ``tokens[i]`` of list ``node``; set to ``value`` when it is the last token."""
    token = tokens[i]
    where = _render(tokens[:i]) or "the preset"
    if not isinstance(node, list):
        raise ConfigError(
            f"override {override!r}: {where} is not a list (it is {show_value(node)})"
        )
    if not 0 <= token < len(node):
        raise ConfigError(
            f"override {override!r}: index {token} is out of range ({where} has {len(node)} items)"
        )
    if i == len(tokens) - 1:
        node[token] = value
        return None
    return node[token]
