"""``capsctl compare`` with a suite (capsctl/compare/measured.py): every member a row, with the
measured accuracy from a results file or a suite's run folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import fake_finished_run, run_cli

import capsctl.compare.measured as measured

SUITE = (
    "name: s\nrecipe: quickstart\nseeds: [0, 1]\ntests: [t1]\nresults: s-cpu.csv\nmembers:\n"
    "  - name: caps\n  - name: cnn\n    set: [model=mnist-cnn]\n"
)


def _suite_folder(tmp_path: Path) -> Path:
    runs = tmp_path / "runs"
    fake_finished_run(runs / "caps/seed-0", 10.0, {"t1": (0.75, 200)}, checkpoints=False)
    fake_finished_run(runs / "caps/seed-1", 30.0, {"t1": (0.85, 200)}, checkpoints=False)
    (runs / "suite.yaml").write_text(SUITE)
    return runs


def test_compare_a_suite_folder_shows_measured_mean_and_std(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = _suite_folder(tmp_path)
    code, out, err = run_cli(capsys, ["compare", str(runs), "--json"])
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out)["models"]}
    assert rows["caps"]["measured"]["top1_mean"] == pytest.approx(0.80)
    assert rows["caps"]["measured"]["top1_std"] == pytest.approx(0.0707106781)
    assert rows["caps"]["measured"]["seeds"] == 2
    assert rows["caps"]["measured"]["source"] == str(runs)
    assert rows["cnn"]["measured"] is None  # no finished run


def test_compare_suite_reads_the_packages_results_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from capsctl.suites import load_suite, report_suite, write_results

    runs = _suite_folder(tmp_path)
    results = tmp_path / "results"
    results.mkdir()
    write_results(
        report_suite(load_suite(runs / "suite.yaml"), runs, score=False), results / "s-cpu.csv"
    )
    monkeypatch.setattr(measured, "RESULTS_DIR", results)
    code, out, err = run_cli(capsys, ["compare", "--suite", str(runs / "suite.yaml"), "--json"])
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out)["models"]}
    got = rows["caps"]["measured"]
    assert got["top1_mean"] == pytest.approx(0.80) and got["seeds"] == 2
    assert got["test_set"] == "t1" and got["source"].endswith("s-cpu.csv")
    code, out, err = run_cli(capsys, ["compare", "--suite", str(runs / "suite.yaml")])
    assert code == 0, err
    assert "80.00 ± 7.07 (2)" in out and "measured:" in err
    assert " accuracy " not in out  # no checkpoint scored: no column of "-" beside it


def test_compare_an_unknown_suite_names_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, ["compare", "--suite", "nope"])
    assert code == 2
    assert "cifar10-fast" in err and "paper" in err


@pytest.mark.parametrize("source", ["run folder", "results file"])
def test_a_member_stopped_at_the_matched_time_is_marked_with_its_epochs(
    source: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ``matched`` member's accuracy is not one at the same epochs: its cell is marked and a
    note says how many epochs it trained (1 + 40/200 here: cut 40 images into epoch 2)."""
    from capsctl.suites import load_suite, report_suite, write_results

    runs = _suite_folder(tmp_path)
    suite = SUITE + "  - name: big\n    set: [model=mnist-cnn]\n    budget: matched\n"
    (runs / "suite.yaml").write_text(suite)
    folder = fake_finished_run(runs / "big/seed-0", 20.0, {"t1": (0.55, 200)}, checkpoints=False)
    res = json.loads((folder / "results.json").read_text())
    res["history"] = [{"epoch": 1, "images": 200}, {"epoch": 2, "images": 40, "time_limit": True}]
    (folder / "results.json").write_text(json.dumps(res))
    spec = ["compare", str(runs)]
    if source == "results file":
        results = tmp_path / "results"
        results.mkdir()
        report = report_suite(load_suite(runs / "suite.yaml"), runs, score=False)
        write_results(report, results / "s-cpu.csv")
        monkeypatch.setattr(measured, "RESULTS_DIR", results)
        spec = ["compare", "--suite", str(runs / "suite.yaml")]
    code, out, err = run_cli(capsys, [*spec, "--json"])
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out)["models"]}
    assert rows["big"]["measured"]["budget"] == "matched"
    assert rows["big"]["measured"]["epochs"] == pytest.approx(1.2)
    assert rows["caps"]["measured"]["budget"] == "epochs"
    code, out, err = run_cli(capsys, spec)
    assert code == 0, err
    assert "55.00 (1), 1.2 ep†" in out and "80.00 ± 7.07 (2), 2.0 ep " in out.replace("│", " ")
    assert "† big: trained under the other members' median wall time (1.2 epochs)" in err
