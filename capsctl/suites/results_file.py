"""Results files (timm's ``results/`` convention): a suite report as one CSV row per member and
test file, :data:`RESULT_COLUMNS`; :func:`write_results` writes them, :func:`read_results` reads
them back with numbers as numbers. ``metric`` names what the accuracy columns hold (``top-1``,
or DiverseMultiMNIST's top-2 exact match); ``lr`` and ``lr_chosen_on`` the runs' learning rate
and where it was chosen (``val``, ``recipe``); ``shared_runs`` how many of the member's runs
shared the machine, from the load average their epochs recorded (empty: none recorded one)."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from capsctl.atomic import check_output, write_text_atomic
from capsctl.outputs import RESULTS_CSV
from capsctl.suites.report import SuiteReport

__all__ = [
    "RESULT_COLUMNS",
    "parse_row",
    "read_results",
    "result_rows",
    "results_csv",
    "write_results",
]

#: The columns of a results file, in order.
RESULT_COLUMNS = (
    "suite",
    "member",
    "model",
    "test_set",
    "test_images",
    "metric",
    "top1_mean",
    "top1_std",
    "top1_se",
    "test_se",
    "seeds",
    "seeds_run",
    "epochs",
    "wall_s",
    "train_images_per_s",
    "params",
    "gflops",
    "budget",
    "lr",
    "lr_chosen_on",
    "cpu",
    "cores",
    "shared_runs",
    "device",
    "torch",
    "commit",
    "note",
)


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def result_rows(report: SuiteReport) -> list[dict[str, str]]:
    """The report as results-file rows (:data:`RESULT_COLUMNS`), one per member and test."""
    rows = []
    for r in report.rows:
        for test in report.tests:
            t = r.tests[test]
            rows.append(
                {
                    "suite": report.suite,
                    "member": r.member,
                    "model": r.model,
                    "test_set": test,
                    "test_images": _fmt(t.images),
                    "metric": _fmt(t.metric),
                    "top1_mean": _fmt(t.mean),
                    "top1_std": _fmt(t.std),
                    "top1_se": _fmt(t.se),
                    "test_se": _fmt(t.test_se),
                    "seeds": " ".join(str(s) for s in r.seeds_done),
                    "seeds_run": str(len(t.values)),
                    "epochs": _fmt(r.epochs),
                    "wall_s": _fmt(None if r.wall_s is None else round(r.wall_s, 1)),
                    "train_images_per_s": _fmt(
                        None if r.train_images_per_s is None else round(r.train_images_per_s, 1)
                    ),
                    "params": _fmt(r.params),
                    "gflops": _fmt(None if r.gflops is None else round(r.gflops, 4)),
                    "budget": r.budget,
                    "lr": _fmt(r.lr),
                    "lr_chosen_on": _fmt(r.lr_chosen_on),
                    "cpu": _fmt(r.machine.get("cpu")),
                    "cores": _fmt(r.machine.get("cores")),
                    "shared_runs": _fmt(r.shared_runs),
                    "device": _fmt(r.machine.get("device")),
                    "torch": _fmt(r.machine.get("torch_version")),
                    "commit": _fmt(r.machine.get("commit")),
                    "note": r.note,
                }
            )
    return rows


def results_csv(report: SuiteReport) -> str:
    """The report as a results file's text (header and rows)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(RESULT_COLUMNS), lineterminator="\n")
    w.writeheader()
    w.writerows(result_rows(report))
    return buf.getvalue()


def write_results(report: SuiteReport, path: Path, *, overwrite: bool = False) -> Path:
    """Write the report's results file (:func:`check_output`: an existing file only with
    ``overwrite`` and only when it is a results file, never in a run or suite folder)."""
    check_output(path, kind=RESULTS_CSV, overwrite=overwrite)
    write_text_atomic(path, results_csv(report), overwrite=overwrite)
    return path


def read_results(path: Path) -> list[dict[str, Any]]:
    """A results file's rows with numbers as numbers (empty cells as None); ValueError on a
    header that is not :data:`RESULT_COLUMNS`."""
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != RESULT_COLUMNS:
            raise ValueError(f"{path}: not a capsctl results file (unexpected header)")
        return [parse_row(raw) for raw in reader]


def parse_row(raw: dict[str, str]) -> dict[str, Any]:
    """One results row as written (:func:`result_rows`) with numbers as numbers and empty cells
    as None."""
    return {k: _parse_cell(k, v) for k, v in raw.items()}


_INT_COLUMNS = ("test_images", "seeds_run", "params", "cores", "shared_runs")
_FLOAT_COLUMNS = (
    "top1_mean",
    "top1_std",
    "top1_se",
    "test_se",
    "epochs",
    "wall_s",
    "train_images_per_s",
    "gflops",
)


def _parse_cell(column: str, value: str | None) -> Any:
    if value is None or value == "":
        return None
    if column in _INT_COLUMNS:
        return int(value)
    if column in _FLOAT_COLUMNS:
        return float(value)
    return value
