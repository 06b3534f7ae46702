"""Training with several processes (torchrun, gloo on CPU) against a single process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import tiny_args

from capsctl.checkpoint import load_tensors
from capsctl.data import Loader, load_dataset

TINY = [
    *tiny_args(
        5,
        "--set",
        "data.augment={crop_padding: 2, hflip: true}",
        "--set",
        "train.optimizer=sgd",
        "--set",
        "train.lr=0.05",
        "--set",
        "train.schedule=constant",
    ),
    "--epochs",
    "2",
    "--json",
]


# Stated tolerance: the processes average gradients with an all-reduce, whose summation order
# differs from one process's batch mean, so weights agree to float32 rounding, not bit for bit.
TOLERANCE = 1e-4


def test_ranks_together_see_the_single_process_batches() -> None:
    ds = load_dataset("fashion-mnist-quickstart", "train")
    kw = dict(
        shuffle=True, seed=5, mean=[0.5], std=[0.5], crop_padding=2, hflip=True, drop_last=True
    )
    single = list(Loader(ds, 16, **kw))  # type: ignore[arg-type]
    ranks = [list(Loader(ds, 8, rank=r, world_size=2, **kw)) for r in range(2)]  # type: ignore[arg-type]
    assert len(ranks[0]) == len(ranks[1]) == len(single)
    for i, (x, y) in enumerate(single[:20]):
        assert torch.equal(torch.cat([ranks[0][i][0], ranks[1][i][0]]), x)
        assert torch.equal(torch.cat([ranks[0][i][1], ranks[1][i][1]]), y)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


@pytest.mark.slow
def test_two_processes_match_one_with_the_same_global_batch(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    base = [sys.executable, "-m", "capsctl", "train", "--preset", "quickstart", *TINY]
    res = subprocess.run(
        [*base, "--out", str(one)], capture_output=True, text=True, env=_env(), timeout=600
    )
    assert res.returncode == 0, res.stderr[-2000:]
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "capsctl",
        "train",
        "--preset",
        "quickstart",
        *TINY,
        "--out",
        str(two),
    ]
    res = subprocess.run(launcher, capture_output=True, text=True, env=_env(), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Grad strides do not match" not in res.stderr  # channels-last weights' gradients
    # one JSON document from rank 0 only
    doc = json.loads(res.stdout)
    assert doc["epochs_done"] == 2
    a, b = load_tensors(one / "last.safetensors"), load_tensors(two / "last.safetensors")
    worst = max((a[k] - b[k]).abs().max().item() for k in a if k.startswith("model."))
    assert worst <= TOLERANCE, worst
    lines = (two / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["epoch"] for x in lines] == [1, 2]  # rank 0 alone wrote the log
    m1 = [json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines()]
    m2 = [json.loads(x) for x in lines]
    assert abs(m1[-1]["train_loss"] - m2[-1]["train_loss"]) < 1e-3
    assert m1[-1]["val_accuracy"] == pytest.approx(m2[-1]["val_accuracy"], abs=0.01)


def test_nproc_relaunches_the_same_command_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    import capsctl.cli as cli

    seen: list[list[str]] = []
    monkeypatch.setattr(subprocess, "call", lambda cmd: seen.append(cmd) or 0)
    argv = ["capsctl", "train", "--preset", "quickstart", "--nproc", "2", "--epochs", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    cli.main(argv[1:])
    assert seen == [
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "capsctl",
            "train",
            "--preset",
            "quickstart",
            "--epochs",
            "1",
        ]
    ]


def test_one_by_one_kernels_take_the_strides_of_their_gradients() -> None:
    """DDP compares a gradient's strides with its bucket view's literally: a channels-last 1x1
    kernel kept standard strides while its gradient came back channels-last, and every step of
    `train --nproc 2` warned "Grad strides do not match bucket view strides"."""
    import torch
    from torch import nn

    from capsctl.training.distributed import _standard_strides

    model = nn.Sequential(nn.Conv2d(8, 6, 3), nn.Conv2d(6, 4, 1))  # capsule nets feed their
    # convolutions channels-last features (capsctl/layers/passes/layout.py), whatever the weights
    before = [p.detach().clone() for p in model.parameters()]
    _standard_strides(model)
    x = torch.randn(2, 8, 7, 7).contiguous(memory_format=torch.channels_last)
    model(x).sum().backward()
    for p, old in zip(model.parameters(), before, strict=True):
        assert p.grad is not None and p.grad.stride() == p.stride()
        assert torch.equal(p.detach(), old)  # the values are untouched
