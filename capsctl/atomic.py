"""Writing files so that a reader never sees a partial one: temporary file, fsync, rename.

:func:`check_output` is the one rule for a path a command writes: never one of the files it
reads, never in a run folder or a suite folder that is not the output's own, and never an
existing file unless the user said ``--overwrite`` and the file holds an earlier output of the
same kind (told by its content: :mod:`capsctl.outputs`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

from capsctl.errors import CapsctlError, UsageError
from capsctl.outputs import OutputKind, refuse_inside_runs


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
    kind: OutputKind,
    inputs: Iterable[str | os.PathLike[str]] = (),
    overwrite: bool = False,
) -> None:
    """Refuse (:class:`UsageError`) to write ``path``, an output of ``kind``, when it is one of
    ``inputs``, in or below a run folder or a suite folder that is not its own
    (:func:`capsctl.outputs.refuse_inside_runs`), or when it exists and either ``overwrite`` is
    False or it does not hold ``kind`` (even with ``overwrite``). A file kind's ``path`` must not
    be a folder; a folder kind's must not be a file, and an existing non-empty folder counts as
    existing unless the kind adds to its own folder (``kind.home``)."""
    path = Path(path)
    for source in inputs:
        if same_file(path, source):
            raise UsageError(
                f"{path} is the input {source}; writing there would destroy it, pick another "
                "output path"
            )
    refuse_inside_runs(path, kind)
    if kind.folder:
        if path.exists() and not path.is_dir():
            raise UsageError(f"{path} exists and is not a folder; pick another output folder")
        if kind.home is not None or not path.is_dir() or not any(path.iterdir()):
            return
    elif path.is_dir():
        raise UsageError(f"{path} is a folder; pick an output file name")
    if not (path.exists() or path.is_symlink()):
        return
    if not overwrite:
        raise _exists_error(path)
    if not kind.holds(path):
        raise UsageError(
            f"{path} exists and is not {kind.what}; --overwrite replaces only that, so pick "
            "another output path"
        )


def _exists_error(path: Path) -> UsageError:
    return UsageError(
        f"{path} already exists; pass --overwrite to replace it or pick another output path"
    )


def publish(tmp: Path, path: Path, *, overwrite: bool = True) -> None:
    """Rename the finished ``tmp`` to ``path``. Without ``overwrite`` the file that appeared at
    ``path`` meanwhile is kept (hard link, no replace) and a UsageError says it exists; ``tmp``
    is left for the caller to remove. OSError on failure."""
    if overwrite:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)  # fails if path exists: nothing is ever replaced
    except FileExistsError:
        raise _exists_error(path) from None
    except OSError:  # no hard links on this file system
        if path.exists() or path.is_symlink():
            raise _exists_error(path) from None
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
