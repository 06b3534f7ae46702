"""Values read from a checkpoint never size anything unchecked, and paths read from one never
say where data is read or written (issue 37: M4, M6)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import run_cli

import capsctl.models
from capsctl.checkpoint import load_tensors, read_metadata, save_checkpoint, stored_preset
from capsctl.data import download as dl
from capsctl.errors import CheckpointError

# --------------------------------------------------------------------------------------------
# Forged checkpoints (M4)
# --------------------------------------------------------------------------------------------


def forge(src: Path, dst: Path, change: Callable[[dict[str, Any]], Any]) -> Path:
    """``src`` saved again as ``dst`` with ``change`` applied to (a copy of) its metadata."""
    meta = copy.deepcopy(read_metadata(src))
    change(meta)
    save_checkpoint(dst, load_tensors(src), meta)
    return dst


def _model(meta: dict[str, Any]) -> dict[str, Any]:
    return meta["preset"]["model"]


#: Forged value -> the field the one-line error must name.
FORGED: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "huge primary_types": (lambda m: _model(m).update(primary_types=10**6), "primary_types"),
    "huge pose": (lambda m: _model(m).update(primary_dim=10**4), "primary_dim"),
    "huge layer": (lambda m: _model(m)["layers"][0].update(types=10**6), "layers[0].types"),
    "huge kernel": (lambda m: _model(m)["layers"][0].update(kernel=10**5), "layers[0].kernel"),
    "huge input": (lambda m: _model(m).update(input_size=10**5), "input_size"),
    "huge classes": (lambda m: _model(m).update(num_classes=10**9), "num_classes"),
    "many layers": (lambda m: _model(m)["layers"].extend([{}] * 10**4), "layers"),
    "huge eval batch": (
        lambda m: m["preset"]["train"].update(eval_batch_size=10**12),
        "eval_batch_size",
    ),
    "huge crop padding": (
        lambda m: m["preset"]["data"]["augment"].update(crop_padding=10**6),
        "crop_padding",
    ),
    "stored image size": (lambda m: m.update(input_size=10**6), "input_size"),
    "stored channels": (lambda m: m.update(in_channels=3), "in_channels"),
    "class names": (lambda m: m.update(classes=[str(i) for i in range(11)]), "classes"),
    "zero std": (lambda m: m.update(normalization={"mean": [0.5], "std": [0.0]}), "normalization"),
    "nan mean": (
        lambda m: m.update(normalization={"mean": [float("nan")], "std": [1.0]}),
        "normalization",
    ),
    "mean per channel": (
        lambda m: m.update(normalization={"mean": [0.1, 0.2, 0.3], "std": [1.0]}),
        "normalization",
    ),
    "negative epoch": (lambda m: m.update(epoch=-(10**9)), "epoch"),
    "wider than its tensors": (lambda m: _model(m).update(primary_types=8), "primary"),
}


def _command(which: str, ckpt: Path, image: Path) -> list[str]:
    return {
        "eval": ["eval", str(ckpt), "--device", "cpu"],
        "predict": ["predict", str(ckpt), str(image), "--device", "cpu"],
        "compare": ["compare", str(ckpt)],
        "export": ["export", str(ckpt), "--format", "safetensors", "--out", str(image) + ".st"],
        "inspect": ["inspect-routing", str(ckpt), "--random", "2"],
        "robustness": ["robustness", str(ckpt), "--device", "cpu"],
        "resume": ["train", "--resume", str(ckpt), "--out", str(image.parent / "run")],
    }[which]


@pytest.fixture
def image(tmp_path: Path) -> Path:
    from PIL import Image

    path = tmp_path / "digit.png"
    Image.fromarray(np.full((28, 28), 128, np.uint8)).save(path)
    return path


@pytest.mark.parametrize("command", ["eval", "predict"])
@pytest.mark.parametrize("case", list(FORGED))
def test_a_forged_value_is_one_line_naming_file_and_field(
    tiny_checkpoint,
    tmp_path: Path,
    image: Path,
    capsys: pytest.CaptureFixture[str],
    case: str,
    command: str,
) -> None:
    change, field = FORGED[case]
    ckpt = forge(tiny_checkpoint(), tmp_path / "forged.safetensors", change)
    code, out, err = run_cli(capsys, _command(command, ckpt, image))
    assert code == 1, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert str(ckpt) in err and field in err, err


@pytest.mark.parametrize("command", ["compare", "export", "inspect", "robustness", "resume"])
def test_every_command_checks_the_stored_values(
    tiny_checkpoint, tmp_path: Path, image: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    change, field = FORGED["huge layer"]
    ckpt = forge(tiny_checkpoint(), tmp_path / "forged.safetensors", change)
    code, _, err = run_cli(capsys, _command(command, ckpt, image))
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert str(ckpt) in err and field in err, err


def test_stored_sizes_are_checked_before_anything_real_is_built(
    tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The preset's parameter shapes are compared with the file's header on the meta device:
    a model wider than its stored tensors is never built in memory."""
    devices: list[str] = []
    real_build = capsctl.models.build_model_from_config

    def build(cfg: Any) -> torch.nn.Module:
        devices.append(torch.get_default_device().type)
        return real_build(cfg)

    monkeypatch.setattr(capsctl.models, "build_model_from_config", build)
    change, _ = FORGED["wider than its tensors"]
    ckpt = forge(tiny_checkpoint(), tmp_path / "wide.safetensors", change)
    devices.clear()
    with pytest.raises(CheckpointError, match="does not match its tensors"):
        capsctl.load_checkpoint(ckpt)
    assert devices and set(devices) == {"meta"}


@pytest.mark.parametrize("command", ["eval", "predict"])
def test_a_billion_routing_iterations_fail_fast(
    tiny_checkpoint, tmp_path: Path, image: Path, command: str
) -> None:
    """This checkpoint made ``eval`` run for hours; a subprocess with a timeout, so that a
    regression fails instead of hanging the suite."""
    forged = forge(
        tiny_checkpoint(),
        tmp_path / "iterations.safetensors",
        lambda m: _model(m)["router"].update(iterations=10**9),
    )
    env = {**os.environ, "CAPSCTL_DATA": str(tmp_path / "no-data")}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "capsctl", *_command(command, forged, image)],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            cwd=tmp_path,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"capsctl {command} of a forged checkpoint ran for over 60 s")
    assert proc.returncode == 1, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert str(forged) in proc.stderr and "router.iterations" in proc.stderr


# --------------------------------------------------------------------------------------------
# Stored paths (M6)
# --------------------------------------------------------------------------------------------


def _write_idx(path: Path, arr: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    path.write_bytes(header + arr.astype(np.uint8).tobytes())


def _mnist_test_files(root: Path) -> Path:
    (root / "mnist").mkdir(parents=True)
    rng = np.random.default_rng(0)
    _write_idx(root / "mnist" / "t10k-images-idx3-ubyte", rng.integers(0, 256, (30, 28, 28)))
    _write_idx(root / "mnist" / "t10k-labels-idx1-ubyte", np.arange(30) % 10)
    return root


@pytest.fixture
def fetches(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Where downloads were attempted (none reaches the network)."""
    seen: list[Path] = []

    def fetch(url: str, dest: Path, *args: Any, **kwargs: Any) -> None:
        seen.append(Path(dest))
        raise OSError("network disabled in tests")

    monkeypatch.setattr(dl, "_fetch", fetch)
    return seen


def test_a_stored_data_dir_never_beats_capsctl_data_nor_receives_a_download(
    tiny_checkpoint,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    fetches: list[Path],
) -> None:
    stored = tmp_path / "stored"  # the review saw /etc here
    stored.mkdir()
    ckpt = forge(
        tiny_checkpoint(dataset="mnist"),
        tmp_path / "stored-dir.safetensors",
        lambda m: m["preset"]["data"].update(data_dir=str(stored), download=True),
    )
    monkeypatch.setenv("CAPSCTL_DATA", str(_mnist_test_files(tmp_path / "env-data")))
    code, out, err = run_cli(capsys, ["eval", str(ckpt), "--device", "cpu", "--json"])
    assert code == 0, err
    assert '"count": 30' in out and not fetches

    # Neither --data-dir nor CAPSCTL_DATA: the user's cache decides, never the stored path.
    monkeypatch.delenv("CAPSCTL_DATA")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    code, _, err = run_cli(capsys, ["eval", str(ckpt), "--device", "cpu"])
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert fetches and all((tmp_path / "cache") in p.parents for p in fetches), fetches
    assert list(stored.iterdir()) == []


def test_the_stored_preset_carries_no_data_dir(tiny_checkpoint, tmp_path: Path) -> None:
    """Every reader of a stored preset (eval, robustness, inspect, export's check images,
    ``train --resume``) goes through stored_preset."""
    from capsctl.training.resume import load_resume_preset

    ckpt = forge(
        tiny_checkpoint(),
        tmp_path / "stored-dir.safetensors",
        lambda m: m["preset"]["data"].update(data_dir="/etc"),
    )
    assert stored_preset(read_metadata(ckpt), ckpt).data.data_dir is None
    assert load_resume_preset(ckpt).data.data_dir is None
