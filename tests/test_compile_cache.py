"""capsctl/compile_cache.py: ``torch.compile`` (TorchInductor) keeps and loads its generated code
only in a folder of this user's that others cannot write to, never the shared
``$TMPDIR/torchinductor_<user>`` where another user could plant it (issue 26, finding 3)."""

from __future__ import annotations

import getpass
import os
import stat
import tempfile
from pathlib import Path

import pytest
from conftest import run_cli
from test_training import tiny_preset

from capsctl.compile_cache import COMPILE_CACHE_ENV, use_private_compile_cache
from capsctl.errors import CapsctlError
from capsctl.training import fit


@pytest.fixture
def shared_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A shared temporary folder holding the folder TorchInductor would use, planted by
    someone else (anyone may write to it), and a private cache of capsctl's."""
    temp = tmp_path / "temp"
    planted = temp / f"torchinductor_{getpass.getuser()}"
    planted.mkdir(parents=True)
    planted.chmod(0o777)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.delenv(COMPILE_CACHE_ENV, raising=False)
    monkeypatch.setenv("CAPSCTL_CACHE", str(tmp_path / "cache"))
    return planted


def test_torch_compile_uses_a_private_folder_not_the_shared_temporary_one(
    shared_temp: Path, tmp_path: Path
) -> None:
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    assert Path(default_cache_dir()) == shared_temp  # what torch would load from unasked
    folder = use_private_compile_cache()
    assert folder == tmp_path / "cache" / "inductor"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert Path(cache_dir()) == folder and os.environ[COMPILE_CACHE_ENV] == str(folder)
    os.environ[COMPILE_CACHE_ENV] = str(shared_temp)  # as torch leaves it once it has compiled
    assert use_private_compile_cache() == folder
    os.environ[COMPILE_CACHE_ENV] = str(tmp_path / "mine")
    assert use_private_compile_cache() == tmp_path / "mine"


def test_training_with_compile_points_the_cache_away_before_any_data_loads(
    shared_temp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import capsctl.training.setup as setup

    seen: list[str | None] = []

    def no_data(*a: object, **k: object) -> None:
        seen.append(os.environ.get(COMPILE_CACHE_ENV))
        raise CapsctlError("stop here")

    monkeypatch.setattr(setup, "prepare_data", no_data)
    with pytest.raises(CapsctlError, match="stop here"):
        fit(tiny_preset(compile=True), tmp_path / "run")
    assert seen == [str(tmp_path / "cache" / "inductor")]


def test_bench_with_compile_points_the_cache_away(
    shared_temp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    import capsctl.bench

    seen: list[str | None] = []

    def fake_bench(*a: object, **k: object) -> list:
        seen.append(os.environ.get(COMPILE_CACHE_ENV))
        raise CapsctlError("stop here")

    monkeypatch.setattr(capsctl.bench, "run_bench", fake_bench)
    code, _, err = run_cli(capsys, ["bench", "resnet18", "--compile", "--json"])
    assert code == 1 and "stop here" in err
    assert seen == [str(tmp_path / "cache" / "inductor")]


def test_a_cache_folder_others_can_write_to_is_refused_in_one_line(
    shared_temp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    shared = tmp_path / "team-cache"  # named by the user, and anyone may write to it
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    monkeypatch.setenv(COMPILE_CACHE_ENV, str(shared))
    with pytest.raises(CapsctlError) as info:
        use_private_compile_cache()
    message = str(info.value)
    assert f"{COMPILE_CACHE_ENV}={shared}" in message and "other users" in message
    assert "chmod go-w" in message and f"unset {COMPILE_CACHE_ENV}" in message
    import capsctl.training.setup as setup

    def no_data(*a: object, **k: object) -> None:
        raise CapsctlError("the data was loaded before the cache folder was checked")

    monkeypatch.setattr(setup, "prepare_data", no_data)
    code, out, err = run_cli(
        capsys, ["train", "--preset", "quickstart", "--compile", "--out", str(tmp_path / "run")]
    )
    assert code == 1 and out == ""
    (line,) = err.strip().splitlines()
    assert line == f"error: {message}"
    assert not (tmp_path / "run").exists()


def test_a_cache_that_cannot_be_made_private_gives_a_private_temporary_folder(
    shared_temp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import logging

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("CAPSCTL_CACHE", str(blocker / "cache"))  # cannot be made
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("capsctl.compile_cache")
    logger.addHandler(handler)
    try:
        folder = use_private_compile_cache()
    finally:
        logger.removeHandler(handler)
    assert folder.parent == shared_temp.parent and folder != shared_temp
    assert folder.name.startswith("capsctl-inductor-")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    (line,) = [r.getMessage() for r in records]
    assert str(blocker / "cache" / "inductor") in line and "private temporary folder" in line


def test_the_command_line_shows_the_warning_as_one_line(
    shared_temp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """The library's log records (this warning, the compiled loops' build notice) reach the
    terminal as one ``warning:`` line each, the message verbatim."""
    import capsctl.bench

    blocker = tmp_path / "a-file[1]"
    blocker.write_text("")
    monkeypatch.setenv("CAPSCTL_CACHE", str(blocker / "cache"))  # cannot be made
    monkeypatch.setenv("CAPSCTL_NATIVE", "0")  # no compiled loops built here
    monkeypatch.setattr(capsctl.bench, "run_bench", lambda *a, **k: [])
    code, _, err = run_cli(capsys, ["bench", "resnet18", "--compile", "--json"])
    assert code == 0, err
    assert len(err.strip().splitlines()) == 1, err
    line = err.strip()
    assert line.startswith(f"warning: not keeping torch.compile's code in {blocker / 'cache'}")
