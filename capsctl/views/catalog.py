"""``capsctl models`` and ``capsctl presets``: what is registered and bundled."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from capsctl.views.common import fmt_int, out, table

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
