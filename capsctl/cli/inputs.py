"""Checks of the input paths a command names, before any work: present and readable without
blocking (a named pipe would wait for a writer forever)."""

from __future__ import annotations

from pathlib import Path

from capsctl.errors import UsageError

__all__ = ["require_input"]


def require_input(path: Path, what: str = "checkpoint") -> None:
    """UsageError naming ``path`` unless it is a regular file or a folder (a checkpoint: or the
    name of a shipped file, ``capsctl weights``)."""
    from capsctl.checkpoint.shipped import shipped_or_path

    if what == "checkpoint":
        path = shipped_or_path(path)
    if not path.exists():
        hint = "; capsctl weights lists the shipped names" if what == "checkpoint" else ""
        raise UsageError(f"{path}: no such file{hint}")
    if not (path.is_file() or path.is_dir()):
        raise UsageError(
            f"{path}: not a regular file (a named pipe, socket or device); pass a {what} file"
        )
