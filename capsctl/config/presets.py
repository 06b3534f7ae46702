"""Preset files: finding them by name, loading them, and turning raw mappings into Presets.

Presets are looked up in the wheel's bundled ``capsctl/presets/`` and in the source checkout's
top-level ``presets/`` (:func:`preset_dirs`). Loading is: read YAML (:mod:`.yaml_io`), apply
``dotted.path=value`` overrides (:mod:`.overrides`), expand a model given by name or ``base:``
(:mod:`.model_refs`), then convert strictly (:func:`~capsctl.config.convert.from_dict`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from capsctl.config.convert import from_dict, type_error
from capsctl.config.model_refs import expand_model
from capsctl.config.overrides import apply_overrides
from capsctl.config.schema import Preset
from capsctl.config.yaml_io import parse_preset_text, read_preset_file, to_yaml
from capsctl.errors import ConfigError, did_you_mean, some_names

__all__ = [
    "dump_yaml",
    "list_presets",
    "load_preset",
    "preset_dirs",
    "preset_from_dict",
    "preset_from_yaml",
    "preset_to_dict",
]

_PRESET_SUFFIXES = (".yaml", ".yml")


def preset_dirs() -> list[Path]:
    """Folders searched for presets, in order; only those that exist.

    The bundled ``capsctl/presets/`` (inside an installed wheel) and the source checkout's
    top-level ``presets/`` (editable installs). A name found in several is taken from the first.
    """
    package = Path(__file__).resolve().parents[1]  # the capsctl folder
    candidates = [package / "presets"]
    if package.parent.name not in ("site-packages", "dist-packages"):
        candidates.append(package.parent / "presets")
    return [d for d in candidates if d.is_dir()]


def _preset_files() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder in preset_dirs():
        for file in sorted(folder.iterdir()):
            if file.suffix in _PRESET_SUFFIXES and file.is_file():
                found.setdefault(file.stem, file)
    return dict(sorted(found.items()))


def list_presets() -> list[tuple[str, str]]:
    """``(name, description)`` of every preset in :func:`preset_dirs`, sorted by name.

    A preset that cannot be read is listed with its error as the description.
    """
    result = []
    for name, file in _preset_files().items():
        try:
            description = read_preset_file(file).get("description", "")
        except ConfigError as e:
            description = f"(invalid: {e})"
        result.append((name, description if isinstance(description, str) else ""))
    return result


def _find_preset(name_or_path: str | os.PathLike[str]) -> Path:
    name_or_path = os.fspath(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.suffix in _PRESET_SUFFIXES or "/" in name_or_path or "\\" in name_or_path:
        if path.exists() and not path.is_file():
            raise ConfigError(
                f"preset file {name_or_path}: not a regular file (a folder, named pipe, socket "
                "or device); pass a preset name or the path of a .yaml file"
            )
        if not path.is_file():
            raise ConfigError(
                f"preset file {name_or_path} does not exist; pass a preset name or the path "
                "of a .yaml file"
            )
        return path
    files = _preset_files()
    if name_or_path in files:
        return files[name_or_path]
    hint = did_you_mean(list(files), name_or_path)
    known = some_names(list(files), name_or_path, "capsctl presets") if files else "(none found)"
    raise ConfigError(
        f"unknown preset {name_or_path!r}{hint}; known presets: {known}; or a .yaml file"
    )


def load_preset(name_or_path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> Preset:
    """Load a preset by name (see :func:`preset_dirs`) or from a ``.yaml`` path.

    ``overrides`` are ``dotted.path=value`` strings (:func:`apply_overrides`). A model given
    by name or ``base:`` is looked up in :mod:`capsctl.registry`. A preset without ``name`` is
    named after its file.
    """
    file = _find_preset(name_or_path)
    raw = read_preset_file(file)
    raw.setdefault("name", file.stem)
    return preset_from_dict(apply_overrides(raw, overrides))


def preset_from_yaml(
    text: str, overrides: Sequence[str] = (), *, source: str = "<string>"
) -> Preset:
    """Like :func:`load_preset`, from YAML text; ``source`` names it in error messages."""
    return preset_from_dict(apply_overrides(parse_preset_text(text, source), overrides))


def preset_from_dict(data: Mapping[str, Any]) -> Preset:
    """Validate a raw preset mapping (as from YAML or :func:`preset_to_dict`) into a Preset.

    ``model`` may be a registered name or carry ``base:``; only then is the registry consulted.
    """
    if not isinstance(data, Mapping):
        raise type_error("preset", "a mapping", data)
    raw = dict(data)
    if "model" in raw:
        raw["model"] = expand_model(raw["model"], "model")
    return from_dict(Preset, raw, "")


def preset_to_dict(preset: Preset) -> dict[str, Any]:
    """Plain JSON/YAML-able data; :func:`preset_from_dict` gives back an equal Preset."""
    return dataclasses.asdict(preset)


def dump_yaml(preset: Preset) -> str:
    """The preset as YAML text, loadable again with :func:`load_preset`."""
    return to_yaml(preset_to_dict(preset))
