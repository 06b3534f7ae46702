"""capsctl's per-user cache folder, for what it builds and loads again (the compiled routing
loops, torch.compile's generated code): ``$CAPSCTL_CACHE``, else ``$XDG_CACHE_HOME/capsctl``
(an absolute path), else ``~/.cache/capsctl``. Empty variables count as unset, and an empty
``HOME`` is the password database's home, never ``/``. Also the one check of a folder or file
that code is loaded from (:func:`not_private`). Imports nothing of capsctl."""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["CACHE_ENV", "cache_root", "home_folder", "not_private"]

#: Environment variable: capsctl's cache folder.
CACHE_ENV = "CAPSCTL_CACHE"


def home_folder() -> str | None:
    """The home folder: ``$HOME`` when set and not empty, else the password database's."""
    home = os.environ.get("HOME", "").strip()
    if home:
        return home
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_dir or None
    except ImportError:  # no password database (Windows): the OS's own rules
        home = os.path.expanduser("~")
        return None if home == "~" else home
    except (KeyError, OSError):
        return None


def cache_root() -> Path | None:
    """The cache folder (see the module docstring); None where there is no home folder."""
    env = os.environ.get(CACHE_ENV, "").strip()
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "capsctl"
    home = home_folder()
    return None if home is None else Path(home) / ".cache" / "capsctl"


def not_private(path: Path, *, folder: bool = True) -> str | None:
    """Why code must not be loaded from ``path`` (a folder, or a regular file when ``folder``
    is false), or None: it must be one of this user's that no other user can write to."""
    try:
        info = os.stat(path)
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if not (stat.S_ISDIR(info.st_mode) if folder else stat.S_ISREG(info.st_mode)):
        return "is not a folder" if folder else "is not a regular file"
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return f"belongs to another user (uid {info.st_uid}, you are {os.getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"can be written by other users (mode {stat.S_IMODE(info.st_mode):o})"
    return None
