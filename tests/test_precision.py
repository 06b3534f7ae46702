"""train.amp: bf16 autocast on, off, or where the device trains faster in bf16 (auto, the
default), and the line that starts training saying which and why (capsctl/devices.py)."""

from __future__ import annotations

import json
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


def test_auto_is_bf16_where_the_device_trains_faster_in_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert devices.resolve_amp(True, CPU) == (True, "bf16 autocast (train.amp: true)")
    assert devices.resolve_amp(False, CPU) == (False, "float32 (train.amp: false)")
    monkeypatch.setattr(devices, "cpu_bf16_units", lambda: "amx")
    assert devices.resolve_amp("auto", CPU) == (
        True,
        "bf16 autocast (train.amp: auto; the cpu has AMX)",
    )
    # AVX-512 BF16 alone: native bf16, but slower than float32 (measured), so float32
    monkeypatch.setattr(devices, "cpu_bf16_units", lambda: "avx512_bf16")
    assert devices.native_bf16(CPU)
    assert devices.resolve_amp("auto", CPU) == (
        False,
        "float32 (train.amp: auto; the cpu has no AMX, so bf16 trains slower)",
    )
    monkeypatch.setattr(devices, "cpu_bf16_units", lambda: "")
    assert not devices.native_bf16(CPU)
    assert devices.resolve_amp("auto", CPU) == (
        False,
        "float32 (train.amp: auto; the cpu has no native bf16)",
    )
    assert devices.native_bf16(torch.device("meta")) is False
    assert devices.faster_in_bf16(torch.device("meta")) == (False, "the meta has no native bf16")


def test_this_cpus_units_are_named() -> None:
    assert devices.cpu_bf16_units() in ("amx", "avx512_bf16", "")


def test_auto_is_the_default_of_every_preset_that_does_not_pin_a_precision() -> None:
    assert load_preset("quickstart").train.amp == "auto"
    assert load_preset("cifar10-caps-fast").train.amp == "auto"
    # the frozen copy the comparison suite trains keeps the precision of the day it was frozen
    assert load_preset("cifar10-caps-fast-pinned").train.amp is False


def test_amp_and_no_amp_flags_are_both_overrides() -> None:
    assert flag_overrides(amp=True) == ["train.amp=true"]
    assert flag_overrides(amp=False) == ["train.amp=false"]
    assert flag_overrides(amp=None) == []
    assert flag_overrides(deterministic=False) == []  # other flags: False is "not given"


def test_the_line_that_starts_training_says_the_precision(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(devices, "cpu_bf16_units", lambda: "")
    args = ["train", "--preset", "quickstart", *tiny_args(1), "--epochs", "1"]
    code, _, err = run_cli(capsys, [*args, "--set", "train.amp=auto", "--out", str(tmp_path / "a")])
    assert code == 0, err
    assert "precision: float32 (train.amp: auto; the cpu has no native bf16)" in err
    code, _, err = run_cli(capsys, [*args, "--amp", "--out", str(tmp_path / "b")])
    assert code == 0, err
    assert "precision: bf16 autocast (train.amp: true)" in err
    # each epoch's record keeps the precision it trained in (auto says nothing by itself)
    for run, precision in (("a", "float32"), ("b", "bf16")):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        history = [json.loads(line) for line in lines]
        assert [h["precision"] for h in history] == [precision]


@pytest.mark.parametrize(("flag", "amp"), [("--amp", True), ("--no-amp", False)])
def test_bench_takes_trains_precision_flags(
    capsys: pytest.CaptureFixture[str], flag: str, amp: bool
) -> None:
    import json

    args = ["bench", "mnist-caps", "--batch-size", "2", "--iters", "1", "--warmup", "0"]
    code, out, err = run_cli(capsys, [*args, flag, "--json"])
    assert code == 0, err
    assert [r["amp"] for r in json.loads(out)["rows"]] == [amp]


@pytest.mark.parametrize(("units", "amp"), [("amx", True), ("avx512_bf16", False), ("", False)])
def test_bench_follows_auto_by_default(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, units: str, amp: bool
) -> None:
    import json

    monkeypatch.setattr(devices, "cpu_bf16_units", lambda: units)
    args = ["bench", "mnist-caps", "--batch-size", "2", "--iters", "1", "--warmup", "0", "--json"]
    code, out, err = run_cli(capsys, args)
    assert code == 0, err
    assert [r["amp"] for r in json.loads(out)["rows"]] == [amp]
