"""``capsctl train``: the summary lines after a run."""

from __future__ import annotations

from typing import Any

from capsctl.views.common import fmt_pct, out

__all__ = ["print_fit_result"]


def print_fit_result(result: Any) -> None:
    """Run folder, best validation accuracy, the single test result and the time."""
    out.print(f"run folder: {result.out_dir}")
    if result.best_val_accuracy is not None:
        out.print(
            f"best validation accuracy {fmt_pct(result.best_val_accuracy)} "
            f"(epoch {result.best_epoch})"
        )
    test = result.test
    if test is not None:
        out.print(
            f"test accuracy {fmt_pct(test.accuracy)} on {test.count:,} images "
            f"({test.dataset}), top-5 {fmt_pct(test.top5)}, "
            f"{test.loss_name} loss {test.loss:.4f}"
        )
    out.print(f"time {result.seconds:.1f} s")
