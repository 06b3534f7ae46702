"""``capsctl export``, ``inspect-routing`` and ``plot``: what was written and shown."""

from __future__ import annotations

from typing import Any

from rich.console import RenderableType

from capsctl.views.common import fmt_bytes, fmt_pct, note, out, styled, table, warning_line

__all__ = ["print_export", "print_inspection", "print_plot"]


def print_export(res: Any) -> None:
    for line in res.notes:
        note(warning_line(line, "note:"))
    diff = "-" if res.max_abs_diff is None else f"{res.max_abs_diff:.2e}"
    if res.format == "hf":
        out.print(
            f"wrote model folder {res.path} ({', '.join(res.files)}; {fmt_bytes(res.size_bytes)})"
        )
        out.print(f"max |folder - checkpoint| = {diff} on {res.checked_on} (must be identical)")
        return
    out.print(f"wrote {res.path} ({fmt_bytes(res.size_bytes)}) and {res.sidecar}")
    out.print(f"max |exported - eager| = {diff} on {res.checked_on} (tolerance {res.tolerance:g})")


def print_inspection(result: Any) -> None:
    """Header, three tables and the files written, from an InspectionResult."""
    out.print(
        styled(
            (str(result.checkpoint), "bold"),
            f"  {result.algorithm}, T={result.iterations} {result.routing}  on {result.inputs}  "
            f"(coefficients: {result.coefficient_name})",
        )
    )
    out.print(_statistics_table(result))
    out.print(
        table(
            "Parent types receiving the most routing (last iteration)",
            ["layer", "parent type (share)"],
            [
                [
                    f"{layer.index}: {layer.kind}",
                    ", ".join(f"{j} ({100 * s:.1f}%)" for j, s in layer.parents_receiving),
                ]
                for layer in result.layers
            ],
        )
    )
    out.print(_children_table(result))
    for w in result.written[:3]:
        note(f"wrote {w}")
    if len(result.written) > 3:
        note(f"... and {len(result.written) - 3} more files")


def _statistics_table(result: Any) -> RenderableType:
    rows = []
    for layer in result.layers:
        name = f"{layer.index}: {layer.kind} {layer.child_types}->{layer.parent_types}"
        for it in layer.iterations:
            rows.append(
                [
                    name if it.iteration == 1 else "",
                    it.iteration,
                    f"{it.mean_entropy:.3f}",
                    f"{it.mean_max:.3f}",
                    "-" if it.top_changed is None else fmt_pct(it.top_changed, 1),
                    "-" if it.pose_stability is None else f"{it.pose_stability:.3f}",
                ]
            )
    return table(
        "Routing statistics (entropy normalized to [0, 1]; 1 = uniform)",
        ["layer", "iter", "entropy", "max coeff", "top parent changed", "pose stability"],
        rows,
        right=(1, 2, 3, 4, 5),
    )


def _children_table(result: Any) -> RenderableType:
    rows = []
    for im in result.images:
        kids = ", ".join(
            f"type {c.type}"
            + (f" @({c.h},{c.w})" if c.h is not None else "")
            + f" {c.coefficient:.2f}"
            for c in im.top_children
        )
        rows.append(
            [
                im.index,
                im.predicted_class,
                f"{100 * im.probability:.1f}%",
                im.label_class or "-",
                kids,
            ]
        )
    return table(
        "Child capsules routing into the predicted class",
        ["image", "predicted", "p", "label", "top children (coefficient)"],
        rows,
        right=(0, 2),
    )


def print_plot(path: Any, keys: list[str], read: list[dict[str, Any]]) -> None:
    epochs = ", ".join(f"{e['name']} {e['epochs']} epochs" for e in read)
    out.print(f"wrote {path}  ({', '.join(keys)}; {epochs})", soft_wrap=True)
