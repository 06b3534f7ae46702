"""``capsctl eval`` and evaluate_checkpoint: which data it reads, what it refuses."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli

from capsctl.data import download as dl
from capsctl.errors import CapsctlError, UsageError
from capsctl.evaluation import evaluate_checkpoint


def write_idx(path: Path, arr: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    path.write_bytes(header + arr.astype(np.uint8).tobytes())


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("network disabled in tests")

    monkeypatch.setattr(dl, "_urlopen", refuse)


def test_the_test_split_needs_only_the_test_files(
    tiny_checkpoint, tmp_path: Path, offline: None, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    (data / "mnist").mkdir(parents=True)
    rng = np.random.default_rng(0)
    write_idx(data / "mnist" / "t10k-images-idx3-ubyte", rng.integers(0, 256, (30, 28, 28)))
    write_idx(data / "mnist" / "t10k-labels-idx1-ubyte", np.arange(30) % 10)
    ckpt = tiny_checkpoint(dataset="mnist")
    result, _ = evaluate_checkpoint(ckpt, data_dir=str(data), device="cpu")
    assert result.split == "test" and result.count == 30 and len(result.classes) == 10
    code, out, err = run_cli(
        capsys, ["eval", str(ckpt), "--data-dir", str(data), "--device", "cpu"]
    )
    assert code == 0, err
    assert "test split of mnist: 30 images" in out
    with pytest.raises(CapsctlError, match="train-images-idx3-ubyte"):  # val is held out of train
        evaluate_checkpoint(ckpt, data_dir=str(data), split="val", device="cpu")


@pytest.mark.parametrize("size", ["0", "-3"])
@pytest.mark.parametrize("command", ["eval", "predict", "bench", "compare"])
def test_batch_sizes_below_one_are_usage_errors(
    tiny_checkpoint, capsys: pytest.CaptureFixture[str], command: str, size: str
) -> None:
    ckpt = str(tiny_checkpoint())
    target = {"eval": [ckpt], "predict": [ckpt, "img.png"], "bench": ["resnet18"]}
    args = [command, *target.get(command, ["caps"]), "--batch-size", size]
    code, _, err = run_cli(capsys, [*args])
    assert code == 2 and "--batch-size" in err and size in err, err
    assert "expected an integer in [1, " in err and len(err.strip().splitlines()) == 1


def test_evaluate_checkpoint_refuses_batch_size_zero(tiny_checkpoint) -> None:
    with pytest.raises(UsageError, match=r"--batch-size 0: must be >= 1"):
        evaluate_checkpoint(tiny_checkpoint(), batch_size=0, device="cpu")


def test_a_non_finite_loss_is_an_error_not_a_result(
    tiny_checkpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model that gives NaN (a broken library of compiled loops gave 10% accuracy and a bare
    NaN loss with exit code 0) must not produce a result that looks like one."""
    from capsctl.checkpoint import load_tensors, read_metadata, save_checkpoint

    ckpt = tiny_checkpoint()
    tensors = {k: v.clone() for k, v in load_tensors(ckpt).items()}
    for v in tensors.values():
        if v.is_floating_point():
            v.fill_(float("nan"))
    broken = tmp_path / "nan.safetensors"
    save_checkpoint(broken, tensors, read_metadata(ckpt))
    with pytest.raises(CapsctlError) as info:
        evaluate_checkpoint(broken, device="cpu")
    message = str(info.value)
    assert str(broken) in message and "loss" in message and "not finite" in message
    assert "CAPSCTL_NATIVE=0" in message and "\n" not in message
    code, out, err = run_cli(capsys, ["eval", str(broken), "--device", "cpu", "--json"])
    assert code == 1 and out == "", out
    assert err.count("\n") == 1 and f"error: {broken}: the loss" in err, err


def test_a_run_folder_reads_as_its_best_checkpoint(
    tiny_checkpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """eval, predict, compare, export, inspect-routing and robustness read a ``capsctl train``
    run folder alike: its best.safetensors (capsctl.checkpoint.resolve_checkpoint)."""
    import json
    import shutil

    run = tmp_path / "runs" / "try"
    run.mkdir(parents=True)
    best = shutil.copy(tiny_checkpoint(), run / "best.safetensors")
    code, out, err = run_cli(capsys, ["eval", f"{run}/", "--device", "cpu", "--json"])
    assert code == 0, err
    result, _ = evaluate_checkpoint(best, device="cpu")
    assert json.loads(out)["accuracy"] == result.accuracy
