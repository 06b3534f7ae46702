"""train.amp: bf16 autocast on, off, or where the device computes bf16 natively (auto), and the
line that starts training saying which and why (capsctl/devices.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_cli
from tiny import tiny_args

from capsctl import devices
from capsctl.config import load_preset
from capsctl.errors import ConfigError
from capsctl.training.command import flag_overrides

CPU = torch.device("cpu")


def test_amp_takes_true_false_or_auto() -> None:
    for text, value in [("true", True), ("false", False), ("auto", "auto")]:
        assert load_preset("quickstart", [f"train.amp={text}"]).train.amp == value
    with pytest.raises(ConfigError, match="train.amp"):
        load_preset("quickstart", ["train.amp=maybe"])


def test_auto_follows_the_devices_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    assert devices.resolve_amp(True, CPU) == (True, "bf16 autocast (train.amp: true)")
    assert devices.resolve_amp(False, CPU) == (False, "float32 (train.amp: false)")
    monkeypatch.setattr(devices, "native_bf16", lambda device: True)
    on, why = devices.resolve_amp("auto", CPU)
    assert on and why == "bf16 autocast (train.amp: auto; the cpu has native bf16)"
    monkeypatch.setattr(devices, "native_bf16", lambda device: False)
    on, why = devices.resolve_amp("auto", CPU)
    assert not on and why == "float32 (train.amp: auto; the cpu has no native bf16)"
    assert devices.native_bf16(torch.device("meta")) is False


def test_amp_and_no_amp_flags_are_both_overrides() -> None:
    assert flag_overrides(amp=True) == ["train.amp=true"]
    assert flag_overrides(amp=False) == ["train.amp=false"]
    assert flag_overrides(amp=None) == []
    assert flag_overrides(deterministic=False) == []  # other flags: False is "not given"


def test_the_line_that_starts_training_says_the_precision(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(devices, "native_bf16", lambda device: False)
    args = ["train", "--preset", "quickstart", *tiny_args(1), "--epochs", "1"]
    code, _, err = run_cli(capsys, [*args, "--set", "train.amp=auto", "--out", str(tmp_path / "a")])
    assert code == 0, err
    assert "precision: float32 (train.amp: auto; the cpu has no native bf16)" in err
    code, _, err = run_cli(capsys, [*args, "--amp", "--out", str(tmp_path / "b")])
    assert code == 0, err
    assert "precision: bf16 autocast (train.amp: true)" in err


@pytest.mark.parametrize(("flag", "amp"), [("--amp", True), ("--no-amp", False)])
def test_bench_takes_trains_precision_flags(
    capsys: pytest.CaptureFixture[str], flag: str, amp: bool
) -> None:
    import json

    args = ["bench", "mnist-caps", "--batch-size", "2", "--iters", "1", "--warmup", "0"]
    code, out, err = run_cli(capsys, [*args, flag, "--json"])
    assert code == 0, err
    assert [r["amp"] for r in json.loads(out)["rows"]] == [amp]
