"""capsctl robustness given odd input: a damaged --resume-file, an empty --attack, a repeated eps,
magnitudes outside their shift's range, --png with nothing or only corruptions to draw; and the
footnote naming the loss the attacks used."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import run_cli

from capsctl.errors import UsageError
from capsctl.robustness.results import CorruptionRow, RobustnessResult
from capsctl.robustness.store import HEADER, PointStore

HEAD = json.dumps(HEADER, sort_keys=True).encode() + b"\n"
FAST = ["--attack", "fgsm", "--eps", "8/255", "--limit", "4", "--device", "cpu"]


@pytest.mark.parametrize(
    ("content", "advice"),
    [
        (b"\x89PNG\r\n\x1a\n\x00\xff binary junk", "pick another name"),  # not ours: kept
        (HEAD + b'{"checkpoint": [], "setting": 1, "result": "x"}\n', "delete it"),
        (HEAD + b'{"checkpoint": {"path": "a"}, "setting": {}}\n', "delete it"),
        (HEAD + b"[1, 2, 3]\n", "delete it"),
        (HEAD + b"null\n", "delete it"),
        (HEAD + b'{"checkpoint": {}, "setting": {}, "result": {}}\n\xff\xfe\n', "delete it"),
    ],
    ids=["binary", "wrong-types", "missing-key", "a-list", "null", "not-utf-8"],
)
def test_a_damaged_resume_file_is_one_line_naming_it(
    tmp_path: Path, content: bytes, advice: str
) -> None:
    kept = tmp_path / "kept.jsonl"
    kept.write_bytes(content)
    with pytest.raises(UsageError) as info:
        PointStore(kept)
    message = str(info.value)
    assert str(kept) in message and "\n" not in message and len(message) < 300
    assert advice in message, message
    assert kept.read_bytes() == content  # left as it was


@pytest.mark.parametrize(
    "damage",
    [
        lambda r: r | {"accuracy": "high"},
        lambda r: {k: v for k, v in r.items() if k != "count"},
        lambda r: r | {"eps": None},
    ],
    ids=["a-string", "missing", "null"],
)
def test_a_damaged_kept_result_is_one_line_naming_the_file(
    damage: Callable[[dict], dict],
    tiny_checkpoint: Callable[..., Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ckpt, kept = str(tiny_checkpoint()), tmp_path / "kept.jsonl"
    args = ["robustness", ckpt, *FAST, "--steps", "1", "--resume-file", str(kept), "--json"]
    assert run_cli(capsys, args)[0] == 0
    head, line = kept.read_text().splitlines()
    doc = json.loads(line)
    doc["result"] = damage(doc["result"])
    kept.write_text(f"{head}\n{json.dumps(doc)}\n")
    code, out, err = run_cli(capsys, args)
    assert code == 2 and out == ""
    (message,) = err.strip().splitlines()
    assert str(kept) in message and "delete it" in message and "Traceback" not in err


def test_the_footnote_names_the_loss_the_attacks_used(
    tiny_checkpoint: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = str(tiny_checkpoint())
    code, out, err = run_cli(capsys, ["robustness", ckpt, *FAST, "--loss", "cw"])
    assert code == 0, err
    note = next(line for line in err.splitlines() if "attacks:" in line)
    assert "Carlini" in note and "own loss" not in note, note
    code, _, err = run_cli(capsys, ["robustness", ckpt, *FAST])
    note = next(line for line in err.splitlines() if "attacks:" in line)
    assert "own loss" in note, note


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--attack", ""], "--attack '': an empty name"),
        (["--attack", "fgsm,,pgd"], "--attack fgsm,,pgd: an empty name"),
        (["--shift", "affine", "--magnitudes", "2"], "--magnitudes 2: expected numbers in [0, 1]"),
        (["--shift", "translate", "--magnitudes", "100"], "in [0, 64]"),
        (["--magnitudes", "15"], "--magnitudes needs --shift"),
        (["--attack", "none", "--png", "pics"], "--png pics: nothing to draw"),
    ],
)
def test_odd_options_are_refused_in_one_line_before_any_work(
    args: list[str], needle: str, tiny_checkpoint: Callable[..., Path], capsys
) -> None:
    code, out, err = run_cli(capsys, ["robustness", str(tiny_checkpoint()), *args])
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert needle in line, line


def test_a_repeated_eps_or_attack_is_measured_once(
    tiny_checkpoint: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["robustness", str(tiny_checkpoint()), "--attack", "fgsm,fgsm", "--eps",
            "8/255,2/255,8/255", "--limit", "4", "--device", "cpu", "--json"]  # fmt: skip
    code, out, err = run_cli(capsys, args)
    assert code == 0, err
    (result,) = json.loads(out)["results"]
    assert [(p["attack"], p["eps"] * 255) for p in result["attacks"]] == [
        ("fgsm", pytest.approx(8.0)),
        ("fgsm", pytest.approx(2.0)),
    ]


def test_corruptions_alone_draw_accuracy_against_severity(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from capsctl.robustness.plot import plot_files, plot_robustness

    result = RobustnessResult(
        checkpoint="a.safetensors", dataset="cifar10", model="cnn", count=4, clean_accuracy=0.9,
        loss_name="cross_entropy", flip=False, seed=0, steps=10, pgd_step="",
        corruptions=[CorruptionRow("fog", [0.8, 0.7, 0.6, 0.5, 0.4], 0.6, False)],
        mean_corruption_accuracy=0.6,
    )  # fmt: skip
    assert list(plot_files([result], tmp_path)) == ["severity"]
    (picture,) = plot_robustness([result], tmp_path / "pics")
    assert picture.name == "accuracy-vs-severity.png" and picture.stat().st_size > 0
