"""Terminal output: rich tables on stdout, progress on stderr, ``--json`` as plain JSON.

Only the CLI imports this module. ``NO_COLOR`` is honoured by rich itself.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table


def _width(stream: object) -> int | None:
    """Terminal width for a TTY (rich decides); a wide page when output is piped or captured."""
    if os.environ.get("COLUMNS"):
        return None
    isatty = getattr(stream, "isatty", None)
    return None if callable(isatty) and isatty() else 160


out = Console(highlight=False, width=_width(sys.stdout))
err = Console(stderr=True, highlight=False, width=_width(sys.stderr))


def print_json(doc: Any) -> None:
    """One JSON document on stdout and nothing else (rich would wrap long lines)."""
    sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
    sys.stdout.flush()


def error(message: str) -> None:
    err.print(f"[bold red]error:[/] {message}", soft_wrap=True)


def note(message: str) -> None:
    err.print(message, soft_wrap=True)


def fmt_int(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def fmt_pct(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def table(
    title: str | None,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    right: Sequence[int] = (),
) -> Table:
    t = Table(title=title, title_justify="left", header_style="bold")
    last = len(columns) - 1
    for i, c in enumerate(columns):
        t.add_column(
            c,
            justify="right" if i in right else "left",
            no_wrap=i != last,
            overflow="fold" if i != last else "ellipsis",
        )
    for r in rows:
        t.add_row(*[str(v) for v in r])
    return t


class TrainProgress:
    """Progress bar on stderr for ``capsctl train``, fed with the engine's events."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[speed]} img/s"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=err,
            transient=True,
            disable=quiet,
        )
        self.task: TaskID | None = None

    def __enter__(self) -> TrainProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)  # type: ignore[arg-type]

    def __call__(self, e: dict[str, Any]) -> None:
        kind = e["event"]
        if kind == "epoch_start":
            if self.task is not None:
                self.progress.remove_task(self.task)
            self.task = self.progress.add_task(
                f"epoch {e['epoch']}/{e['epochs']}", total=e["steps"], loss="-", speed="-"
            )
        elif kind == "step" and self.task is not None:
            self.progress.update(
                self.task,
                completed=e["step"],
                loss=f"{e['loss']:.4f}",
                speed=f"{e['images_per_s']:.0f}",
            )
        elif kind == "epoch_end":
            val = (
                f"  val acc {fmt_pct(e.get('val_accuracy'))}  val loss {e.get('val_loss', 0):.4f}"
                if "val_accuracy" in e
                else ""
            )
            star = "  [green]best[/]" if e.get("best") else ""
            if not self.quiet:
                self.progress.console.print(
                    f"epoch {e['epoch']:>3}/{e['epochs']}  loss {e['train_loss']:.4f}  "
                    f"train acc {fmt_pct(e['train_accuracy'])}{val}  lr {e['lr']:.3g}  "
                    f"{e['epoch_seconds']:.1f} s  {e['images_per_s']:.0f} img/s{star}"
                )
        elif kind == "data" and not self.quiet:
            self.progress.console.print(
                f"data: {e['train']:,} train / {e['val']:,} val / {e['test']:,} test "
                f"({e['test_name']})"
            )
        elif kind == "resume" and not self.quiet:
            self.progress.console.print(f"resuming from {e['path']} after epoch {e['epoch']}")
            for c in e.get("changes") or []:
                self.progress.console.print(
                    f"  changed on resume: {c['field']} {c['old']!r} -> {c['new']!r}"
                )
        elif kind == "download" and not self.quiet:
            if self.task is None:
                self.task = self.progress.add_task(
                    "download", total=e.get("total"), loss="-", speed="-"
                )
            self.progress.update(self.task, completed=e["done"], total=e.get("total"))
        elif kind == "warning":
            self.progress.console.print(f"[yellow]warning:[/] {e['message']}")


@contextmanager
def simple_progress(description: str, quiet: bool = False) -> Iterator[Any]:
    """A progress bar for evaluation-like loops; yields an event callback."""
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=quiet,
    )
    task: dict[str, TaskID] = {}

    def on_event(e: dict[str, Any]) -> None:
        kind = e.get("event")
        if kind in ("eval_step", "bench_step"):
            total = e.get("steps") or e.get("total")
            key = f"{description} {e.get('name', e.get('split', ''))}".strip()
            if key not in task:
                task[key] = progress.add_task(key, total=total)
            progress.update(task[key], completed=e["step"], total=total)
        elif kind == "warning" and not quiet:
            progress.console.print(f"[yellow]warning:[/] {e['message']}")

    with progress:
        yield on_event


#: ``capsctl eval --csv`` columns: timm's validation results (``model`` ... ``param_count``,
#: accuracies in percent, parameters in millions), then capsctl's own.
EVAL_CSV_COLUMNS = (
    "model",
    "img_size",
    "top1",
    "top1_err",
    "top5",
    "top5_err",
    "param_count",
    "checkpoint",
    "epoch",
    "split",
    "dataset",
    "count",
    "loss",
    "loss_name",
    "metric",
    "images_per_s",
    "params",
)


def eval_csv(checkpoint: str, meta: dict[str, Any], result: dict[str, Any]) -> str:
    """A header line and one row for an evaluation (``EvalResult.to_dict()`` and its metadata).

    ``model`` is the checkpoint's preset name (else the file's stem), ``img_size`` the input
    side, ``top1``/``top5`` percent with ``*_err`` = 100 - value, ``param_count`` millions
    (2 decimals, as timm writes it) and ``params`` the exact count; empty cells for unknowns.
    """
    import csv
    import io
    from pathlib import Path

    preset = meta.get("preset") if isinstance(meta.get("preset"), dict) else {}
    model_cfg = preset.get("model") if isinstance(preset.get("model"), dict) else {}
    params = meta.get("params") if isinstance(meta.get("params"), dict) else {}
    total = params.get("total")
    top1 = 100.0 * float(result["accuracy"])
    top5 = 100.0 * float(result["top5"])
    row = {
        "model": preset.get("name") or Path(checkpoint).stem,
        "img_size": meta.get("input_size") or model_cfg.get("input_size"),
        "top1": round(top1, 4),
        "top1_err": round(100.0 - top1, 4),
        "top5": round(top5, 4),
        "top5_err": round(100.0 - top5, 4),
        "param_count": round(total / 1e6, 2) if isinstance(total, int) else None,
        "checkpoint": checkpoint,
        "epoch": meta.get("epoch"),
        "split": result.get("split"),
        "dataset": result.get("dataset"),
        "count": result.get("count"),
        "loss": round(float(result["loss"]), 6),
        "loss_name": result.get("loss_name"),
        "metric": result.get("metric"),
        "images_per_s": round(float(result["images_per_s"]), 2),
        "params": total,
    }
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(EVAL_CSV_COLUMNS)
    writer.writerow(["" if row[c] is None else row[c] for c in EVAL_CSV_COLUMNS])
    return buf.getvalue()


def predict_table(title: str, predictions: Sequence[dict[str, Any]]) -> Table:
    """``capsctl predict``: one group of rows per image (its top-k classes, best first).

    ``predictions``: the ``images`` entries of ``PredictResult.to_dict()``.
    """
    from rich.markup import escape

    t = Table(title=title, title_justify="left", header_style="bold")
    t.add_column("image", no_wrap=True, overflow="fold")
    t.add_column("#", justify="right", no_wrap=True)
    t.add_column("class", no_wrap=True, overflow="fold")
    t.add_column("score", justify="right", no_wrap=True)
    t.add_column("input", overflow="fold")
    for i, p in enumerate(predictions):
        for rank, top in enumerate(p["top"], 1):
            first = rank == 1
            name = escape(str(top["class"]))
            t.add_row(
                escape(str(p["path"])) if first else "",
                str(rank),
                f"[bold]{name}[/]" if first else name,
                f"{100 * top['score']:.1f}%",
                escape(str(p["input"])) if first else "",
                end_section=rank == len(p["top"]) and i < len(predictions) - 1,
            )
    return t
