"""Checks shared by the suite file's parsers (capsctl/suites/spec.py, tune_spec.py): a value
shown short in an error, and the keys a mapping may have."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from capsctl.errors import ConfigError

__all__ = ["check_keys", "shown"]

_PLAIN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")


def shown(value: Any) -> str:
    """``value`` as a short one-line repr for an error message."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_keys(data: Mapping[str, Any], allowed: Sequence[str], where: str) -> None:
    """ConfigError naming the first key of ``data`` not in ``allowed``."""
    unknown = sorted(str(k) for k in data if k not in allowed)
    if unknown:
        field = unknown[0] if _PLAIN_NAME.fullmatch(unknown[0]) else shown(unknown[0])
        raise ConfigError(f"{where}.{field}: unknown field; expected one of {', '.join(allowed)}")
