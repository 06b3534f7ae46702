"""``capsctl eval`` and ``capsctl predict``: accuracy, per-class tables, CSV rows, top-k classes."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import RenderableType
from rich.text import Text

from capsctl.views.common import fmt_pct, note, out, styled, table

__all__ = ["EVAL_CSV_COLUMNS", "eval_csv", "print_evaluation", "print_predictions"]


def print_evaluation(ckpt: str, meta: dict[str, Any], res: Any) -> None:
    """Header, accuracy line, and per-class accuracy with the confusion matrix (or recall)."""
    out.print(
        styled(
            (ckpt, "bold"),
            f"  epoch {meta.get('epoch')}  {res.split} split of {res.dataset}: "
            f"{res.count:,} images",
        )
    )
    name = "top-1" if res.metric == "top-1" else res.metric
    out.print(
        f"{name} {fmt_pct(res.accuracy)}  top-5 {fmt_pct(res.top5)}  "
        f"{res.loss_name} loss {res.loss:.4f}  {res.images_per_s:.0f} images/s"
    )
    out.print(_per_class_table(res))


def _per_class_table(res: Any) -> RenderableType:
    if not res.confusion:  # multi-label data: per-class recall only
        rows = [[c, fmt_pct(r, 1)] for c, r in zip(res.classes, res.per_class, strict=True)]
        return table("Per-class recall", ["class", "recall"], rows, right=(1,))
    n = len(res.classes)
    rows = [
        [res.classes[i], fmt_pct(res.per_class[i], 1), sum(res.confusion[i]), *res.confusion[i]]
        for i in range(n)
    ]
    if n > 20:
        return table("Per-class accuracy", ["class", "acc", "n"], [r[:3] for r in rows], (1, 2))
    return table(
        "Per-class accuracy and confusion matrix (rows: true, columns: predicted)",
        ["class", "acc", "n", *res.classes],  # whole names: a wide matrix folds
        rows,
        right=tuple(range(1, n + 3)),
    )


def print_predictions(ckpt: str, res: Any) -> None:
    """``capsctl predict``: what was done to the images, then the top-k table."""
    out.print(
        styled(
            (ckpt, "bold"),
            f"  {res.arch}, {res.num_classes} classes, {len(res.predictions)} image(s)",
        )
    )
    out.print(f"preprocessing: {res.preprocessing}")
    out.print(f"score: {res.score_description}")
    out.print(predict_table(f"Top-{res.top_k} classes", res.to_dict()["images"]))
    if res.skipped:
        note(f"skipped {len(res.skipped)} file(s); see the warnings above")


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


def predict_table(title: str, predictions: Sequence[dict[str, Any]]) -> RenderableType:
    """``capsctl predict``: one group of rows per image (its top-k classes, best first); long
    paths are cut from the left, the scores always show whole.

    ``predictions``: the ``images`` entries of ``PredictResult.to_dict()``.
    """
    rows: list[list[Any]] = []
    ends: list[int] = []
    for p in predictions:
        for rank, top in enumerate(p["top"], 1):
            first = rank == 1
            rows.append(
                [
                    str(p["path"]) if first else "",
                    rank,
                    Text(str(top["class"]), style="bold" if first else ""),
                    f"{100 * top['score']:.1f}%",
                    str(p["input"]) if first else "",
                ]
            )
        ends.append(len(rows) - 1)
    return table(
        title,
        ["image", "#", "class", "score", "input"],
        rows,
        right=(1, 3),
        shorten=(0,),
        section_ends=ends,
    )
