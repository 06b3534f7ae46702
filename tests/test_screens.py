"""The screens of ``eval``, ``compare``, ``train``, ``suite report``, ``robustness``,
``weights`` and ``bench`` read well in a terminal of 80 columns and of 200 (issue 40, item 5):
no line is wider than the terminal, and no word is broken across lines.

Each command runs as a user runs it, in a process of its own with ``COLUMNS`` set (the
consoles take their width when capsctl is imported). A word is broken when the screen shows a
piece of it: every word (a run of letters) of a screen at 80 or 200 columns must also be a word
of the same screen at 1,000 columns, where nothing wraps (but the words a fold adds)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import ROOT
from tiny import tiny_args

#: The width at which nothing wraps: the words every narrower screen must show whole.
WIDE = 1000

#: Letters only: numbers vary from run to run (speeds, times), words do not.
_WORD = re.compile(r"[^\W\d_]+")

#: Words a narrow screen adds by design: a table too wide folds into several, each after the
#: first titled "... (continued)".
FOLDING = {"continued"}


def words(text: str) -> set[str]:
    return set(_WORD.findall(text))


def screen(args: list[str], columns: int, cwd: Path) -> str:
    """stdout then stderr of ``capsctl <args>`` in a terminal ``columns`` wide."""
    env = {**os.environ, "COLUMNS": str(columns), "NO_COLOR": "1"}
    env.pop("FORCE_COLOR", None)
    done = subprocess.run(
        [sys.executable, "-m", "capsctl", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


Screens = Callable[[list[str], Path], dict[int, str]]


@pytest.fixture
def screens() -> Screens:
    """``screens(args, cwd)``: the command's screen at 80, 200 and :data:`WIDE` columns, each
    checked: no line wider than its terminal, and no word shown in part."""

    def run(args: list[str], cwd: Path) -> dict[int, str]:
        shown = {columns: screen(args, columns, cwd) for columns in (80, 200, WIDE)}
        whole = words(shown[WIDE])
        for columns in (80, 200):
            text = shown[columns]
            long = [line for line in text.splitlines() if len(line) > columns]
            assert not long, f"lines over {columns} columns:\n" + "\n".join(long) + "\n\n" + text
            broken = words(text) - whole - FOLDING
            assert not broken, f"words broken at {columns} columns: {sorted(broken)}\n\n{text}"
        return shown

    return run


def _header_cells(text: str) -> list[str]:
    """The column headers of every table on the screen, a header on several lines joined."""
    heads: list[str] = []
    block: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith("┃"):
            block.append([c.strip() for c in line.split("┃")[1:-1]])
        elif block:
            heads += [" ".join(c for c in column if c) for column in zip(*block, strict=True)]
            block = []
    return heads


def test_eval_screen_shows_every_class_name_whole(screens: Screens, tmp_path: Path) -> None:
    shown = screens(["eval", "quickstart.idpa", "--device", "cpu"], tmp_path)
    from capsctl.data.catalog import FASHION_MNIST_CLASSES

    for columns in (80, 200):
        heads = set(_header_cells(shown[columns])) - {"class", "acc", "n"}
        assert heads == set(FASHION_MNIST_CLASSES), shown[columns]


def test_compare_screen_gives_resnet18_its_budget_beside_both_figures(
    screens: Screens, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from conftest import run_cli

    code, out, err = run_cli(capsys, ["compare", "--suite", "cifar10-fast", "--json"])
    assert code == 0, err
    resnet = next(r for r in json.loads(out)["models"] if r["name"] == "resnet18")
    measured = resnet["measured"]
    assert measured["budget"] == "matched" and measured["epochs"] is not None
    accuracy = f"{100 * measured['top1_mean']:.2f}"
    budget = f"{measured['epochs']:.1f} ep"
    published = f"{100 * resnet['reference_accuracy']:.2f}%"
    shown = screens(["compare", "--suite", "cifar10-fast"], tmp_path)
    for columns in (80, 200):
        rows = [line for line in shown[columns].splitlines() if line.startswith("│ resnet18 ")]
        cells = [[c.strip() for c in row.split("│")[1:-1]] for row in rows]
        # one row of one table: the measured accuracy with its epochs, then the published one
        assert any(
            any(accuracy in c and budget in c for c in row) and published in row for row in cells
        ), shown[columns]


def test_train_screen(screens: Screens, tmp_path: Path) -> None:
    args = ["train", "--preset", "quickstart", *tiny_args(4), "--epochs", "1"]
    screens([*args, "--out", str(tmp_path / "run"), "--overwrite"], tmp_path)


def test_suite_report_screen(screens: Screens) -> None:
    """The shipped ledger, named as from the repository's root (nothing is written)."""
    ledger = "benchmarks/suites/cifar10-fast-cpu"
    shown = screens(["suite", "report", ledger, "--no-score"], ROOT)
    assert "resnet18" in shown[80]


#: Both attacks, a shift, and few images: every table and footnote of ``robustness``, quickly.
ROBUSTNESS = ["--attack", "fgsm,pgd", "--eps", "2/255", "--steps", "2", "--limit", "32"]
ROBUSTNESS += ["--shift", "rotate", "--magnitudes", "10", "--device", "cpu"]


def test_robustness_screen_of_one_checkpoint(screens: Screens, tmp_path: Path) -> None:
    shown = screens(["robustness", "quickstart.idpa", *ROBUSTNESS], tmp_path)
    for columns in (80, 200):  # the table is titled by the name the checkpoint was given as
        assert shown[columns].startswith("quickstart.idpa: "), shown[columns]
        assert "attacks: white-box" in shown[columns]


def test_robustness_screen_side_by_side(screens: Screens, tmp_path: Path, data_root: Path) -> None:
    args = ["robustness", "cifar10-fast.idpa", "cifar10-fast.cnn", *ROBUSTNESS]
    shown = screens([*args, "--data-dir", str(data_root)], tmp_path)
    for columns in (80, 200):  # each column is headed by the name the checkpoint was given as
        assert {"cifar10-fast.idpa", "cifar10-fast.cnn"} <= set(_header_cells(shown[columns]))


def test_weights_screen(screens: Screens, tmp_path: Path) -> None:
    shown = screens(["weights"], tmp_path)
    assert "quickstart.idpa" in shown[80]


def test_bench_screen(screens: Screens, tmp_path: Path) -> None:
    shown = screens(
        ["bench", "mnist-caps", "--batch-size", "2", "--iters", "1", "--warmup", "0"], tmp_path
    )
    assert "passes: what ran" in shown[80]
