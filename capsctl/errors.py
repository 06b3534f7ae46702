"""Exceptions that the CLI turns into one-line messages and exit codes."""

from __future__ import annotations


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
