"""The time-budgeted CIFAR-10 recipe: cifar10-caps-fast (preset, model, backbone, a tiny run)."""

from __future__ import annotations

from pathlib import Path

import torch

from capsctl import build_model, load_checkpoint
from capsctl.config import load_preset
from capsctl.data.synthetic import write_random_cifar10
from capsctl.models.backbones import build_backbone
from capsctl.training import train_from_preset


def test_the_preset_is_a_capsule_network_with_a_30_minute_budget() -> None:
    p = load_preset("cifar10-caps-fast")
    assert p.model.arch == "capsnet" and p.model.backbone == "fast"
    assert p.model.router["name"] == "idpa"
    assert p.train.time_limit is not None and p.train.time_limit <= 30 * 60
    assert p.data.dataset == "cifar10"
    model = build_model("cifar10-caps-fast").eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_the_fast_backbone_leaves_a_3x3_grid_of_192_channels() -> None:
    """k2 stem (32 -> 31), then three 2x2 max-pools: 15, 7, 3."""
    with torch.no_grad():
        assert build_backbone("fast", 3)(torch.randn(1, 3, 32, 32)).shape == (1, 192, 3, 3)


def test_the_cnn_of_equal_widths_shares_the_backbone() -> None:
    caps, cnn = build_model("cifar10-caps-fast"), build_model("cifar10-cnn-fast")
    assert caps.parameter_counts()["backbone"] == cnn.parameter_counts()["backbone"]


def test_a_tiny_run_of_the_preset_trains_tests_and_reloads(tmp_path: Path) -> None:
    data = write_random_cifar10(tmp_path / "data", train=48, test=20)
    res = train_from_preset(
        "cifar10-caps-fast",
        out=tmp_path / "run",
        overrides=[
            f"data.data_dir={data}",
            "train.device=cpu",
            "train.epochs=2",
            "train.steps_per_epoch=2",
            "train.batch_size=8",
            "train.eval_batch_size=10",
        ],
        handle_sigint=False,
    )
    assert res.epochs_done == 2 and res.test is not None and res.test.count == 20
    assert not any(r.get("time_limit") for r in res.history)  # two tiny epochs fit in 30 min
    model, meta = load_checkpoint(tmp_path / "run" / "best.safetensors")
    assert meta["preset"]["model"]["backbone"] == "fast"
    assert meta["preset"]["train"]["time_limit"] == 1770
