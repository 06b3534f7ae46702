"""Writing files so that a reader never sees a partial one: temporary file, fsync, rename."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from capsctl.errors import CapsctlError


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (best effort; not every platform allows it)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def temp_path(path: Path) -> Path:
    """A fresh hidden temporary name next to ``path`` that keeps its suffix."""
    return path.with_name(f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp{path.suffix}")


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename.

    On failure the previous file at ``path`` is unchanged and :class:`CapsctlError` names it.
    """
    path = Path(path)
    tmp = temp_path(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise CapsctlError(
            f"cannot write {path}: {e.strerror or e}; check that the folder exists and is writable"
        ) from None
    fsync_dir(path.parent)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """:func:`write_atomic` for text (UTF-8)."""
    write_atomic(path, text.encode("utf-8"))
