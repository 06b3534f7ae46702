"""scripts/gpu_check.py and scripts/make_gpu_check_data.py: the data that travels to a GPU
machine, the dry run that exercises every part on the CPU (so the script cannot rot), the
summary of the part files and the message on a machine without CUDA."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
SCRIPT = SCRIPTS / "gpu_check.py"


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cifar_source(root: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A tiny CIFAR-10 npz folder as the shared one is laid out: two training files (60
    images, 6 a class, shuffled), an exact and a lossy test file. Its training images and
    labels (concatenated) and its exact test images."""
    folder = root / "cifar10"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (60, 32, 32, 3), dtype=np.uint8)
    labels = rng.permutation(np.repeat(np.arange(10), 6)).astype(np.uint8)
    for i in range(2):
        part = slice(30 * i, 30 * (i + 1))
        np.savez_compressed(folder / f"train-{i}.npz", images=images[part], labels=labels[part])
    exact = rng.integers(0, 256, (12, 32, 32, 3), dtype=np.uint8)
    test_labels = (np.arange(12) % 10).astype(np.uint8)
    np.savez_compressed(folder / "test-lossless-1k.npz", images=exact, labels=test_labels)
    lossy = rng.integers(0, 256, (20, 32, 32, 3), dtype=np.uint8)
    np.savez_compressed(folder / "test-jpeg.npz", images=lossy, labels=np.zeros(20, np.uint8))
    (folder / "classes.txt").write_text("\n".join(f"c{k}" for k in range(10)) + "\n")
    return images, labels, exact


def test_the_data_for_a_gpu_machine_is_a_class_balanced_subset_capsctl_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from capsctl.data.cifar import load_cifar

    images, labels, exact = _cifar_source(tmp_path / "src")
    make = _script("make_gpu_check_data")
    monkeypatch.setenv("CAPSCTL_DATA", str(tmp_path / "src"))
    out = tmp_path / "gpu-data"
    assert make.main(["--out", str(out), "--train", "30"]) == 0

    first3 = np.sort(np.concatenate([np.flatnonzero(labels == k)[:3] for k in range(10)]))
    train, _ = load_cifar("cifar10", "train", out, None, download=False, on_event=None)
    assert np.array_equal(train.images.permute(0, 2, 3, 1).numpy(), images[first3])
    assert np.array_equal(train.labels.numpy(), labels[first3])
    assert train.classes == [f"c{k}" for k in range(10)]
    test, _ = load_cifar("cifar10", "test", out, None, download=False, on_event=None)
    assert test.name == "cifar10[test-lossless-1k]"
    assert np.array_equal(test.images.permute(0, 2, 3, 1).numpy(), exact)
    with np.load(out / "cifar10" / "train.npz") as z:
        assert sorted(z.files) == ["images", "labels"]
        assert z["images"].dtype == np.uint8 and z["labels"].dtype == np.uint8
    manifest = json.loads((out / "cifar10" / "subset.json").read_text())
    assert manifest["train"]["images"] == 30 and manifest["train"]["of"] == 60
    assert manifest["test"]["images"] == 12

    before = (out / "cifar10" / "train.npz").read_bytes()
    assert make.main(["--data", str(tmp_path / "src"), "--out", str(out), "--train", "30"]) == 0
    assert (out / "cifar10" / "train.npz").read_bytes() == before  # same input, same bytes


def test_the_data_script_refuses_lossy_test_images_and_too_many_training_images(
    tmp_path: Path,
) -> None:
    _cifar_source(tmp_path / "src")
    make = _script("make_gpu_check_data")
    args = ["--data", str(tmp_path / "src"), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit, match="class .* has only 6"):
        make.main([*args, "--train", "70"])
    (tmp_path / "src" / "cifar10" / "test-lossless-1k.npz").unlink()
    with pytest.raises(SystemExit, match="not exact"):
        make.main([*args, "--train", "30"])


@pytest.mark.slow
def test_dry_run_measures_every_model_and_trains_both_recipes(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(out.read_text())
    names = {(r["setting"], r["name"]) for r in report["bench"]}
    for setting in ("fp32", "bf16+cl"):
        for model in (
            "resnet18",
            "cifar10-caps",
            "cifar10-caps-simple (concurrent)",
            "cifar10-caps-simple (sequential)",
        ):
            assert (setting, model) in names
    assert all(r["train_step_s"] > 0 for r in report["bench"])
    assert [c["chunk_mib"] for c in report["chunks"]] == [4, 16, 64, 256]
    runs = {r["preset"]: r for r in report["training"]}
    assert set(runs) == {"cifar10-caps-fast", "cifar10-caps"}
    for r in runs.values():
        assert r["epochs"] == 1 and 0.0 <= r["test_accuracy"] <= 1.0
    assert "1. training step" in res.stdout and "3. training" in res.stdout


def test_without_cuda_and_without_dry_run_it_says_what_to_do() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the script would run the full check")
    res = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "--dry-run" in res.stdout
