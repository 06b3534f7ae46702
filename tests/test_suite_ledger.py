"""Suite ledgers (``capsctl suite archive``) and reports over several folders."""

from __future__ import annotations

import csv
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import fake_finished_run as _run
from conftest import run_cli

from capsctl.errors import CapsctlError
from capsctl.suites import load_suite, report_suite

ROOT = Path(__file__).resolve().parents[1]

SUITE = "name: s\nrecipe: quickstart\nseeds: [0, 1]\ntests: [t1, t2]\nmembers:\n  - name: caps\n"


def _suite_file(folder: Path) -> Path:
    path = folder / "s.yaml"
    path.write_text(SUITE)
    return path


# -- archiving ---------------------------------------------------------------------------------


def test_archive_keeps_finished_scored_pairs_without_checkpoints(tmp_path: Path) -> None:
    from capsctl.suites.ledger import RECORD_FILES, archive_suite

    suite = load_suite(_suite_file(tmp_path))
    runs, ledger = tmp_path / "runs", tmp_path / "ledger"
    _run(runs / "caps/seed-0", 10.0, {"t1": (0.75, 200), "t2": (0.70, 100)})
    _run(runs / "caps/seed-1", 30.0, {"t1": (0.85, 200)})  # t2 not scored yet
    result = archive_suite(suite, [runs], ledger)
    assert [(p["seed"], p["status"]) for p in result.pairs] == [(0, "added"), (1, "unscored")]
    record = ledger / "caps/seed-0"
    assert sorted(p.name for p in record.iterdir()) == sorted(
        f for f in RECORD_FILES if f not in ("preset.yaml", "robustness.json")
    )
    for name in ("results.json", "tests.json", "provenance.json", "metrics.jsonl"):
        assert (record / name).read_bytes() == (runs / "caps/seed-0" / name).read_bytes()
    assert not (ledger / "caps/seed-1").exists()
    assert not list(ledger.rglob(".*"))  # no staging folder left behind
    again = archive_suite(suite, [runs], ledger)
    assert again.pairs[0]["status"] == "kept"


def test_archive_refuses_a_differing_record_unless_overwrite(tmp_path: Path) -> None:
    from capsctl.suites.ledger import archive_suite

    suite = load_suite(_suite_file(tmp_path))
    runs, ledger = tmp_path / "runs", tmp_path / "ledger"
    _run(runs / "caps/seed-0", 10.0, {"t1": (0.75, 200), "t2": (0.70, 100)})
    archive_suite(suite, [runs], ledger)
    kept = (ledger / "caps/seed-0/tests.json").read_text()
    other = tmp_path / "other"
    _run(other / "caps/seed-0", 12.0, {"t1": (0.80, 200), "t2": (0.70, 100)})
    with pytest.raises(CapsctlError) as info:
        archive_suite(suite, [other], ledger)
    message = str(info.value)
    assert "\n" not in message
    assert str(ledger / "caps/seed-0") in message and str(other / "caps/seed-0") in message
    assert "t1 accuracy 0.75 vs 0.8" in message and "--overwrite" in message
    assert (ledger / "caps/seed-0/tests.json").read_text() == kept
    result = archive_suite(suite, [other], ledger, overwrite=True)
    assert result.pairs[0]["status"] == "replaced"
    tests = json.loads((ledger / "caps/seed-0/tests.json").read_text())["tests"]
    assert tests["t1"]["accuracy"] == 0.80
    assert json.loads((ledger / "caps/seed-0/results.json").read_text())["seconds"] == 12.0
    assert not list(ledger.rglob(".*"))


def test_archive_refuses_two_differing_sources_and_a_run_folder_as_ledger(
    tmp_path: Path,
) -> None:
    from capsctl.suites.ledger import archive_suite

    suite = load_suite(_suite_file(tmp_path))
    a, b, ledger = tmp_path / "a", tmp_path / "b", tmp_path / "ledger"
    _run(a / "caps/seed-0", 10.0, {"t1": (0.75, 200), "t2": (0.70, 100)})
    _run(b / "caps/seed-0", 10.0, {"t1": (0.75, 200), "t2": (0.71, 100)})
    with pytest.raises(CapsctlError, match="t2 accuracy 0.7 vs 0.71") as info:
        archive_suite(suite, [a, b], ledger, overwrite=True)
    assert str(a / "caps/seed-0") in str(info.value) and str(b / "caps/seed-0") in str(info.value)
    assert not ledger.exists()  # nothing written
    with pytest.raises(CapsctlError, match="best.safetensors"):
        archive_suite(suite, [b], a, overwrite=True)  # a is a run folder: its weights stay
    assert (a / "caps/seed-0/best.safetensors").exists()


def test_archive_command_writes_the_suite_copy_and_refuses_with_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    suite_path = _suite_file(tmp_path)
    runs, ledger = tmp_path / "runs", tmp_path / "ledger"
    _run(runs / "caps/seed-0", 10.0, {"t1": (0.75, 200), "t2": (0.70, 100)})
    args = ["suite", "archive", str(runs), "--suite", str(suite_path), "--to", str(ledger)]
    code, out, err = run_cli(capsys, args)
    assert code == 0, err
    assert "caps seed 0: added" in out
    assert (ledger / "suite.yaml").is_file() and (ledger / "caps/seed-0/tests.json").is_file()
    (runs / "caps/seed-0/tests.json").write_text(
        json.dumps({"tests": {"t1": {"accuracy": 0.1}, "t2": {"accuracy": 0.2}}})
    )
    code, _, err = run_cli(capsys, args)
    assert code == 1 and "--overwrite" in err
    code, out, _ = run_cli(capsys, [*args, "--overwrite"])
    assert code == 0 and "caps seed 0: replaced" in out


# -- reporting several folders -----------------------------------------------------------------


def test_report_merges_the_pairs_of_two_folders(tmp_path: Path) -> None:
    suite = load_suite(_suite_file(tmp_path))
    a, b = tmp_path / "a", tmp_path / "b"
    _run(a / "caps/seed-0", 10.0, {"t1": (0.75, 200), "t2": (0.60, 100)})
    _run(b / "caps/seed-1", 30.0, {"t1": (0.85, 200), "t2": (0.70, 100)})
    row = report_suite(suite, [a, b], score=False).rows[0]
    assert row.seeds_done == [0, 1]
    assert row.tests["t1"].mean == pytest.approx(0.80)
    assert row.tests["t1"].std == pytest.approx(math.sqrt(0.005))
    assert row.tests["t2"].mean == pytest.approx(0.65)
    assert row.wall_s == pytest.approx(20.0)
    # the same record in both folders counts once
    _run(a / "caps/seed-1", 30.0, {"t1": (0.85, 200), "t2": (0.70, 100)})
    again = report_suite(suite, [a, b], score=False).rows[0]
    assert again.seeds_done == [0, 1] and again.tests["t1"].values == [0.75, 0.85]


def test_a_pair_finished_differently_in_two_folders_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    suite_path = _suite_file(tmp_path)
    a, b = tmp_path / "a", tmp_path / "b"
    _run(a / "caps/seed-1", 30.0, {"t1": (0.85, 200), "t2": (0.70, 100)})
    _run(b / "caps/seed-1", 30.0, {"t1": (0.85, 200), "t2": (0.72, 100)})
    with pytest.raises(CapsctlError) as info:
        report_suite(load_suite(suite_path), [a, b], score=False)
    message = str(info.value)
    assert "\n" not in message and "caps seed 1" in message
    assert str(a / "caps/seed-1") in message and str(b / "caps/seed-1") in message
    assert "t2 accuracy 0.7 vs 0.72" in message
    args = ["suite", "report", str(a), str(b), "--suite", str(suite_path), "--no-score"]
    code, _, err = run_cli(capsys, args)
    assert code == 1 and str(b / "caps/seed-1") in err


def test_report_reads_a_ledger_without_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    suite_path = _suite_file(tmp_path)
    ledger = tmp_path / "ledger"
    _run(ledger / "caps/seed-0", 10.0, {"t1": (0.75, 200), "t2": (0.60, 100)}, checkpoints=False)
    _run(ledger / "caps/seed-1", 30.0, {"t1": (0.85, 200)}, checkpoints=False)  # t2 missing
    report = report_suite(load_suite(suite_path), ledger, score=True)
    row = report.rows[0]
    assert row.seeds_done == [0, 1]
    assert row.tests["t1"].values == [0.75, 0.85]
    assert row.tests["t2"].values == [0.60]  # left out of t2 only
    assert len(report.notes) == 1
    assert "caps seed 1" in report.notes[0] and "t2" in report.notes[0]
    assert "no checkpoint" in report.notes[0]
    args = ["suite", "report", str(ledger), "--suite", str(suite_path), "--csv"]
    code, out, err = run_cli(capsys, args)
    assert code == 0, err
    assert "no checkpoint" in err
    first = next(csv.DictReader(io.StringIO(out)))
    assert (first["test_set"], first["top1_mean"], first["seeds_run"]) == ("t1", "0.8", "2")


def test_robustness_of_a_ledger_comes_from_its_cache_or_is_noted(tmp_path: Path) -> None:
    from dataclasses import asdict

    from capsctl.suites.robust import RobustSettings

    suite = load_suite(_suite_file(tmp_path))
    ledger = tmp_path / "ledger"
    both = {"t1": (0.75, 200), "t2": (0.60, 100)}
    cached = _run(ledger / "caps/seed-0", 10.0, both, checkpoints=False)
    _run(ledger / "caps/seed-1", 30.0, both, checkpoints=False)
    settings = RobustSettings(limit=50, corruption_limit=50)
    summary = {"count": 50, "fgsm_8_255_accuracy": 0.3, "pgd_8_255_accuracy": 0.1}
    doc = {"settings": asdict(settings), "summary": summary}
    (cached / "robustness.json").write_text(json.dumps(doc))
    report = report_suite(suite, ledger, score=False, robustness=settings)
    robust = report.rows[0].robustness
    assert robust is not None and robust["fgsm_8_255_accuracy"].values == [0.3]
    assert len(report.notes) == 1 and "caps seed 1" in report.notes[0]
    assert "robustness" in report.notes[0] and "no checkpoint" in report.notes[0]


def test_report_refuses_folders_of_two_suites(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "suite.yaml").write_text(SUITE)
    (b / "suite.yaml").write_text(SUITE.replace("name: s", "name: other"))
    code, _, err = run_cli(capsys, ["suite", "report", str(a), str(b), "--no-score"])
    assert code == 2 and str(b / "suite.yaml") in err and "'other'" in err


def test_a_restored_record_counts_as_finished(tmp_path: Path) -> None:
    suite = load_suite(_suite_file(tmp_path))
    folder = _run(tmp_path / "ledger/caps/seed-0", 10.0, {"t1": (0.75, 200)}, checkpoints=False)
    res = json.loads((folder / "results.json").read_text())
    res["test"] = None  # the run's own final test was not kept
    res["restored_from"] = {"file": "some.csv", "rows": [2]}
    (folder / "results.json").write_text(json.dumps(res))
    row = report_suite(suite, tmp_path / "ledger", score=False).rows[0]
    assert row.seeds_done == [0] and row.tests["t1"].values == [0.75]
    # its preset, marked as restored, is still the pair's own
    from capsctl.config import preset_to_dict
    from capsctl.config.yaml_io import to_yaml
    from capsctl.suites.pairs import Pair, check_folder_is_pair, resolved_pair_preset

    pair = Pair(suite.member("caps"), 0, folder)
    preset = preset_to_dict(resolved_pair_preset(suite, pair))
    (folder / "preset.yaml").write_text(to_yaml({**preset, "restored_from": {"rows": [2]}}))
    check_folder_is_pair(suite, pair)


@pytest.mark.parametrize(
    "results", sorted(p.name for p in (ROOT / "capsctl/results").glob("*.csv")), ids=str
)
def test_the_shipped_results_file_is_the_report_of_the_shipped_ledger(results: str) -> None:
    """Each CSV of capsctl/results/ is what ``capsctl suite report`` makes of its ledger in
    benchmarks/suites/ (run in a process of its own, as the command is: a FLOP count can
    depend on which routing passes ran before in the same process)."""
    ledger = ROOT / "benchmarks/suites" / results.removesuffix(".csv")
    suite = load_suite(ledger / "suite.yaml")
    assert suite.results == results
    args = ["suite", "report", str(ledger), "--no-score", "--csv"]
    done = subprocess.run(
        [sys.executable, "-m", "capsctl", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    shipped = (ROOT / "capsctl/results" / results).read_text(encoding="utf-8")
    assert done.stdout == shipped


def test_the_multimnist_ledger_counts_each_training_image_once() -> None:
    """An image with two labels is one image: each epoch of the shipped DiverseMultiMNIST runs
    saw the 54,912 training composites (429 steps of 128) once, and its images/s is those
    images over its seconds."""
    runs = sorted((ROOT / "benchmarks" / "suites" / "multimnist-cpu").glob("*/seed-*"))
    assert len(runs) == 6
    for run in runs:
        history = json.loads((run / "results.json").read_text())["history"]
        metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert history == metrics, run
        for h in history:
            assert h["images"] == 429 * 128, run
            assert h["images_per_s"] == pytest.approx(h["images"] / h["epoch_seconds"], rel=1e-6)
            assert 0.0 <= h["train_accuracy"] <= 1.0


def test_every_ledger_run_without_curves_is_disclosed_as_restored() -> None:
    """A ledger run without metrics.jsonl was restored from a results file: its provenance says
    from where, and docs/RESULTS.md says which seeds of the suite lack their curves."""
    readme = (ROOT / "docs" / "RESULTS.md").read_text()
    restored = []
    for run in sorted((ROOT / "benchmarks" / "suites").glob("*/*/seed-*")):
        if (run / "metrics.jsonl").exists():
            continue
        provenance = json.loads((run / "provenance.json").read_text())
        assert provenance.get("restored_from", {}).get("file"), run
        restored.append(run)
    for ledger in {r.parents[1].name for r in restored}:
        assert f"benchmarks/suites/{ledger}/" in readme and "restored_from" in readme, ledger
