"""Writing files so that a reader never sees a partial one: temporary file, fsync, rename.

:func:`check_output` is the one rule for a path a command writes: never one of the files it
reads, and never an existing file unless the user said ``--overwrite``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

from capsctl.errors import CapsctlError, UsageError


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


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether ``a`` and ``b`` name one file: the same resolved path (symlinks followed) or,
    when both exist, the same inode (hard links)."""
    a, b = Path(a), Path(b)
    try:
        if a.resolve() == b.resolve():
            return True
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop
        return False


def check_output(
    path: str | os.PathLike[str],
    *,
    inputs: Iterable[str | os.PathLike[str]] = (),
    overwrite: bool = False,
) -> None:
    """Refuse (:class:`UsageError`) to write ``path`` when it is one of ``inputs`` (even with
    ``overwrite``), a folder, or an existing file while ``overwrite`` is False."""
    path = Path(path)
    for source in inputs:
        if same_file(path, source):
            raise UsageError(
                f"{path} is the input {source}; writing there would destroy it, pick another "
                "output path"
            )
    if path.is_dir():
        raise UsageError(f"{path} is a folder; pick an output file name")
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise UsageError(
            f"{path} already exists; pass --overwrite to replace it or pick another output path"
        )


def publish(tmp: Path, path: Path, *, overwrite: bool = True) -> None:
    """Rename the finished ``tmp`` to ``path``. Without ``overwrite`` the file that appeared at
    ``path`` meanwhile is kept (hard link, no replace) and :func:`check_output`'s UsageError is
    raised; ``tmp`` is left for the caller to remove. OSError on failure."""
    if overwrite:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)  # fails if path exists: nothing is ever replaced
    except FileExistsError:
        check_output(path)
        raise
    except OSError:  # no hard links on this file system
        check_output(path)
        os.replace(tmp, path)
        return
    os.unlink(tmp)


def write_atomic(path: str | os.PathLike[str], data: bytes, *, overwrite: bool = True) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename.

    On failure the previous file at ``path`` is unchanged and :class:`CapsctlError` names it.
    ``overwrite=False``: an existing ``path`` is kept and :class:`UsageError` says so.
    """
    path = Path(path)
    tmp = temp_path(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        publish(tmp, path, overwrite=overwrite)
    except UsageError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise CapsctlError(
            f"cannot write {path}: {e.strerror or e}; check that the folder exists and is writable"
        ) from None
    fsync_dir(path.parent)


def write_text_atomic(path: str | os.PathLike[str], text: str, *, overwrite: bool = True) -> None:
    """:func:`write_atomic` for text (UTF-8)."""
    write_atomic(path, text.encode("utf-8"), overwrite=overwrite)
