"""capsctl's per-user cache folder, for what it builds and loads again (the compiled routing
loops, torch.compile's generated code): ``$CAPSCTL_CACHE``, else ``$XDG_CACHE_HOME/capsctl``
(an absolute path), else ``~/.cache/capsctl``. Empty variables count as unset, and an empty
``HOME`` is the password database's home, never ``/``. Imports nothing of capsctl."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_ENV", "cache_root", "home_folder"]

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
    except (ImportError, KeyError):
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
