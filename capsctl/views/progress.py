"""Progress on stderr, fed with the library's events (see :mod:`capsctl.events`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from capsctl.views.common import err, fmt_pct, styled, warning_line

__all__ = ["TrainProgress", "simple_progress"]


class TrainProgress:
    """Progress bar on stderr for ``capsctl train``, fed with the trainer's events."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet
        self.progress = Progress(
            TextColumn("{task.description}", style="bold", markup=False),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[speed]} img/s"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=err,
            transient=True,
            disable=quiet or not err.is_interactive,  # off a terminal: no bar, no empty line
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
            star = ("  best", "green") if e.get("best") else ""
            if not self.quiet:
                self.progress.console.print(
                    styled(
                        f"epoch {e['epoch']:>3}/{e['epochs']}  loss {e['train_loss']:.4f}  "
                        f"train acc {fmt_pct(e['train_accuracy'])}{val}  lr {e['lr']:.3g}  "
                        f"{e['epoch_seconds']:.1f} s  {e['images_per_s']:.0f} img/s",
                        star,
                    )
                )
        elif kind == "data" and not self.quiet:
            self.progress.console.print(
                f"data: {e['train']:,} train / {e['val']:,} val / {e['test']:,} test "
                f"({e['test_name']})"
            )
        elif kind == "precision" and not self.quiet:
            self.progress.console.print(f"precision: {e['reason']}", soft_wrap=True)
        elif kind == "routing" and not self.quiet:
            self.progress.console.print(routing_line(e["backend"], e["reason"]), soft_wrap=True)
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
            self.progress.console.print(warning_line(str(e["message"])), soft_wrap=True)


#: How each backend of capsctl/layers/backend/dispatch.py reads in the training header.
ROUTING_WORDS = {
    "native": "compiled CPU loops",
    "triton": "fused Triton kernels",
    "chunked": "torch code",
    "dense": "one torch expression",
}


def routing_line(backend: str, reason: str) -> str:
    """``routing: compiled CPU loops``, or the slower implementation and why."""
    words = ROUTING_WORDS.get(backend, backend)
    return f"routing: {words}" + (f" ({reason})" if reason else "")


@contextmanager
def simple_progress(description: str, quiet: bool = False) -> Iterator[Any]:
    """A progress bar for evaluation-like loops; yields an event callback."""
    progress = Progress(
        TextColumn("{task.description}", style="bold", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=quiet or not err.is_interactive,  # off a terminal: no bar, no empty line
    )
    task: dict[str, TaskID] = {}

    def on_event(e: dict[str, Any]) -> None:
        kind = e.get("event")
        if kind in ("eval_step", "bench_step", "progress"):
            total = e.get("steps")
            key = f"{description} {e.get('name', e.get('split', ''))}".strip()
            if key not in task:
                task[key] = progress.add_task(key, total=total)
            progress.update(task[key], completed=e["step"], total=total)
        elif kind == "warning" and not quiet:
            progress.console.print(warning_line(str(e["message"])), soft_wrap=True)

    with progress:
        yield on_event
