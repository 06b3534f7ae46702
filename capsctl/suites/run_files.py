"""A pair's run files as the suite commands read them: ``results.json``, ``tests.json`` and
``provenance.json``, checked as they are read.

A missing file is an empty record. A damaged one (unreadable, not JSON, not a JSON object, or
a field the suite reads of the wrong kind, such as an edited accuracy that is a string, NaN or
above 1) is a :class:`DamagedRunFile` naming the file and the field: a pair is never taken as
finished, dropped from a report or overwritten because of a file that could not be read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from capsctl.errors import CapsctlError
from capsctl.suites.spec import CONTROL_CHARS

__all__ = [
    "PROVENANCE_FILE",
    "RESULTS_FILE",
    "TESTS_FILE",
    "DamagedRunFile",
    "check_run_files",
    "epochs_trained",
    "is_finished",
    "read_json",
]

RESULTS_FILE = "results.json"
TESTS_FILE = "tests.json"
PROVENANCE_FILE = "provenance.json"
_TODO = "restore it from a copy, or move its folder away to run the pair again"


class DamagedRunFile(CapsctlError):
    """A run file that is there but cannot be used as it is."""


class _Bad(Exception):
    """A field (dotted path) of a run file that is not what it must be."""

    def __init__(self, field: str, value: Any, what: str) -> None:
        super().__init__(field)
        self.field, self.value, self.what = field, value, what


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def read_json(path: Path) -> dict[str, Any]:
    """A run file's JSON object, checked (:data:`RESULTS_FILE`, :data:`TESTS_FILE` and
    :data:`PROVENANCE_FILE` field by field); ``{}`` when it is missing. DamagedRunFile (one
    line naming the file and the field) when it is there but cannot be used."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise DamagedRunFile(f"{path}: damaged (not UTF-8 text); {_TODO}") from None
    except json.JSONDecodeError as e:
        where = f"line {e.lineno}, column {e.colno}"
        raise DamagedRunFile(f"{path}: damaged (not JSON: {e.msg}, {where}); {_TODO}") from None
    except (OSError, RecursionError) as e:
        why = getattr(e, "strerror", None) or type(e).__name__
        raise DamagedRunFile(f"{path}: damaged (cannot be read: {why}); {_TODO}") from None
    if not isinstance(data, dict):
        raise DamagedRunFile(f"{path}: damaged (not a JSON object); {_TODO}")
    check = _CHECKS.get(path.name)
    try:
        if check is not None:
            check(data)
    except _Bad as e:
        raise DamagedRunFile(
            f"{path}: damaged ({e.field}: {_shown(e.value)} is not {e.what}); {_TODO}"
        ) from None
    return data


def check_run_files(folder: Path) -> None:
    """DamagedRunFile when one of ``folder``'s run files is damaged."""
    for name in _CHECKS:
        read_json(folder / name)


def _number(value: Any, field: str, high: float = math.inf, *, optional: bool = True) -> None:
    """``value``: a finite number from 0 to ``high`` (or None when ``optional``)."""
    if value is None and optional:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or not 0 <= value <= high:
        raise _Bad(field, value, "a number from 0 to 1" if high == 1 else "a number >= 0")


def _count(value: Any, field: str) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise _Bad(field, value, "a count of images")


def _text(value: Any, field: str) -> None:
    if isinstance(value, str) and CONTROL_CHARS.search(value):
        raise _Bad(field, value, "one line of plain text")


def _mapping(value: Any, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Bad(field, value, "a JSON object")
    return value


def _records(value: Any, field: str) -> list[dict[str, Any]]:
    """A list of JSON objects (None: an empty one)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise _Bad(field, value, "a list")
    return [_mapping(v, f"{field}[{i}]") for i, v in enumerate(value)]


def _score(doc: dict[str, Any], field: str) -> None:
    """One test result: ``accuracy`` in [0, 1], ``count`` of images, ``metric`` as text."""
    _number(doc.get("accuracy"), f"{field}.accuracy", high=1)
    _count(doc.get("count"), f"{field}.count")
    _text(doc.get("metric"), f"{field}.metric")


def _check_results(doc: dict[str, Any]) -> None:
    if doc.get("test") is not None:
        _score(_mapping(doc["test"], "test"), "test")
    for key in ("seconds", "epochs_done"):  # None is no number: only a missing one means 0
        if key in doc:
            _number(doc[key], key, optional=False)
    for i, record in enumerate(_records(doc.get("history"), "history")):
        for key in ("images", "images_per_s", "epoch_seconds"):
            _number(record.get(key), f"history[{i}].{key}")


def _check_tests(doc: dict[str, Any]) -> None:
    for name, score in _mapping(doc.get("tests"), "tests").items():
        _text(name, "tests")
        _score(_mapping(score, f"tests.{name[:40]}"), f"tests.{name[:40]}")


def _check_provenance(doc: dict[str, Any]) -> None:
    for i, record in enumerate(_records(doc.get("trained_by"), "trained_by")):
        for key, value in record.items():
            _text(key, f"trained_by[{i}]")
            _text(value, f"trained_by[{i}].{str(key)[:40]}")


_CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    RESULTS_FILE: _check_results,
    TESTS_FILE: _check_tests,
    PROVENANCE_FILE: _check_provenance,
}


def is_finished(results: dict[str, Any]) -> bool:
    """Whether a ``results.json`` content is a finished run's: it has the final test, or it is
    a record restored from a results file (``restored_from``; its final test was not kept)."""
    return bool(results.get("test")) or bool(results.get("restored_from"))


def _epoch_images(record: dict[str, Any]) -> float | None:
    """The images one epoch's record says it trained on (older records: rate x time)."""
    if isinstance(record.get("images"), (int, float)):
        return float(record["images"])
    rate, seconds = record.get("images_per_s"), record.get("epoch_seconds")
    if isinstance(rate, (int, float)) and isinstance(seconds, (int, float)):
        return float(rate) * float(seconds)
    return None


def epochs_trained(results: dict[str, Any]) -> float:
    """The epochs a run trained (its ``results.json``): its whole epochs, plus the part of the
    last one when a time limit cut it short (its images against a whole epoch's)."""
    done = float(results.get("epochs_done", 0))
    history = [h for h in results.get("history", []) if isinstance(h, dict)]
    if not history or not history[-1].get("time_limit"):
        return done
    whole = [_epoch_images(h) for h in history[:-1]]
    full = max((w for w in whole if w), default=None)
    last = _epoch_images(history[-1])
    if full is None or last is None:
        return done  # nothing to measure a whole epoch by
    return done - 1 + min(1.0, round(last / full, 6))
