"""Reading and writing preset YAML safely.

YAML is read with a subclass of ``yaml.SafeLoader`` (never an unsafe loader) that additionally
reads ``1e-3`` as a float, as YAML 1.2 does (plain PyYAML follows YAML 1.1 and reads it as a
string), and rejects duplicate keys. The matching dumper quotes strings such as ``"1e5"`` so
that they are read back as strings.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from capsctl.config.convert import show_value
from capsctl.errors import ConfigError

__all__ = [
    "Yaml12Dumper",
    "Yaml12Loader",
    "load_yaml",
    "parse_preset_text",
    "parse_yaml",
    "read_preset_file",
    "to_yaml",
    "yaml_problem",
]

# YAML 1.2 style floats without a dot, such as 1e-3 or 5E+4, which YAML 1.1 reads as strings.
_EXP_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


class Yaml12Loader(yaml.SafeLoader):
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


class Yaml12Dumper(yaml.SafeDumper):
    """``yaml.SafeDumper`` that quotes strings which :class:`Yaml12Loader` would read as floats."""


for _cls in (Yaml12Loader, Yaml12Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _EXP_FLOAT, list("-+0123456789"))


def load_yaml(text: str) -> Any:
    """Parse YAML safely (no arbitrary objects); see :class:`Yaml12Loader`."""
    return yaml.load(text, Loader=Yaml12Loader)  # noqa: S506 - Yaml12Loader is a SafeLoader


def to_yaml(data: Mapping[str, Any]) -> str:
    """Plain data as block-style YAML text in insertion order, readable by :func:`load_yaml`."""
    return yaml.dump(
        dict(data),
        Dumper=Yaml12Dumper,
        sort_keys=False,
        allow_unicode=True,
        default_flow_style=None,
    )


def yaml_problem(error: yaml.YAMLError) -> str:
    """The one-line description of a YAML error, without its position."""
    problem = getattr(error, "problem", None) or str(error)
    return " ".join(str(problem).split())


def parse_yaml(text: str, source: str) -> Any:
    """:func:`load_yaml` of a file's text; invalid YAML is a one-line :class:`ConfigError`
    naming ``source``, the line and the column (PyYAML's own message spans several lines and
    names ``<unicode string>``)."""
    try:
        return load_yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        column = f", column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(
            f"{where}: invalid YAML ({yaml_problem(e)[:100]}{column}); fix the syntax"
        ) from None


def parse_preset_text(text: str, source: str) -> dict[str, Any]:
    """The top-level mapping of a preset's YAML text; ``source`` names it in errors. Empty text
    (or only comments) is a :class:`ConfigError`: it would silently train with every default."""
    raw = parse_yaml(text, source)
    if raw is None:  # an empty file (or only comments) is a mistake, not "all defaults"
        raise ConfigError(
            f"{source}: the preset is empty (no fields); write its name, model, data and train "
            "fields (see capsctl presets for examples) or pass another preset"
        )
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{source}: expected a mapping of preset fields (name, description, model, data, "
            f"train) at the top level, got {show_value(raw)}"
        )
    return raw


def read_preset_file(path: Path) -> dict[str, Any]:
    """The top-level mapping of a preset file (UTF-8 YAML)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file; pass a YAML preset") from None
    except OSError as e:
        raise ConfigError(f"cannot read preset {path}: {e.strerror or e}") from None
    return parse_preset_text(text, str(path))
