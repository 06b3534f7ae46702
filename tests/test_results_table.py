"""scripts/results_table.py: the comparison tables of README.md and docs/ come from
capsctl/results/."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from conftest import load_script, run_cli

from capsctl.suites import load_suite, read_results, report_suite, write_results
from tests.test_measured import _suite_folder

ROOT = Path(__file__).resolve().parents[1]


def _script():  # type: ignore[no-untyped-def]
    return load_script("results_table")


def test_table_of_a_results_file(tmp_path: Path) -> None:
    runs = _suite_folder(tmp_path)
    path = tmp_path / "s-cpu.csv"
    write_results(report_suite(load_suite(runs / "suite.yaml"), runs, score=False), path)
    text = _script().table(path)
    lines = text.splitlines()
    assert lines[0].startswith("| member | model | top-1 % t1 (mean ± std) | seeds |")
    caps = next(line for line in lines if line.startswith("| caps |"))
    assert "| 80.00 ± 7.07 (se 5.00) | 2 | 2.0 | 20 | 200 |" in caps
    cnn = next(line for line in lines if line.startswith("| cnn |"))
    assert "| - | 0 |" in cnn
    assert not any(line.startswith("†") for line in lines)
    # caps's two runs took 20 s on average, cnn has none: 40 s over 2 runs
    assert ", 40 s of machine time over 2 runs (the sum of their wall times);" in text


def test_each_machine_names_the_members_that_ran_on_it(tmp_path: Path) -> None:
    """A member whose seeds ran on two machines (its ``cpu`` joins them with `` + ``): each
    machine once, with the members it trained."""
    runs = _suite_folder(tmp_path)
    path = tmp_path / "s-cpu.csv"
    write_results(report_suite(load_suite(runs / "suite.yaml"), runs, score=False), path)
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    caps = next(r for r in rows if r["member"] == "caps")
    cpu = caps["cpu"]
    caps["cpu"] = f"{cpu} + Other CPU"
    with path.open("w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=list(rows[0]))
        out.writeheader()
        out.writerows(rows)
    text = _script().table(path)
    line = next(line for line in text.splitlines() if line.startswith("Trained on"))
    assert "Trained on Other CPU (4 cores, torch None: caps); " in line, line
    assert f"; {cpu} (4 cores, torch None: caps), " in line and line.count(cpu) == 1, line


def test_a_matched_member_is_marked(tmp_path: Path) -> None:
    runs = _suite_folder(tmp_path)
    suite = (
        (runs / "suite.yaml")
        .read_text()
        .replace(
            "    set: [model=mnist-cnn]\n", "    set: [model=mnist-cnn]\n    budget: matched\n"
        )
    )
    (runs / "suite.yaml").write_text(suite)
    path = tmp_path / "s-cpu.csv"
    write_results(report_suite(load_suite(runs / "suite.yaml"), runs, score=False), path)
    lines = _script().table(path).splitlines()
    assert any(line.startswith("| cnn † |") for line in lines)
    assert any(line.startswith("| caps |") for line in lines)
    assert any(line.startswith("† stopped at the other members") for line in lines)


def test_render_replaces_only_the_results_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = _script()
    runs = _suite_folder(tmp_path)
    write_results(
        report_suite(load_suite(runs / "suite.yaml"), runs, score=False), tmp_path / "s-cpu.csv"
    )
    monkeypatch.setattr(script, "RESULTS", tmp_path)
    text = "before\n<!-- results:s-cpu -->\nstale\n<!-- /results:s-cpu -->\nafter\n"
    new = script.render(text)
    assert new.startswith("before\n<!-- results:s-cpu -->\n| member |")
    assert new.endswith("<!-- /results:s-cpu -->\nafter\n") and "stale" not in new
    assert script.render(new) == new


def test_the_tables_of_the_readme_and_docs_are_the_results_files() -> None:
    assert _script().main(["--check"]) == 0
    assert _script().main(["--check", str(ROOT / "README.md"), str(ROOT / "docs/RESULTS.md")]) == 0


def test_write_and_check_take_the_readme_and_every_page_of_docs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without files, --write and --check take README.md and docs/*.md (the tables moved into
    docs/); a file named on the command line is the only one touched."""
    script = _script()
    runs = _suite_folder(tmp_path / "runs")
    results = tmp_path / "results"
    results.mkdir()
    write_results(
        report_suite(load_suite(runs / "suite.yaml"), runs, score=False), results / "s-cpu.csv"
    )
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    stale = "top\n<!-- results:s-cpu -->\nstale\n<!-- /results:s-cpu -->\n"
    pages = [root / "README.md", root / "docs/RESULTS.md", root / "other.md"]
    for page in pages:
        page.write_text(stale)
    (root / "docs/PLAIN.md").write_text("no block\n")
    monkeypatch.setattr(script, "RESULTS", results)
    monkeypatch.setattr(script, "ROOT", root)
    assert script.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "README.md: results tables differ" in err and "RESULTS.md: results tables" in err
    assert "other.md" not in err
    assert all(page.read_text() == stale for page in pages)  # a check never writes
    assert script.main(["--write"]) == 0
    readme, docs, other = (page.read_text() for page in pages)
    assert "| caps |" in readme and "stale" not in readme and docs == readme
    assert other == stale and (root / "docs/PLAIN.md").read_text() == "no block\n"
    assert script.main(["--check"]) == 0
    assert script.main(["--check", str(root / "other.md")]) == 1
    assert script.main(["--write", str(root / "other.md")]) == 0
    assert (root / "other.md").read_text() == readme


def test_the_header_names_the_metric_of_multi_label_suites(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """DiverseMultiMNIST's accuracy is the paper's top-2 exact match, not top-1: the results
    file carries the metric the runs were scored with, and the table's header says it."""
    import json

    runs = _suite_folder(tmp_path)
    metric = "top-2 exact match (DiverseMultiMNIST)"
    for seed in (0, 1):
        scores = runs / f"caps/seed-{seed}/tests.json"
        doc = json.loads(scores.read_text())
        doc["tests"]["t1"]["metric"] = metric
        scores.write_text(json.dumps(doc))
    path = tmp_path / "s-cpu.csv"
    write_results(report_suite(load_suite(runs / "suite.yaml"), runs, score=False), path)
    assert {row["metric"] for row in read_results(path)} == {metric, None}  # cnn: no run
    header = _script().table(path).splitlines()[0]
    assert header.startswith(f"| member | model | {metric} % t1 (mean ± std) |")
    code, out, err = run_cli(capsys, ["suite", "report", str(runs), "--no-score"])
    assert code == 0, err
    assert "top-2 exact" in out and "top-1" not in out
    code, out, err = run_cli(capsys, ["compare", str(runs)])
    assert code == 0, err
    (line,) = [x for x in err.splitlines() if "measured:" in x]  # the cnn, unmeasured, adds none
    assert f"({metric} on t1, 200 images;" in line


def test_the_table_says_which_runs_shared_the_machine() -> None:
    shared = _script()._shared
    rows = [
        {"member": "caps", "seeds_run": 3, "shared_runs": 2},
        {"member": "cnn", "seeds_run": 3, "shared_runs": 0},
        {"member": "old", "seeds_run": 2, "shared_runs": None},
    ]
    text = shared(rows)
    assert "their seconds are upper bounds): caps 2 of 3; load not recorded: old." in text
    assert shared(rows[1:2]).endswith("upper bounds): none.")
    assert "unknown" in shared(rows[2:])
