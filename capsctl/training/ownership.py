"""A run owns its folder: an OS lock held for the whole run, stale temporary files cleared, and
an ``--overwrite`` that replaces the old run only once the new one has written a checkpoint.

The lock is ``fcntl.flock`` on ``.capsctl-run.lock`` inside the run folder. The kernel releases
it when the process ends, however it ends (a kill included), so a dead run never leaves a
folder stuck. On a platform without ``fcntl`` no lock is taken.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from capsctl.errors import CapsctlError

__all__ = [
    "LOCK_FILE",
    "PREVIOUS_RUN",
    "FolderBusy",
    "RunLock",
    "StagedReplace",
    "clear_temp_files",
]

LOCK_FILE = ".capsctl-run.lock"
#: Where ``--overwrite`` parks the old run's files until the new run's first checkpoint.
PREVIOUS_RUN = ".previous-run"


class FolderBusy(CapsctlError):
    """Another live process is training into the same run folder."""


class RunLock:
    """An exclusive lock on a run folder (created if missing, removed again on :meth:`release`
    when this lock created it and nothing else was written there)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._file: IO[str] | None = None
        self._created = False

    def acquire(self) -> RunLock:
        self._created = not self.folder.exists()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CapsctlError(
                f"--out {self.folder}: cannot create the run folder ({e.strerror}); choose a "
                "writable --out"
            ) from None
        path = self.folder / LOCK_FILE
        try:
            handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 (held for the run)
        except OSError as e:
            self._forget_folder()
            raise CapsctlError(
                f"--out {self.folder}: not writable ({e.strerror}); choose a writable --out"
            ) from None
        try:
            import fcntl
        except ImportError:  # no advisory locks on this platform
            self._file = handle
            return self
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            owner = handle.read().strip() or "unknown"
            handle.close()
            raise FolderBusy(
                f"--out {self.folder}: another capsctl run (pid {owner}) is training into this "
                "folder; wait for it to end or choose another --out"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        self._file = handle
        return self

    def release(self) -> None:
        if self._file is None:
            return
        self._file.close()  # releases the lock
        self._file = None
        self._forget_folder()

    def _forget_folder(self) -> None:
        """Remove a folder this lock created when it holds nothing but the lock file."""
        if not self._created:
            return
        with contextlib.suppress(OSError):
            rest = [p for p in self.folder.iterdir() if p.name != LOCK_FILE]
            if not rest:
                (self.folder / LOCK_FILE).unlink(missing_ok=True)
                self.folder.rmdir()

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def clear_temp_files(folder: Path) -> list[Path]:
    """Delete the hidden temporary files (``.name.PID.HEX.tmp.ext``) that a killed process left
    in a folder this process has locked; returns what was removed."""
    removed = []
    if not folder.is_dir():
        return removed
    for p in folder.glob(".*.tmp*"):
        if p.is_file():
            with contextlib.suppress(OSError):
                p.unlink()
                removed.append(p)
    return removed


class StagedReplace:
    """``--overwrite`` of a finished or unfinished run, done safely: :meth:`stage` moves the old
    run's files into ``.previous-run/`` (after every check of the new run has passed),
    :meth:`commit` deletes them once the new run has written its first checkpoint, and
    :meth:`restore` puts them back when the new run fails before that."""

    def __init__(self, folder: Path, names: Iterable[str]) -> None:
        self.folder = folder
        self.names = list(names)
        self.parked: Path | None = None

    def stage(self) -> None:
        old = [self.folder / n for n in self.names if (self.folder / n).exists()]
        old += sorted(self.folder.glob("events.out.tfevents.*"))
        if not old:
            return
        parked = self.folder / PREVIOUS_RUN
        if parked.exists():  # a run killed between stage and commit: that one is the old run
            shutil.rmtree(parked)
        parked.mkdir()
        for f in old:
            os.replace(f, parked / f.name)
        self.parked = parked

    def commit(self) -> None:
        if self.parked is not None:
            shutil.rmtree(self.parked, ignore_errors=True)
            self.parked = None

    def restore(self) -> None:
        """Put the old run back; files of the new run that the old one did not have go."""
        if self.parked is None or not self.parked.exists():
            return
        old = {f.name for f in self.parked.iterdir()}
        new = [self.folder / n for n in self.names] + list(
            self.folder.glob("events.out.tfevents.*")
        )
        for f in new:
            if f.exists() and f.name not in old:
                f.unlink()
        for name in old:
            os.replace(self.parked / name, self.folder / name)
        shutil.rmtree(self.parked, ignore_errors=True)
        self.parked = None


def recover_parked(folder: Path, names: Iterable[str]) -> str | None:
    """Settle an ``--overwrite`` that a kill interrupted (``.previous-run/`` still there): without
    a new ``last.safetensors`` the new run never reached its first checkpoint, so the old run is
    put back; with one, the old run's files go as planned. Returns what was done, or None."""
    parked = folder / PREVIOUS_RUN
    if not parked.is_dir():
        return None
    staged = StagedReplace(folder, names)
    staged.parked = parked
    if (folder / "last.safetensors").exists():
        staged.commit()
        return "removed the files of the run an interrupted --overwrite replaced"
    staged.restore()
    return "put back the run that an interrupted --overwrite was replacing"
