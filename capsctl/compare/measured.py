"""Measured accuracies for ``capsctl compare``: a suite's members as rows, with the mean and
spread over seeds from the package's results files (``capsctl/results/*.csv``, timm's
``results/`` convention) or from a suite's run folder.

A row's ``measured`` is ``{"top1_mean", "top1_std", "seeds", "test_set", "test_images",
"source"}`` (fractions in [0, 1]; ``source`` names the file or folder it comes from).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from capsctl.compare.targets import Target, dataset_key

__all__ = ["RESULTS_DIR", "is_suite_folder", "measured_from_file", "suite_member_targets"]

#: The results files shipped inside the package.
RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"


def is_suite_folder(spec: str) -> bool:
    """Whether ``spec`` is a folder written by ``capsctl suite run`` (it holds ``suite.yaml``)."""
    path = Path(spec).expanduser()
    return path.is_dir() and (path / "suite.yaml").is_file()


def _measured(row: dict[str, Any], source: str) -> dict[str, Any]:
    return {
        "top1_mean": row["top1_mean"],
        "top1_std": row["top1_std"],
        "seeds": row["seeds_run"],
        "test_set": row["test_set"],
        "test_images": row["test_images"],
        "budget": row.get("budget"),
        "epochs": row.get("epochs"),
        "metric": row.get("metric"),
        "source": source,
    }


def measured_from_file(path: Path, test_set: str | None = None) -> dict[str, dict[str, Any]]:
    """``{member: measured}`` of one results file, for ``test_set`` (default: each member's
    first test set in the file)."""
    from capsctl.suites.results_file import read_results

    out: dict[str, dict[str, Any]] = {}
    try:
        shown = str(path.relative_to(RESULTS_DIR.parents[1]))
    except ValueError:
        shown = str(path)
    for row in read_results(path):
        if row["member"] in out or (test_set is not None and row["test_set"] != test_set):
            continue
        out[row["member"]] = _measured(row, shown)
    return out


def suite_member_targets(spec: str) -> list[tuple[Target, dict[str, Any] | None]]:
    """The members of a suite (a bundled name, a suite file or a suite run folder) as compare
    targets, each with its measured accuracy: from the run folder's finished runs, or from the
    suite's results file in the package (None where neither has the member)."""
    from capsctl.suites import load_suite, report_suite
    from capsctl.suites.pairs import Pair, resolved_pair_preset
    from capsctl.suites.results_file import parse_row, result_rows

    folder = Path(spec).expanduser() if is_suite_folder(spec) else None
    suite = load_suite(folder / "suite.yaml" if folder is not None else spec)
    test = suite.tests[0] if suite.tests else "test"
    measured: dict[str, dict[str, Any]] = {}
    if folder is not None:
        report = report_suite(suite, folder, score=False)
        for row in result_rows(report):
            if row["test_set"] == test and row["top1_mean"]:
                measured[row["member"]] = _measured(parse_row(row), str(folder))
    elif suite.results and (RESULTS_DIR / suite.results).is_file():
        measured = measured_from_file(RESULTS_DIR / suite.results, test)
    targets = []
    for m in suite.members:
        preset = resolved_pair_preset(suite, Pair(m, suite.seeds_of(m)[0], Path(".")))
        target = Target(m.name, "suite", preset.model, None, dataset_key(preset.data))
        targets.append((target, measured.get(m.name)))
    return targets
