"""``capsctl robustness``: a table per checkpoint, side-by-side tables for several, CSV rows."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from typing import Any

from capsctl.views.common import fmt_pct, footnote, out, table

__all__ = ["print_robustness", "robustness_csv"]

CSV_COLUMNS = [
    "checkpoint", "test", "setting", "magnitude", "accuracy", "success_rate", "seconds"
]  # fmt: skip

#: (test, setting, magnitude label, magnitude, accuracy, success rate, seconds)
_Row = tuple[str, str, str, float | None, float, float | None, float | None]


def _rows(r: Any) -> list[_Row]:
    """The rows of one result; seconds per attack and per shift (a corruption's five
    severities are timed together: its first row carries them)."""
    rows: list[_Row] = [("clean", "-", "-", None, r.clean_accuracy, None, None)]
    for p in r.attacks:
        kind = "targeted" if p.targeted else "untargeted"
        mag = f"eps {p.eps * 255:g}/255"
        rows.append((p.attack, kind, mag, p.eps, p.accuracy, p.success_rate, p.seconds))
    for p in r.shifts:
        rows.append((p.shift, "-", f"{p.magnitude:g}", p.magnitude, p.accuracy, None, p.seconds))
    for c in r.corruptions:
        for sev, acc in enumerate(c.accuracies, 1):
            took = c.seconds if sev == 1 else None
            rows.append(("corruption", c.name, f"severity {sev}", float(sev), acc, None, took))
    return rows


def _secs(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _footer(results: Sequence[Any]) -> None:
    r = results[0]
    if any(x.attacks for x in results):
        cw = r.loss_name == "cw_margin"  # every result's attacks use the one --loss
        loss = "the Carlini-Wagner margin loss (--loss cw)" if cw else "each model's own loss"
        footnote(
            f"attacks: white-box L-inf on [0, 1] pixels with {loss}; PGD: "
            f"random start, {r.steps} steps of 2.5 * eps / steps (Madry et al.); success rate "
            "over the images correct before the attack"
        )
    if any(x.flip for x in results):
        footnote("flip: outputs averaged with the mirror image's, attacked and scored alike")
    if any(x.corruptions for x in results):
        footnote(
            "corruptions: CIFAR-10-C's constants; * = documented substitute (frost*: generated "
            "frost texture; motion_blur*, snow*: line-kernel motion blur instead of ImageMagick)"
        )


def _single(r: Any, name: str) -> None:
    rows = [
        [test, setting, mag, fmt_pct(acc), fmt_pct(rate), _secs(took)]
        for test, setting, mag, _, acc, rate, took in _rows(r)
        if test != "corruption"
    ]
    title = f"{name}: {r.model} on {r.count:,} {r.dataset} test images (loss {r.loss_name})"
    heads = ["test", "setting", "magnitude", "accuracy", "success", "seconds"]
    out.print(table(title, heads, rows, (3, 4, 5)))
    if r.corruptions:
        crow = [
            [c.name, *map(fmt_pct, c.accuracies), fmt_pct(c.mean), _secs(c.seconds)]
            for c in r.corruptions
        ]
        crow.append(["mean", "", "", "", "", "", fmt_pct(r.mean_corruption_accuracy), ""])
        heads = ["corruption", "s1", "s2", "s3", "s4", "s5", "mean", "seconds"]
        out.print(table("corruption accuracy", heads, crow, range(1, 8)))


def _side_by_side(results: Sequence[Any], names: Sequence[str]) -> None:
    keys: list[tuple[str, str, str]] = []
    cells: list[dict[tuple[str, str, str], str]] = []
    for r in results:
        mine = {}
        for test, setting, mag, _, acc, rate, _ in _rows(r):
            key = (test, setting, mag)
            if key not in keys:
                keys.append(key)
            mine[key] = fmt_pct(acc) + ("" if rate is None else f" ({fmt_pct(rate)})")
        if r.corruptions:
            key = ("corruption", "mean", "-")
            keys.append(key) if key not in keys else None
            mine[key] = fmt_pct(r.mean_corruption_accuracy)
        cells.append(mine)
    heads = ["test", "setting", "magnitude", *names]
    rows = [[*k, *(c.get(k, "-") for c in cells)] for k in keys]
    right = range(3, 3 + len(results))
    out.print(table("accuracy (attack success rate)", heads, rows, right, key=3))


def print_robustness(results: Sequence[Any], names: Sequence[str] | None = None) -> None:
    """One table per checkpoint, or one side-by-side table for several; then the footnotes.
    ``names``: each checkpoint as the user gave it (a shipped name, a run folder), which heads
    its table or column; by default the file each result was measured on."""
    shown = list(names) if names is not None else [r.checkpoint for r in results]
    if len(results) == 1:
        _single(results[0], shown[0])
    else:
        _side_by_side(results, shown)
    _footer(results)


def robustness_csv(results: Sequence[Any]) -> str:
    """CSV with :data:`CSV_COLUMNS`, one row per checkpoint and setting."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for r in results:
        for test, setting, _, mag, acc, rate, took in _rows(r):
            writer.writerow(
                [r.checkpoint, test, setting, "" if mag is None else f"{mag:g}", f"{acc:.6f}",
                 "" if rate is None else f"{rate:.6f}", "" if took is None else f"{took:.3f}"]
            )  # fmt: skip
    return buf.getvalue()
