"""``capsctl models`` and ``capsctl presets``: what is registered and bundled."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from capsctl.views.common import fmt_int, fmt_pct, footnote, out, table

__all__ = ["print_models", "print_presets"]


def print_models(rows: Sequence[dict[str, Any]]) -> None:
    out.print(
        table(
            "Registered models",
            ["name", "params", "backbone", "capsules", "classes", "input", "description"],
            [
                [
                    r["name"],
                    fmt_int(r["params"]["total"]),
                    fmt_int(r["params"]["backbone"]),
                    fmt_int(r["params"]["capsules"]),
                    r["num_classes"],
                    "x".join(map(str, r["input"])),
                    r["description"],
                ]
                for r in rows
            ],
            right=(1, 2, 3, 4),
        )
    )


def print_presets(items: Sequence[tuple[str, str]]) -> None:
    out.print(table("Presets (capsctl train --preset NAME)", ["name", "description"], items))


def print_weights(rows: Sequence[dict[str, Any]]) -> None:
    """The shipped weights: ``capsctl eval NAME`` reproduces each accuracy."""
    out.print(
        table(
            "Shipped weights (NAME goes wherever a checkpoint does)",
            ["name", "model", "router", "test set", "accuracy", "params", "size"],
            [
                [
                    r["name"],
                    r["model"],
                    r["router"] or "-",
                    r["test_set"],
                    fmt_pct(r["accuracy"]),
                    fmt_int(r["params"]),
                    f"{r['bytes'] / 1e6:.1f} MB",
                ]
                for r in rows
            ],
            right=(4, 5, 6),
        )
    )
    footnote("each row: capsctl eval NAME gives that accuracy; --json adds command, commit, source")
