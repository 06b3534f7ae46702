"""Downloading dataset files (md5-checked, atomic) and extracting tar archives safely."""

from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import tarfile
import tempfile
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from capsctl.errors import DataError
from capsctl.events import EventFn, emit

__all__ = [
    "CIFAR_ARCHIVES",
    "IDX_MIRRORS",
    "IDX_MD5",
    "Remote",
    "download_file",
    "extract_tar",
    "md5_of",
]


@dataclass(frozen=True)
class Remote:
    """A file that can be downloaded: mirror URLs (tried in order), its name and md5 (``""``:
    not pinned; the caller checks the file's contents instead)."""

    urls: tuple[str, ...]
    filename: str
    md5: str


CIFAR_ARCHIVES: dict[str, Remote] = {
    "cifar10": Remote(
        ("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",),
        "cifar-10-python.tar.gz",
        "c58f30108f718f92721af3b95e74349a",
    ),
    "cifar100": Remote(
        ("https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",),
        "cifar-100-python.tar.gz",
        "eb9058c3a382ffc7106e4002c42a8d85",
    ),
}
"""The canonical CIFAR python tarballs."""

IDX_MIRRORS: dict[str, tuple[str, ...]] = {
    "mnist": (
        "https://ossci-datasets.s3.amazonaws.com/mnist/",
        "http://yann.lecun.com/exdb/mnist/",
    ),
    "fashion-mnist": ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",),
}
"""Base URLs (ending in '/') that serve the four gzipped IDX files under their standard names."""

IDX_MD5: dict[str, dict[str, str]] = {
    "mnist": {
        "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
        "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
        "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
    },
    "fashion-mnist": {
        "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
        "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
        "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
    },
}
"""md5 of the canonical gzipped IDX files."""

_BLOCK = 1 << 20
_TIMEOUT_S = 60.0

# Indirection so tests can replace the opener; never called with anything but a URL string.
_urlopen: Callable[..., Any] = urllib.request.urlopen


def md5_of(path: str | Path) -> str:
    """Hex md5 of a file, read in 1 MiB blocks."""
    h = hashlib.md5()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


class _DownloadFailed(Exception):
    """One mirror failed; the message says why."""


def _fetch(url: str, dest: Path, expected_md5: str, on_event: EventFn) -> None:
    """Download ``url`` to ``dest`` via a temporary file in the same folder; check the md5."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        h = hashlib.md5()
        try:
            with os.fdopen(fd, "wb") as out, _urlopen(url, timeout=_TIMEOUT_S) as resp:
                length = resp.headers.get("Content-Length") if resp.headers else None
                total = int(length) if length and str(length).isdigit() else None
                done = 0
                emit(on_event, "download", url=url, done=0, total=total)
                while True:
                    block = resp.read(_BLOCK)
                    if not block:
                        break
                    out.write(block)
                    h.update(block)
                    done += len(block)
                    emit(on_event, "download", url=url, done=done, total=total)
        except (OSError, ValueError, http.client.HTTPException) as e:
            reason = getattr(e, "reason", None) or e
            raise _DownloadFailed(f"{url}: {reason}") from None
        got = h.hexdigest()
        if expected_md5 and got != expected_md5:
            raise _DownloadFailed(f"{url}: md5 mismatch (got {got}, expected {expected_md5})")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _missing_folders(folder: Path) -> list[Path]:
    """``folder`` and those of its parents that do not exist yet, deepest first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _remove_empty(folders: Sequence[Path]) -> None:
    """Remove ``folders`` (deepest first) while they are empty; a non-empty one stops it."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def download_file(
    remote: Remote,
    dest_dir: str | Path,
    *,
    looked_in: Sequence[str | Path] = (),
    what: str = "the dataset",
    on_event: EventFn = None,
) -> Path:
    """Download ``remote`` into ``dest_dir`` (created if needed) and return the file's path.

    Mirrors are tried in order. The file appears under its final name only after its md5
    matched, so an interrupted download never leaves a file that looks complete. If the file
    is already there with the right md5 it is reused. When every mirror fails, the folders
    this call created are removed again (those still empty) and :class:`DataError` says why,
    where the data was looked for (``looked_in``) and how to provide ``what`` by hand.
    """
    dest_dir = Path(dest_dir)
    dest = dest_dir / remote.filename
    if dest.is_file() and (not remote.md5 or md5_of(dest) == remote.md5):
        return dest
    where = ", ".join(str(p) for p in looked_in) or str(dest_dir)
    created = _missing_folders(dest_dir)
    try:
        dest_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _remove_empty(created)
        raise DataError(
            f"cannot create {dest_dir} to download {what} ({e.strerror or e}); looked in: "
            f"{where}; put {what} there yourself or choose another data dir (CAPSCTL_DATA)"
        ) from None
    reasons: list[str] = []
    for url in remote.urls:
        try:
            _fetch(url, dest, remote.md5, on_event)
        except _DownloadFailed as e:
            reasons.append(str(e))
            continue
        except OSError as e:  # e.g. cannot create the temporary file (read-only folder)
            reasons.append(f"{url}: cannot write into {dest_dir}: {e.strerror or e}")
            continue
        emit(on_event, "downloaded", url=url, path=str(dest))
        return dest
    _remove_empty(created)
    raise DataError(
        f"could not download {what} ({'; '.join(reasons)}); looked in: {where}; download "
        f"{remote.filename} yourself into one of those folders or set CAPSCTL_DATA to a folder "
        "that holds the data"
    )


def _safe_member_path(dest: Path, member: tarfile.TarInfo, archive: Path) -> Path | None:
    """The extraction target of a tar member, or ``None`` to skip; DataError if unsafe."""
    name = PurePosixPath(member.name)
    if member.issym() or member.islnk() or not (member.isfile() or member.isdir()):
        raise DataError(
            f"refusing to extract {archive}: member {member.name!r} is a link or special file; "
            "delete the archive and download it again"
        )
    if name.is_absolute() or ".." in name.parts or "\\" in member.name:
        raise DataError(
            f"refusing to extract {archive}: member {member.name!r} points outside the target "
            "folder; delete the archive and download it again"
        )
    parts = [p for p in name.parts if p not in ("", ".")]
    if not parts:
        return None
    target = dest.joinpath(*parts)
    root = dest.resolve()
    resolved = target.resolve()
    if resolved != root and root not in resolved.parents:
        raise DataError(
            f"refusing to extract {archive}: member {member.name!r} resolves outside {dest}; "
            "delete the archive and download it again"
        )
    return target


def extract_tar(archive: str | Path, dest: str | Path, *, on_event: EventFn = None) -> list[Path]:
    """Extract a (possibly compressed) tar archive into ``dest``, refusing anything unsafe.

    Only regular files and folders are extracted; absolute names, ``..`` components, links
    and device files make the whole extraction fail with :class:`DataError` before anything
    is written. Files get default permissions (no modes, owners or times from the archive).
    Returns the extracted files.
    """
    archive, dest = Path(archive), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    try:
        with tarfile.open(archive, "r:*") as tar:
            members = tar.getmembers()
            plan = [(m, _safe_member_path(dest, m, archive)) for m in members]
            for member, target in plan:
                if target is None:
                    continue
                if member.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(member)
                if src is None:  # pragma: no cover - isfile() members always have data
                    continue
                tmp = target.with_name(f".{target.name}.part")
                with src, tmp.open("wb") as out:
                    shutil.copyfileobj(src, out, _BLOCK)
                os.replace(tmp, target)
                written.append(target)
                emit(on_event, "extract", path=str(target))
    except (tarfile.TarError, EOFError) as e:
        raise DataError(
            f"cannot extract {archive} ({e}); delete it and download it again"
        ) from None
    except OSError as e:
        raise DataError(
            f"cannot extract {archive} into {dest} ({e.strerror or e}); check free space and "
            "permissions"
        ) from None
    return written
