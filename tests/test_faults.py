"""Bad input gets one line and the right exit code; killed runs leave complete files and resume."""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli
from safetensors.torch import save_file
from tiny import tiny_args

from capsctl.checkpoint import load_checkpoint, load_tensors, read_metadata
from capsctl.cli import main

TINY = tiny_args(4)


@pytest.fixture(scope="module")
def good_ckpt(tiny_trained_run: Path) -> Path:
    """A good checkpoint: the session's tiny run's (tests/conftest.py)."""
    return tiny_trained_run / "best.safetensors"


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("touch /tmp/capsctl-pwned",))


def _cifar_folder(tmp: Path, evil: bool) -> Path:
    folder = tmp / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    batch = {b"data": np.zeros((4, 3072), np.uint8), b"labels": [0, 1, 2, 3]}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(folder / name, "wb") as f:
            pickle.dump(_Evil() if evil and name == "data_batch_1" else batch, f, protocol=2)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [f"c{i}".encode() for i in range(10)]}, f, protocol=2)
    return tmp


def _imagefolder(tmp: Path) -> str:
    from PIL import Image

    for split in ("train", "test"):
        for cls in ("a", "b"):
            d = tmp / "imgs" / split / cls
            d.mkdir(parents=True)
            for i in range(3):
                Image.fromarray(np.full((28, 28), 40 * i, np.uint8)).save(d / f"{i}.png")
    (tmp / "imgs" / "train" / "a" / "broken.png").write_bytes(b"not a png")
    return f"imagefolder:{tmp / 'imgs'}"


def _yaml(tmp: Path, text: str) -> str:
    p = tmp / "p.yaml"
    p.write_text(text)
    return str(p)


def _mismatched(tmp: Path, good: Path) -> Path:
    tensors = load_tensors(good)
    meta = read_metadata(good)
    tensors.pop(next(k for k in tensors if k.startswith("model.")))
    from capsctl.checkpoint import save_checkpoint

    dst = tmp / "mismatch.safetensors"
    save_checkpoint(dst, tensors, meta)
    return dst


def _foreign(tmp: Path) -> Path:
    dst = tmp / "foreign.safetensors"
    save_file({"w": torch.zeros(2)}, str(dst))
    return dst


def _truncated(tmp: Path, good: Path) -> Path:
    data = good.read_bytes()
    return _write(tmp / "trunc.safetensors", data[: len(data) // 2])


Case = Callable[[Path, Path], list[str]]

CASES: dict[str, tuple[Case, int, str]] = {
    "corrupt checkpoint": (
        lambda t, g: ["eval", str(_write(t / "c.safetensors", os.urandom(300)))],
        1,
        "c.safetensors",
    ),
    "truncated checkpoint": (lambda t, g: ["eval", str(_truncated(t, g))], 1, "trunc.safetensors"),
    "foreign safetensors": (lambda t, g: ["eval", str(_foreign(t))], 1, "not written by capsctl"),
    "pickle checkpoint": (
        lambda t, g: ["eval", str(_write(t / "m.pt", b"PK\x03\x04" + b"\0" * 100))],
        1,
        "m.pt",
    ),
    "metadata does not match tensors": (
        lambda t, g: ["eval", str(_mismatched(t, g))],
        1,
        "does not match its tensors",
    ),
    "yaml syntax error": (
        lambda t, g: ["train", "--preset", _yaml(t, "train: {epochs: 3\n")],
        2,
        "p.yaml",
    ),
    "unknown key": (
        lambda t, g: ["train", "--preset", _yaml(t, "train: {epoch: 3}\n")],
        2,
        "train.epoch",
    ),
    "wrong type": (
        lambda t, g: ["train", "--preset", _yaml(t, "train: {epochs: many}\n")],
        2,
        "train.epochs",
    ),
    "out of range (yaml)": (
        lambda t, g: ["train", "--preset", _yaml(t, "model: {base: mnist-caps, dropout: 2}\n")],
        2,
        "model.dropout",
    ),
    "out of range (--set)": (
        lambda t, g: ["train", "--preset", "quickstart", "--set", "train.momentum=1.5"],
        2,
        "train.momentum",
    ),
    "out of range (flag)": (
        lambda t, g: ["train", "--preset", "quickstart", "--epochs", "0"],
        2,
        "--epochs 0",
    ),
    "unknown preset": (lambda t, g: ["train", "--preset", "no-such-preset"], 2, "unknown preset"),
    "unknown model": (
        lambda t, g: ["train", "--preset", _yaml(t, "model: no-such-model\n")],
        2,
        "unknown model",
    ),
    "missing dataset": (
        lambda t, g: [
            "train",
            "--preset",
            "mnist-caps",
            "--data-dir",
            str(t / "empty"),
            "--set",
            "data.download=false",
        ],
        1,
        "mnist",
    ),
    "malformed dataset file": (lambda t, g: _malformed_idx(t), 1, "train-images"),
    "pickle that asks for code": (
        lambda t, g: [
            "train",
            "--preset",
            "cifar10-caps-simple",
            "--data-dir",
            str(_cifar_folder(t, evil=True)),
            "--set",
            "data.download=false",
            "--set",
            "data.val_size=0",
        ],
        1,
        "refuses",
    ),
    "unreadable image in a folder": (
        lambda t, g: [
            "train",
            "--preset",
            "quickstart",
            "--set",
            f"data.dataset={_imagefolder(t)}",
            "--out",
            str(t / "run"),
        ],
        1,
        "broken.png",
    ),
    "output folder holds a run": (
        lambda t, g: ["train", "--preset", "quickstart", "--out", str(g.parent)],
        2,
        "already holds a run",
    ),
    "export path not writable": (
        lambda t, g: [
            "export",
            str(g),
            "--format",
            "safetensors",
            "--out",
            str(t / "missing" / "x.safetensors"),
        ],
        1,
        "x.safetensors",
    ),
}


def _malformed_idx(tmp: Path) -> list[str]:
    d = tmp / "mnist"
    d.mkdir(parents=True)
    for name in (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ):
        (d / name).write_bytes(b"\x00\x00\x08\x03garbage")
    return [
        "train",
        "--preset",
        "mnist-caps",
        "--data-dir",
        str(tmp),
        "--set",
        "data.download=false",
    ]


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line(
    case: str, capsys: pytest.CaptureFixture[str], tmp_path: Path, good_ckpt: Path
) -> None:
    make, code, needle = CASES[case]
    args = make(tmp_path, good_ckpt)
    got, _, err = run_cli(capsys, args)
    assert got == code, err
    assert needle in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    assert not Path("/tmp/capsctl-pwned").exists()


def test_full_disk_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    main(["train", "--preset", "quickstart", *TINY, "--epochs", "1", "--out", str(out), "--json"])
    capsys.readouterr()
    before = (out / "last.safetensors").read_bytes()
    import capsctl.checkpoint.format as ck

    def full(*a: object, **k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ck, "_write_all", full)
    best_before = (out / "best.safetensors").read_bytes()
    code, _, err = run_cli(
        capsys, ["train", "--resume", str(out / "last.safetensors"), "--epochs", "2", "--json"]
    )
    assert code == 1 and "No space left on device" in err and "previous file is unchanged" in err
    assert len(err.strip().splitlines()) == 1
    assert (out / "last.safetensors").read_bytes() == before
    assert (out / "best.safetensors").read_bytes() == best_before
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_non_finite_loss_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loss that turns non-finite (here made so: --lr is held below absurd values that did
    it before)."""
    import capsctl.training.setup as setup

    real = setup.make_loss

    def exploding(*args: object) -> Callable[..., torch.Tensor]:
        loss = real(*args)  # type: ignore[arg-type]
        return lambda logits, y, progress: loss(logits, y, progress) * float("inf")

    monkeypatch.setattr(setup, "make_loss", exploding)
    code, _, err = run_cli(
        capsys,
        ["train", "--preset", "quickstart", *TINY, "--epochs", "1", "--out", str(tmp_path),
         "--json"],
    )  # fmt: skip
    assert code == 1 and "loss became" in err and "step" in err
    assert len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------
# Signals


def _cmd(out: Path, resume: bool) -> list[str]:
    base = [sys.executable, "-m", "capsctl", "train"]
    if resume:
        return [*base, "--resume", str(out / "last.safetensors"), "--json"]
    return [
        *base,
        "--preset",
        "quickstart",
        *TINY,
        "--epochs",
        str(EPOCHS),
        "--set",
        "train.time_limit=null",
        "--set",
        "train.eval_batch_size=200",
        "--out",
        str(out),
        "--json",
    ]


EPOCHS = 60


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _check_final_files(out: Path) -> None:
    """Every file with a final name is complete and loadable."""
    for p in out.iterdir():
        if p.name.startswith("."):
            continue  # temporary files of an interrupted write
        if p.suffix == ".safetensors":
            load_checkpoint(p)
            load_tensors(p)
        elif p.name == "metrics.jsonl":
            for line in p.read_text().splitlines():
                json.loads(line)
        elif p.suffix == ".json":
            json.loads(p.read_text())
        elif p.suffix == ".yaml":
            from capsctl.config import load_preset

            load_preset(str(p))


def _wait_for(path: Path, proc: subprocess.Popen[str], seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while not path.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert path.exists(), f"{path.name} never appeared"


def test_sigint_while_the_data_loads_stops_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C during set-up (here: while the data loads): one line, exit 130, nothing written,
    and the same command then runs."""
    import capsctl.training.setup as trainer

    real = trainer.prepare_data

    def interrupted_while_loading(*a: object, **k: object) -> object:
        os.kill(os.getpid(), signal.SIGINT)
        return real(*a, **k)

    monkeypatch.setattr(trainer, "prepare_data", interrupted_while_loading)
    out = tmp_path / "run"
    args = ["train", "--preset", "quickstart", *TINY, "--epochs", "1", "--out", str(out), "--json"]
    code, _, err = run_cli(capsys, args)
    assert code == 130 and "interrupted before training started" in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (out / "last.safetensors").exists() and not (out / "metrics.jsonl").exists()
    monkeypatch.setattr(trainer, "prepare_data", real)
    code, _, err = run_cli(capsys, args)
    assert code == 0, err


def test_ctrl_c_before_training_exits_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A KeyboardInterrupt before training installs its handler (e.g. while torch imports) is
    one line and exit 130, not a silent 0."""
    import capsctl.training as training

    def ctrl_c(*a: object, **k: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(training, "train_from_preset", ctrl_c)
    code, _, err = run_cli(capsys, ["train", "--preset", "quickstart"])
    assert code == 130 and err.strip() == "interrupted"


@pytest.mark.parametrize("moment", ["before the first validation", "after epoch 1"])
def test_sigint_at_any_moment_leaves_a_run_that_continues(tmp_path: Path, moment: str) -> None:
    """Ctrl-C in the middle of the first epoch (nothing validated yet, no best epoch) and after
    an epoch: one line, exit 130, whole files, and the run then finishes."""
    out = tmp_path / "run"
    cmd = _cmd(out, False)
    epochs = EPOCHS
    if moment == "before the first validation":  # long epochs, so the signal lands inside one
        epochs = 2
        cmd[cmd.index("--epochs") + 1] = str(epochs)
        cmd += ["--set", "train.steps_per_epoch=400"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )
    if moment == "before the first validation":
        _wait_for(out / "preset.yaml", proc)  # written just before the first step
        time.sleep(1.0)
    else:
        _wait_for(out / "metrics.jsonl", proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert len(err.strip().splitlines()) == 1, err
    _check_final_files(out)
    assert (out / "last.safetensors").exists() and "--resume" in err
    if moment == "before the first validation":
        meta = read_metadata(out / "last.safetensors")
        assert meta["epoch"] == 0 and meta["partial"]["step"] >= 1
        assert meta["best"] == {"epoch": None, "val_accuracy": None}
        assert not (out / "metrics.jsonl").exists()
    res = subprocess.run(_cmd(out, True), capture_output=True, text=True, env=_env(), timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout)["epochs_done"] == epochs
    _check_final_files(out)


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume(tmp_path: Path) -> None:
    """Kill a real training process 10 times at random moments; files stay whole; it finishes.

    The run is set for far more epochs than ten short lives can train, so all ten kills land
    whatever the machine's speed; the last resume then shortens it to two more epochs. The first
    life runs until its first checkpoint and times the start-up (imports, data); each later life
    is killed at a random moment between 0.5x that start-up and start-up plus 4 s, so the kills
    fall both in start-up and in training (checkpoint writes included) on a fast or slow machine.
    """
    rng = random.Random(1234)
    out = tmp_path / "run"
    first = _cmd(out, False)
    first[first.index("--epochs") + 1] = "100000"
    t0 = time.monotonic()
    proc = subprocess.Popen(
        first, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env()
    )
    _wait_for(out / "preset.yaml", proc, seconds=300)
    startup = time.monotonic() - t0
    _wait_for(out / "last.safetensors", proc, seconds=300)
    time.sleep(rng.uniform(0.0, 2.0))
    proc.kill()
    proc.wait()
    _check_final_files(out)
    for kills in range(1, 10):
        assert (out / "last.safetensors").exists(), "a kill lost the run's checkpoint"
        proc = subprocess.Popen(
            _cmd(out, True),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        time.sleep(rng.uniform(0.5 * startup, startup + 4.0))
        if proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr else ""
            pytest.fail(f"the run ended before kill {kills + 1} (exit {proc.returncode}): {err}")
        proc.kill()
        proc.wait()
        _check_final_files(out)
    assert (out / "last.safetensors").exists(), "a kill lost the run's checkpoint"
    done = read_metadata(out / "last.safetensors")["epoch"]
    final = done + 2
    res = subprocess.run(
        [*_cmd(out, True), "--epochs", str(final)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    _check_final_files(out)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in lines] == list(range(1, final + 1))
    assert read_metadata(out / "last.safetensors")["epoch"] == final
