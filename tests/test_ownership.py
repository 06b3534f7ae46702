"""A run owns its folder (capsctl/training/ownership.py and its use by the trainer): the lock,
the final test on the run's own weights, a safe --overwrite, SIGTERM, resume into a new folder,
stale temporary files, and the refusals around them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from capsctl.checkpoint import load_tensors, read_metadata
from capsctl.errors import CapsctlError, UsageError
from capsctl.training import BEST, LAST, METRICS, fit
from capsctl.training.command import parse_duration, resolve_run
from capsctl.training.ownership import LOCK_FILE, FolderBusy, RunLock, StagedReplace
from tests.test_training import tiny_preset

ROOT = Path(__file__).resolve().parents[1]


def model_weights(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_tensors(path).items() if k.startswith("model.")}


def test_a_second_run_into_a_folder_in_use_is_refused(tmp_path: Path) -> None:
    with RunLock(tmp_path / "run"), pytest.raises(FolderBusy) as info:
        fit(tiny_preset(epochs=1), tmp_path / "run")
    msg = str(info.value)
    assert str(tmp_path / "run") in msg and f"pid {os.getpid()}" in msg
    assert "choose another --out" in msg
    assert not (tmp_path / "run" / METRICS).exists()  # the refused run wrote nothing


def test_a_killed_run_leaves_no_lock_behind(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    code = (
        "import sys, time; from pathlib import Path;"
        "from capsctl.training.ownership import RunLock;"
        f"lock = RunLock(Path({str(folder)!r})).acquire();"
        "print('locked', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=_env()
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    with pytest.raises(FolderBusy):
        RunLock(folder).acquire()
    proc.kill()
    proc.wait()
    RunLock(folder).acquire().release()  # the kernel released the dead process's lock


def test_a_lock_that_created_its_folder_removes_it_when_nothing_was_written(
    tmp_path: Path,
) -> None:
    with RunLock(tmp_path / "new"):
        assert (tmp_path / "new" / LOCK_FILE).exists()
    assert not (tmp_path / "new").exists()
    with pytest.raises(CapsctlError, match="batch"):  # a failed start leaves no folder either
        fit(tiny_preset(epochs=1, batch_size=100000), tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_the_final_test_runs_on_the_runs_own_weights(tmp_path: Path) -> None:
    other = tmp_path / "other"
    fit(tiny_preset(epochs=1, seed=9), other)
    run = tmp_path / "run"

    def swap(e: dict) -> None:  # another process writes its best file into our folder
        if e["event"] == "checkpoint" and e["epoch"] == 2:
            (run / BEST).write_bytes((other / BEST).read_bytes())

    result = fit(tiny_preset(), run, on_event=swap)
    assert result.test is not None
    best = model_weights(run / BEST)
    foreign = model_weights(other / BEST)
    assert any(not torch.equal(best[k], foreign[k]) for k in best)
    assert read_metadata(run / BEST)["run_id"] == read_metadata(run / LAST)["run_id"]
    assert read_metadata(run / BEST)["test"]["accuracy"] == result.test.accuracy


def test_overwrite_keeps_the_old_run_when_the_new_one_fails_at_once(tmp_path: Path) -> None:
    fit(tiny_preset(epochs=1), tmp_path)
    before = {f: (tmp_path / f).read_bytes() for f in (LAST, BEST, METRICS, "results.json")}
    with pytest.raises(CapsctlError, match="batch"):
        fit(tiny_preset(epochs=1, batch_size=100000), tmp_path, overwrite=True)
    assert {f: (tmp_path / f).read_bytes() for f in before} == before


def test_overwrite_keeps_the_old_run_when_the_new_one_dies_before_its_first_checkpoint(
    tmp_path: Path,
) -> None:
    fit(tiny_preset(epochs=1), tmp_path)
    before = {f.name: f.read_bytes() for f in tmp_path.iterdir() if f.is_file()}

    def die(e: dict) -> None:
        if e["event"] == "step" and e["step"] == 2:
            raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        fit(tiny_preset(epochs=1, seed=5), tmp_path, overwrite=True, on_event=die)
    after = {f.name: f.read_bytes() for f in tmp_path.iterdir() if f.is_file()}
    assert {k: v for k, v in after.items() if k != LOCK_FILE} == {
        k: v for k, v in before.items() if k != LOCK_FILE
    }
    assert not (tmp_path / ".previous-run").exists()


def test_overwrite_replaces_the_old_run_once_the_new_one_has_a_checkpoint(tmp_path: Path) -> None:
    fit(tiny_preset(epochs=2), tmp_path)
    fit(tiny_preset(epochs=1, seed=5), tmp_path, overwrite=True)
    assert read_metadata(tmp_path / LAST)["epoch"] == 1
    lines = (tmp_path / METRICS).read_text().splitlines()
    assert [json.loads(x)["epoch"] for x in lines] == [1]
    assert not (tmp_path / ".previous-run").exists()


def test_staged_replace_restores_and_drops_new_files(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("old a")
    staged = StagedReplace(tmp_path, ["a.txt", "b.txt"])
    staged.stage()
    assert not (tmp_path / "a.txt").exists()
    (tmp_path / "a.txt").write_text("new a")
    (tmp_path / "b.txt").write_text("new b")
    staged.restore()
    assert (tmp_path / "a.txt").read_text() == "old a"
    assert not (tmp_path / "b.txt").exists()


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.mark.slow
def test_sigterm_saves_a_resumable_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [
        sys.executable, "-m", "capsctl", "train", "--preset", "quickstart",
        "--set", "model.primary_types=4",
        "--set", "model.layers=[{kind: conv, types: 4, pose_dim: 16, kernel: 3, stride: 2}]",
        "--set", "train.steps_per_epoch=400", "--set", "data.val_size=200",
        "--batch-size", "16", "--device", "cpu", "--epochs", "2", "--out", str(run),
    ]  # fmt: skip
    proc = subprocess.Popen(args, env=_env(), stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (run / "preset.yaml").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # into the first epoch
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "interrupted" in err and "--resume" in err
    meta = read_metadata(run / LAST)
    assert meta["epoch"] == 0 and meta["partial"]["step"] > 0


def test_resume_into_a_new_folder_carries_the_run(tmp_path: Path) -> None:
    src = tmp_path / "src"
    fit(tiny_preset(epochs=1), src)
    p, out = resolve_run(None, src / LAST, tmp_path / "new", ["train.epochs=2"])
    result = fit(p, out, resume=src / LAST)
    assert (tmp_path / "new" / BEST).exists() and result.test is not None
    lines = (tmp_path / "new" / METRICS).read_text().splitlines()
    assert [json.loads(x)["epoch"] for x in lines] == [1, 2]
    assert read_metadata(src / LAST)["epoch"] == 1  # the source run is left as it was


def test_preset_next_to_resume_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--preset quickstart with --resume.*drop --preset"):
        resolve_run("quickstart", tmp_path / LAST, None, [])


def test_stale_temporary_files_are_cleared_by_the_next_run(tmp_path: Path) -> None:
    fit(tiny_preset(epochs=1), tmp_path)
    stale = tmp_path / ".last.12345.deadbeef.tmp.safetensors"
    stale.write_bytes(b"half a checkpoint")
    p, out = resolve_run(None, tmp_path / LAST, None, ["train.epochs=2"])
    fit(p, out, resume=tmp_path / LAST)
    assert not stale.exists()


def test_zero_and_tiny_time_limits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from capsctl.training import ending

    with pytest.raises(UsageError, match="'0m': must be more than 0 seconds"):
        parse_duration("0m", "--time-limit")
    assert ending.overshoot_warning(1.05, 1.0) is None
    assert ending.overshoot_warning(600.0, None) is None
    late = ending.overshoot_warning(12.4, 1.0)
    assert late is not None and "took 12 s against its time limit of 1 s" in late
    seen: list[tuple[float, float | None]] = []

    def spy(seconds: float, limit: float | None) -> str | None:
        seen.append((seconds, limit))
        return "late"

    monkeypatch.setattr(ending, "overshoot_warning", spy)
    events: list[dict] = []
    result = fit(tiny_preset(epochs=1, time_limit=0.01), tmp_path, on_event=events.append)
    assert seen == [(result.seconds, 0.01)]
    assert "late" in [e["message"] for e in events if e["event"] == "warning"]


def test_folder_busy_is_a_capsctl_error() -> None:
    assert issubclass(FolderBusy, CapsctlError)


def test_an_unwritable_run_folder_is_one_line_before_any_data_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import capsctl.training.setup as setup

    def no_data(*a: object, **k: object) -> None:
        raise AssertionError("the data was loaded before the folder was checked")

    monkeypatch.setattr(setup, "prepare_data", no_data)
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a folder cannot be made below a file (root ignores permissions)
    with pytest.raises(CapsctlError) as info:
        fit(tiny_preset(epochs=1), blocker / "run")
    msg = str(info.value)
    assert str(blocker / "run") in msg and "choose a writable --out" in msg


def test_an_overwrite_killed_before_its_first_checkpoint_is_undone_by_the_next_run(
    tmp_path: Path,
) -> None:
    from capsctl.training.run_folder import RESOLVED_PRESET

    fit(tiny_preset(epochs=1), tmp_path)
    before = {f: (tmp_path / f).read_bytes() for f in (LAST, BEST, METRICS, RESOLVED_PRESET)}
    StagedReplace(tmp_path, [LAST, BEST, METRICS, RESOLVED_PRESET]).stage()  # then a kill:
    (tmp_path / RESOLVED_PRESET).write_text("name: the new run\n")  # only its preset was written
    events: list[dict] = []
    with pytest.raises(UsageError, match="already holds a run"):
        fit(tiny_preset(epochs=1), tmp_path, on_event=events.append)
    assert {f: (tmp_path / f).read_bytes() for f in before} == before
    assert not (tmp_path / ".previous-run").exists()
    assert any("put back the run" in e["message"] for e in events if e["event"] == "warning")


def test_an_overwrite_killed_after_its_first_checkpoint_drops_the_old_run(tmp_path: Path) -> None:
    fit(tiny_preset(epochs=1), tmp_path)
    staged = StagedReplace(tmp_path, [LAST, BEST, METRICS])
    staged.stage()
    (tmp_path / LAST).write_bytes((staged.parked / LAST).read_bytes())  # type: ignore[operator]
    from capsctl.training.ownership import recover_parked

    assert recover_parked(tmp_path, [LAST, BEST, METRICS]) is not None
    assert not (tmp_path / ".previous-run").exists() and (tmp_path / LAST).exists()
    assert recover_parked(tmp_path, [LAST]) is None
