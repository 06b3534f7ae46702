"""``capsctl suite``: progress across a suite's pairs, its report table, commands and CSV."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from capsctl.views.common import err, fmt_duration, out, styled, table
from capsctl.views.progress import TrainProgress

__all__ = ["SuiteProgress", "print_suite_list", "print_suite_report", "print_tuning"]

_STATUS = {
    "done": "finished, skipped",
    "scored": "finished, scoring its test files",
    "partial": "resuming",
    "new": "training",
    "waiting": "waits for the other members' median wall time; run the suite again later",
    "untuned": "waits for its learning rate to be chosen; run the suite again later",
    "busy": "another process is training it",
}


class SuiteProgress(TrainProgress):
    """The training progress bar, plus one line per pair: ``[3/17] em seed 0: training``."""

    def __call__(self, e: dict[str, Any]) -> None:
        kind = e["event"]
        if kind == "suite_pair" and not self.quiet:
            self.progress.console.print(
                styled(
                    (f"[{e['step']}/{e['steps']}] ", "bold"),
                    f"{e['member']} seed {e['seed']}: {_STATUS.get(e['status'], e['status'])}",
                )
            )
        elif kind == "suite_tune" and not self.quiet:
            what = "resuming" if e["status"] == "partial" else "training"
            self.progress.console.print(
                styled(("tune ", "bold"), f"{e['member']} at lr {e['lr']:.6g}: {what}")
            )
        elif kind == "suite_tune_diverged" and not self.quiet:
            self.progress.console.print(
                f"  {e['member']} at lr {e['lr']:.6g}: diverged, recorded as worse than any "
                f"score ({e['message']})"
            )
        elif kind == "suite_pair_busy" and not self.quiet:
            self.progress.console.print(
                f"  {e['member']} seed {e['seed']}: another process holds its folder; skipped"
            )
        elif kind == "suite_score" and not self.quiet:
            self.progress.console.print(f"  scoring on {e['test']}")
        elif kind == "test" and not self.quiet:
            self.progress.console.print(f"  test accuracy {100 * e['accuracy']:.2f}%")
        else:
            super().__call__(e)


def print_suite_list(suites: list[tuple[str, str]]) -> None:
    table = Table(show_header=True, header_style="bold", expand=False)
    table.add_column("suite", no_wrap=True)
    table.add_column("description", overflow="fold")
    for name, desc in suites:
        table.add_row(Text(name), Text(desc))
    out.print(table)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.2f}"


def _acc_cell(t: dict[str, Any]) -> str:
    """``90.12 ± 0.31`` (mean ± std over seeds, in %)."""
    if t["top1_mean"] is None:
        return "-"
    std = t["top1_std"]
    return f"{_pct(t['top1_mean'])} ± {_pct(std)}" if std is not None else _pct(t["top1_mean"])


def _metric(doc: dict[str, Any], test: str) -> str:
    """What the accuracy on ``test`` is (from the first row that says): top-1 by default."""
    said = (r["tests"][test].get("metric") for r in doc["rows"])
    return next((m for m in said if m), "top-1")


def print_suite_report(doc: dict[str, Any]) -> None:
    """The report as a table that fits the terminal (numbers never cut): one row per member."""
    cols = ["member"]
    cols += [f"{_metric(doc, test)} % {test} mean ± std (se)" for test in doc["tests"]]
    cols += ["seeds", "params", "GFLOPs", "epochs", "lr", "wall s", "img/s", "published"]
    robust = next((r["robustness"] for r in doc["rows"] if r.get("robustness")), None)
    if robust:
        from capsctl.suites.robust import ROBUST_METRICS

        cols += [f"{ROBUST_METRICS[k]} %" for k in robust]
    body, notes = [], []
    for r in doc["rows"]:
        body.append(_report_cells(doc, r, list(robust or {})))
        pub = r.get("published")
        if r.get("budget") == "matched":
            notes.append(f"{r['member']}: stopped at the other members' median wall time")
        if pub:
            notes.append(f"*{r['member']}: {pub['source']}; {pub['setting']}")
    title = f"suite {doc['suite']}: {doc['folder']}"
    out.print(table(title, cols, body, right=tuple(range(1, len(cols)))))
    _print_claims(doc)
    _print_tuning_summary(doc)
    for test in doc["tests"]:
        n = next(
            (r["tests"][test]["images"] for r in doc["rows"] if r["tests"][test]["images"]), None
        )
        if n:
            err.print(Text(f"{test}: {n:,} test images"))
    for line in notes:
        err.print(Text(line))
    _print_footnotes(doc, robust)


def _print_footnotes(doc: dict[str, Any], robust: dict[str, Any] | None) -> None:
    """Under the report's table: the robustness settings, shared runs, machine time, what the
    spreads are."""
    if robust:
        n = next((v["images"] for v in robust.values() if v.get("images")), None)
        err.print(
            Text(
                f"robustness: untargeted white-box attacks with each model's own loss on "
                f"{n or '?'} test images (PGD: 10 steps of 2.5 eps / 10, random start); "
                "corruptions: mean over CIFAR-10-C's 15 corruptions x 5 severities"
            )
        )
    shared = [f"{r['member']} {r['shared_runs']}" for r in doc["rows"] if r.get("shared_runs")]
    if shared:
        err.print(
            Text(
                "shared the machine (runs whose load average passed their CPUs by 1 or more; "
                f"their seconds are upper bounds): {', '.join(shared)}"
            )
        )
    if doc.get("wall_s_total") is not None:
        spent = fmt_duration(doc["wall_s_total"])
        err.print(Text(f"machine time: {spent} over {doc['runs']} runs (their wall times)"))
    err.print(
        Text(
            "std: over seeds (ddof 1); se: its standard error; one run's sampling error from "
            "the test set alone is test_se in --json"
        )
    )


def _report_cells(doc: dict[str, Any], r: dict[str, Any], robust: list[str]) -> list[str]:
    """One member's row of the report's table."""
    cells = [r["member"]]
    for test in doc["tests"]:
        t = r["tests"][test]
        se = f" ({_pct(t['top1_se'])})" if t["top1_se"] is not None else ""
        cells.append(_acc_cell(t) + se)
    cells.append(f"{len(r['seeds_done'])}/{len(r['seeds_planned'])}")
    cells.append(f"{r['params']:,}" if r["params"] is not None else "-")
    cells.append(f"{r['gflops']:.3f}" if r["gflops"] is not None else "-")
    cells.append(f"{r['epochs']:.1f}" if r["epochs"] is not None else "-")
    tuned = {"val": "v", "recipe": ""}.get(r.get("lr_chosen_on") or "", "?")
    cells.append(f"{r['lr']}{tuned}" if r.get("lr") else "-")
    cells.append(f"{r['wall_s']:.0f}" if r["wall_s"] is not None else "-")
    speed = r["train_images_per_s"]
    cells.append(f"{speed:.0f}" if speed is not None else "-")
    pub = r.get("published")
    cells.append(_published(pub["top1"]) + "*" if pub else "-")
    for key in robust:
        cells.append(_acc_cell((r.get("robustness") or {}).get(key) or {"top1_mean": None}))
    return cells


def _print_tuning_summary(doc: dict[str, Any]) -> None:
    """Under the table: how each tuned member's learning rate was chosen (``v`` in the lr
    column), from its validation scores; ``?``: runs of another learning rate than the choice."""
    if not doc.get("tuning"):
        return
    err.print(Text("lr v: chosen on a validation split (final validation top-1 % per lr):"))
    for t in doc["tuning"]:
        scores = ", ".join(
            f"{r['lr']:.6g}: {'diverged' if r.get('diverged') else _pct(r['val_accuracy'])}"
            for r in t["runs"]
            if r["finished"]
        )
        if t.get("chosen") is None:
            what = f"still tuning ({len(t['todo'])} to train)"
        else:
            what = f"{t['chosen']:.6g}"
        err.print(Text(f"  {t['member']}: {what}" + (f" ({scores})" if scores else "")))
    if any(r.get("lr_chosen_on") is None and r.get("lr") for r in doc["rows"]):
        err.print(Text("lr ?: the runs' learning rate is not the one chosen on validation"))


def _published(top1: str) -> str:
    """``"0.9154-0.9214"`` -> ``"91.54-92.14"``; other text as it is."""
    try:
        parts = [float(p) for p in top1.split("-")]
    except ValueError:
        return top1
    return "-".join(f"{100 * p:.2f}" for p in parts)


def _print_claims(doc: dict[str, Any]) -> None:
    """The suite's claims, each as a difference with its interval and verdict."""
    if not doc.get("claims"):
        return
    out.print(Text("claims, as differences with a 95% interval over seeds (Welch):"))
    for line in doc["claims_text"].splitlines():
        out.print(Text(line))


def print_tuning(result: dict[str, Any]) -> None:
    """``capsctl suite tune``'s table: per member and learning rate, the final validation
    accuracy, and the choice with the line that records it in the suite file."""
    rows = []
    for m in result["members"]:
        for run in m["runs"]:
            mark = "to train" if not run["finished"] else ""
            if run.get("diverged"):
                mark = "diverged"
            elif run["finished"] and run["lr"] == m["chosen"]:
                mark = "chosen"
            own = " (own)" if run["lr"] == m["own_lr"] else ""
            rows.append([m["member"], f"{run['lr']:.6g}{own}", _pct(run["val_accuracy"]), mark])
    title = f"suite {result['suite']}: learning rates on the validation split"
    out.print(table(title, ["member", "lr", "val top-1 %", ""], rows, right=[2]))
    for m in result["members"]:
        if m["chosen"] is None:
            err.print(f"{m['member']}: {len(m['todo'])} learning rate(s) still to train")
            continue
        edge = " (on the grid's edge after every extension)" if m["on_edge"] else ""
        out.print(Text(f"{m['member']}{edge}: {m['suite_entry']}"))
