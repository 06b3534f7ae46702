"""scripts/gpu_check.py: its dry run exercises every step on the CPU, so it cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


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
