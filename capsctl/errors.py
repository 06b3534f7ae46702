"""Exceptions that the CLI turns into one-line messages and exit codes, and :func:`some_names`
for the names such a line offers."""

from __future__ import annotations

import difflib
from collections.abc import Sequence

#: The most names one error line lists (the closest to what was typed first).
NAMES_LISTED = 4
#: Names that fit in this many characters are all listed.
NAMES_CHARS = 100


def some_names(names: Sequence[str], typed: str, listed_by: str) -> str:
    """``names`` for a one-line error: all of them when there are at most
    :data:`NAMES_LISTED` or they fit in :data:`NAMES_CHARS` characters; else the ones closest
    to ``typed``, then ``"... (N in all: <listed_by>)"``; ``"none"`` when there are none."""
    if len(names) <= NAMES_LISTED or len(", ".join(names)) <= NAMES_CHARS:
        return ", ".join(names) or "none"
    close = difflib.get_close_matches(typed, names, n=NAMES_LISTED, cutoff=0)
    return f"{', '.join(close)}, ... ({len(names)} in all: {listed_by})"


def did_you_mean(names: Sequence[str], typed: str) -> str:
    """``" (did you mean <name>?)"`` for the name closest to ``typed``, or ``""``."""
    near = difflib.get_close_matches(typed, names, n=1)
    return f" (did you mean {near[0]}?)" if near else ""


class CapsctlError(Exception):
    """A problem the user can fix. The message is one line: what is wrong and what to do.

    ``exit_code`` is 1 for bad input or failed work, 2 for usage errors.
    """

    exit_code: int = 1

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(CapsctlError):
    """Wrong flags or arguments (exit code 2)."""

    exit_code = 2


class ConfigError(UsageError):
    """A preset, override or model configuration is invalid; names the dotted field path."""


class CheckpointError(CapsctlError):
    """A checkpoint file is missing, corrupt, foreign or inconsistent."""


class DataError(CapsctlError):
    """A dataset is missing or malformed."""


class DivergedError(CapsctlError):
    """Training stopped at a non-finite loss: ``epoch`` and ``step`` (from 1) where it did."""

    def __init__(self, message: str, *, epoch: int, step: int) -> None:
        super().__init__(message)
        self.epoch, self.step = epoch, step
