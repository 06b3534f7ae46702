"""capsctl/user_cache.py: where capsctl's per-user cache lives, the home folder it is found
from (also the datasets' default folder), and the one privacy check of a folder or file that
code is loaded from (the compiled loops, torch.compile's cache)."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from capsctl.data.sources import resolve_data_dir
from capsctl.user_cache import cache_root, home_folder, not_private


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("CAPSCTL_CACHE", "XDG_CACHE_HOME", "CAPSCTL_DATA"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_cache_folder_follows_capsctl_cache_then_xdg_then_home(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clean_env.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home/.cache/capsctl"
    clean_env.setenv("XDG_CACHE_HOME", "relative/cache")  # not absolute: ignored, as XDG says
    assert cache_root() == tmp_path / "home/.cache/capsctl"
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg/capsctl"
    clean_env.setenv("CAPSCTL_CACHE", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
    clean_env.setenv("CAPSCTL_CACHE", "  ")  # empty counts as unset
    assert cache_root() == tmp_path / "xdg/capsctl"


def test_an_empty_home_is_the_password_databases_home_never_the_root(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv("HOME", "")
    own = pwd.getpwuid(os.getuid()).pw_dir
    assert home_folder() == own
    assert cache_root() == Path(own) / ".cache/capsctl"
    # the datasets' default folder takes the same home
    assert resolve_data_dir(None) == Path(own) / ".cache/capsctl/data"


def test_not_private_accepts_only_this_users_unshared_folders_and_files(tmp_path: Path) -> None:
    folder = tmp_path / "lib"
    folder.mkdir(mode=0o700)
    library = folder / "loops.so"
    library.write_bytes(b"\x7fELF")
    library.chmod(0o600)
    assert not_private(folder) is None
    assert not_private(library, folder=False) is None
    assert not_private(library) == "is not a folder"
    assert not_private(folder, folder=False) == "is not a regular file"
    assert (not_private(tmp_path / "absent") or "").startswith("cannot be read")
    folder.chmod(0o770)
    assert not_private(folder) == "can be written by other users (mode 770)"
    library.chmod(0o602)
    assert not_private(library, folder=False) == "can be written by other users (mode 602)"
