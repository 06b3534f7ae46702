"""A command's output never replaces a run's files nor lands in a run folder or a suite's
folder, and ``--overwrite`` replaces only an earlier output of the same kind, told by its
content (capsctl/outputs.py, :func:`capsctl.atomic.check_output`). The sweep over every output
option of every command is tests/test_output_sweep.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import fake_finished_run, run_cli

from capsctl import outputs
from capsctl.atomic import check_output
from capsctl.errors import UsageError

SUITE = "name: s\nrecipe: quickstart\nseeds: [0]\ntests: [t1]\nmembers:\n  - name: caps\n"
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(64))


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def suite_folder(tmp_path: Path) -> Path:
    """A suite's folder: ``suite.yaml`` and one finished run ``caps/seed-0`` (with dummy
    checkpoints)."""
    runs = tmp_path / "runs"
    fake_finished_run(runs / "caps/seed-0", 10.0, {"t1": (0.75, 200)})
    (runs / "suite.yaml").write_text(SUITE)
    return runs


def report(capsys: pytest.CaptureFixture[str], runs: Path, *args: str) -> tuple[int, str]:
    code, _, err = run_cli(capsys, ["suite", "report", str(runs), "--no-score", *args])
    return code, err


@pytest.mark.parametrize(
    "target",
    [
        "caps/seed-0/best.safetensors",
        "caps/seed-0/results.json",
        "caps/seed-0/metrics.jsonl",
        "suite.yaml",
        "caps/seed-0/new.csv",
        "new.csv",
    ],
)
def test_report_results_never_lands_in_a_run_or_suite_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    runs = suite_folder(tmp_path)
    before = snapshot(runs)
    path = runs / target
    code, err = report(capsys, runs, "--results", str(path), "--overwrite")
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert str(path) in line and "pick a path outside run and suite folders" in line
    assert snapshot(runs) == before


@pytest.mark.parametrize("target", ["caps/seed-0", "caps/seed-0/plots", "caps", "."])
def test_report_pictures_never_land_in_a_run_or_suite_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    runs = suite_folder(tmp_path)
    before = snapshot(runs)
    code, err = report(capsys, runs, "--png", str(runs / target), "--overwrite")
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "run" in err
    assert snapshot(runs) == before and not (runs / target / "plots").exists()


@pytest.mark.parametrize(
    "content",
    [PNG, b"\x00\x01garbage\xff" * 8, b'{"a": 1}\n', b"member,top1\ncaps,0.5\n"],
    ids=["png", "bytes", "json", "other-csv"],
)
def test_report_results_replaces_only_a_results_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes
) -> None:
    runs = suite_folder(tmp_path)
    mine = tmp_path / "mine.csv"
    mine.write_bytes(content)
    code, err = report(capsys, runs, "--results", str(mine), "--overwrite")
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert str(mine) in line and "not a capsctl results file" in line
    assert mine.read_bytes() == content
    earlier = tmp_path / "earlier.csv"
    assert report(capsys, runs, "--results", str(earlier))[0] == 0
    earlier.write_text(earlier.read_text() + "one more line\n")
    assert report(capsys, runs, "--results", str(earlier), "--overwrite")[0] == 0
    assert earlier.read_text().startswith("suite,member,model,test_set,")
    assert "one more line" not in earlier.read_text()


def test_report_results_is_refused_before_any_scoring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = suite_folder(tmp_path)

    def no_work(*a: object, **k: object) -> None:
        raise AssertionError("scored before refusing the results file")

    monkeypatch.setattr("capsctl.suites.report_suite", no_work)
    code, err = report(capsys, runs, "--results", str(runs / "suite.yaml"), "--overwrite")
    assert code == 2 and "Traceback" not in err


# -- the rule itself ---------------------------------------------------------------------------


def test_an_earlier_output_of_the_same_kind_is_replaced_only_with_overwrite(
    tmp_path: Path,
) -> None:
    picture = tmp_path / "a.png"
    picture.write_bytes(PNG)
    with pytest.raises(UsageError, match="already exists; pass --overwrite"):
        check_output(picture, kind=outputs.PNG)
    check_output(picture, kind=outputs.PNG, overwrite=True)
    with pytest.raises(UsageError, match="is not a capsctl results file"):
        check_output(picture, kind=outputs.RESULTS_CSV, overwrite=True)
    check_output(tmp_path / "new.csv", kind=outputs.RESULTS_CSV)


def test_a_run_folder_is_told_by_its_files_and_a_suite_folder_by_its_runs(
    tmp_path: Path,
) -> None:
    for name in outputs.RUN_MARKERS:
        run = tmp_path / name.replace(".", "-")
        run.mkdir()
        (run / name).write_bytes(b"")
        assert outputs.folder_role(run) == ("run", name)
        with pytest.raises(UsageError, match="inside the run folder"):
            check_output(run / "deep" / "x.png", kind=outputs.PNG)
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "suite.yaml").write_text(SUITE)
    assert outputs.folder_role(suite) is None  # a suite copy alone: no run yet
    (suite / "caps" / "seed-0").mkdir(parents=True)
    assert outputs.folder_role(suite) == ("suite", "suite.yaml")
    with pytest.raises(UsageError, match="inside the suite folder"):
        check_output(suite / "caps" / "x.csv", kind=outputs.RESULTS_CSV)
    check_output(suite / "caps" / "seed-1", kind=outputs.RUN)  # a suite's pair: its place
    # a tuning run's place too, also once a final run exists (suite tune after suite run)
    check_output(suite / "tune" / "caps" / "lr-0.1", kind=outputs.RUN)
    with pytest.raises(UsageError, match="inside the suite folder"):
        check_output(suite / "tune" / "caps" / "other", kind=outputs.RUN)
    with pytest.raises(UsageError, match="inside the suite folder"):
        check_output(suite / "caps" / "other", kind=outputs.RUN)
    check_output(suite, kind=outputs.SUITE)
    with pytest.raises(UsageError, match="is a suite folder"):
        check_output(suite, kind=outputs.RUN)
    with pytest.raises(UsageError, match="is a run folder"):
        check_output(tmp_path / "results-json", kind=outputs.SUITE)
    with pytest.raises(UsageError, match="inside the run folder"):
        check_output(tmp_path / "results-json" / "sub", kind=outputs.RUN)


def test_a_link_into_a_run_folder_is_inside_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    fake_finished_run(run, 1.0, {"t1": (0.5, 10)})
    (tmp_path / "link").symlink_to(run)
    with pytest.raises(UsageError, match="inside the run folder"):
        check_output(tmp_path / "link" / "x.csv", kind=outputs.RESULTS_CSV)
    (tmp_path / "to-results.csv").symlink_to(run / "results.json")
    with pytest.raises(UsageError, match="inside the run folder"):
        check_output(tmp_path / "to-results.csv", kind=outputs.RESULTS_CSV, overwrite=True)


def test_the_kinds_know_the_files_their_writers_write(tmp_path: Path) -> None:
    from capsctl.checkpoint import CONFIG_NAME
    from capsctl.export.hf import FOLDER_FILES
    from capsctl.robustness.store import HEADER
    from capsctl.suites.results_file import RESULT_COLUMNS
    from capsctl.training import run_folder

    assert set(outputs.RUN_MARKERS) == {
        run_folder.RESULTS,
        run_folder.METRICS,
        run_folder.RESOLVED_PRESET,
        run_folder.BEST,
        run_folder.LAST,
    }
    assert RESULT_COLUMNS[: len(outputs.RESULTS_HEADER)] == outputs.RESULTS_HEADER
    assert set(outputs.MODEL_FOLDER_FILES) == set(FOLDER_FILES) and CONFIG_NAME in FOLDER_FILES
    settings = tmp_path / "settings.jsonl"
    settings.write_text(json.dumps(HEADER, sort_keys=True) + "\n")
    check_output(settings, kind=outputs.ROBUSTNESS_SETTINGS, overwrite=True)


def test_each_kind_holds_what_its_writer_writes(tmp_path: Path) -> None:
    import torch

    figure = pytest.importorskip("matplotlib.figure")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = figure.Figure()
    FigureCanvasAgg(fig)
    fig.add_subplot(1, 1, 1).plot([0, 1])
    pictures = {outputs.PNG: "a.png", outputs.SVG: "a.svg", outputs.PDF: "a.pdf"}
    for kind, name in pictures.items():
        fig.savefig(tmp_path / name)
        assert [k for k in pictures if k.holds(tmp_path / name)] == [kind]

    class Twice(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * x

    program = torch.export.export(Twice(), (torch.ones(2),))
    torch.export.save(program, tmp_path / "a.pt2")
    assert outputs.PT2.holds(tmp_path / "a.pt2") and not outputs.ONNX.holds(tmp_path / "a.pt2")
    for kind in outputs.KINDS.values():  # nothing is taken for a PNG but a PNG
        if not kind.folder:
            assert kind.holds(tmp_path / "a.png") == (kind.what == "a PNG picture"), kind.name
