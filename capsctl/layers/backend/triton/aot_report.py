"""The ahead-of-time report's rows: captured launches grouped into compiled variants, one row
per variant and architecture with its resources, modelled time and broken budgets, and the
budgets' and the training steps' summaries (scripts/gpu_aot.py prints and writes them).

A capture is the launches of one training step (capsctl/layers/backend/triton/aot.py) with
what it ran: ``{"model", "router", "schedule", "precision"}`` (``precision``: ``float32`` or
``bf16`` autocast). A variant's ``dtype`` is the element type its kernel was compiled for
(that of its child poses), which autocast need not change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from capsctl.layers.backend.triton.aot_compile import arch_name
from capsctl.layers.backend.triton.aot_cost import (
    BUDGETS,
    broken_budgets,
    flop_rate,
    launch_cost,
    launch_dims,
    modelled_us,
)

__all__ = [
    "Variant",
    "budget_summary",
    "describe",
    "group_variants",
    "step_summary",
    "step_table",
    "variant_row",
]


@dataclass
class Variant:
    """One compiled variant: its :attr:`Launch.key <capsctl.layers.backend.triton.aot.Launch>`,
    a launch of it (for its spec), and every ``(capture context, launch)`` that launched it."""

    key: str
    launch: Any
    uses: list[tuple[dict[str, Any], Any]] = field(default_factory=list)

    def spec(self) -> dict[str, Any]:
        return self.launch.spec()

    def contexts(self, name: str) -> list[Any]:
        """The distinct values of ``name`` among the captures that launched it, in order."""
        out: list[Any] = []
        for ctx, _ in self.uses:
            if ctx[name] not in out:
                out.append(ctx[name])
        return out


def group_variants(captures: Sequence[tuple[dict[str, Any], Sequence[Any]]]) -> list[Variant]:
    """The distinct variants of ``captures`` (``(context, launches)`` pairs), in the order
    first launched."""
    found: dict[str, Variant] = {}
    for ctx, launches in captures:
        for launch in launches:
            key = launch.key
            if key not in found:
                found[key] = Variant(key, launch)
            found[key].uses.append((ctx, launch))
    return list(found.values())


def describe(launch: Any) -> dict[str, str]:
    """The capsctl pass and direction a launch belongs to: ``{"pass": routed | weighted |
    em_moments | em_quad | em_estep_moments | gate | squash | e_step | m_step | overlap,
    "direction": forward | backward}``."""
    family, direction = _KERNELS[launch.kernel]
    flags = dict(launch.constexprs)
    if launch.kernel == "overlap_reduce" and flags.get("TO_GRID"):
        direction = "backward"  # the window copy's gradient (else a sum or max over windows)
    name = {
        "pass": "routed" if flags.get("ROUTED") else "weighted",
        "em": "em_quad" if flags.get("QUAD") else "em_moments",
        "em_estep": "em_estep_moments",
        "gate": "gate",
        "squash": "squash",
        "estep": "e_step",
        "mstep": "m_step",
        "overlap": "overlap",
    }[family]
    return {"pass": name, "direction": direction}


# each kernel's family and direction (the input and weight gradients: the backward's second
# and third kernels)
_KERNELS = {
    "pass_forward": ("pass", "forward"),
    "pass_backward": ("pass", "backward"),
    "pass_input_grad": ("pass", "backward"),
    "pass_weight_grad": ("pass", "backward"),
    "em_forward": ("em", "forward"),
    "em_backward": ("em", "backward"),
    "em_input_grad": ("em", "backward"),
    "em_weight_grad": ("em", "backward"),
    "em_estep_stats": ("em_estep", "forward"),
    "em_estep_moments": ("em_estep", "forward"),
    "em_estep_rowdot": ("em_estep", "backward"),
    "em_estep_parent_grad": ("em_estep", "backward"),
    "em_estep_input_grad": ("em_estep", "backward"),
    "em_estep_weight_grad": ("em_estep", "backward"),
    "gate_forward": ("gate", "forward"),
    "gate_backward": ("gate", "backward"),
    "squash_forward": ("squash", "forward"),
    "squash_backward": ("squash", "backward"),
    "estep_forward": ("estep", "forward"),
    "estep_rowdot": ("estep", "backward"),
    "estep_backward": ("estep", "backward"),
    "m_step_forward": ("mstep", "forward"),
    "m_step_backward": ("mstep", "backward"),
    "overlap_reduce": ("overlap", "forward"),
    "overlap_lse": ("overlap", "forward"),
}


def _joined(values: Sequence[Any]) -> Any:
    real = [str(v) for v in values if v is not None]
    return ",".join(real) if real else None


def _shapes(variant: Variant) -> list[dict[str, Any]]:
    """The distinct launch shapes of a variant with their bytes, FLOPs and models."""
    shapes: dict[tuple, dict[str, Any]] = {}
    for ctx, launch in variant.uses:
        dims = {k: int(launch.value(k)) for k in launch_dims(launch)}
        key = (*dims.values(), launch.grid)
        if key not in shapes:
            shapes[key] = {**dims, "grid": list(launch.grid), **launch_cost(launch), "models": []}
            shapes[key]["launch"] = launch
        if ctx["model"] not in shapes[key]["models"]:
            shapes[key]["models"].append(ctx["model"])
    return list(shapes.values())


def variant_row(variant: Variant, arch: int, result: dict[str, Any]) -> dict[str, Any]:
    """The report's row of ``variant`` compiled for ``arch`` (``result``: what
    :meth:`~capsctl.layers.backend.triton.aot_compile.Compiler.compile` gave)."""
    models = variant.contexts("model")
    rate, rate_kind = flop_rate(launch_cost(variant.launch)["dtype"], bool(result.get("mma")))
    shapes = _shapes(variant)
    for s in shapes:
        s.pop("launch")
        s["modelled_us"] = round(modelled_us(s["bytes"], s["flops"], rate), 2)
    worst = max(shapes, key=lambda s: s["modelled_us"])
    row = {
        "id": variant.key,
        "kernel": variant.launch.kernel,
        "model": ",".join(models),
        "models": models,
        "router": _joined(variant.contexts("router")),
        **describe(variant.launch),
        "schedule": _joined(variant.contexts("schedule")),
        "dtype": launch_cost(variant.launch)["dtype"],
        "precisions": variant.contexts("precision"),
        "arch": arch_name(arch),
    }
    keep = ("registers", "spill_bytes", "stack_bytes", "shared_bytes", "compile_s")
    row |= {k: result.get(k) for k in keep}
    row["modelled_us"] = worst["modelled_us"]
    row |= {k: v for k, v in result.items() if k not in row}
    row |= {"flop_rate": rate_kind, "launches": len(variant.uses), "shapes": shapes}
    row |= {"occupancy_warps": _warps(result), "constexprs": variant.spec()["constexprs"]}
    row["divisible_by_16"] = variant.spec()["divisible"]
    row["broken"] = broken_budgets(row) if row["arch"] == BUDGETS["arch"] else None
    return row


def _warps(result: dict[str, Any]) -> int | None:
    """Warps a streaming multiprocessor holds with the variant's registers (64 at most;
    65,536 registers, allocated 8 a thread at a time)."""
    regs, warps = result.get("registers"), result.get("num_warps")
    if not regs or not warps:
        return None
    per_block = -(-regs // 8) * 8 * 32 * warps
    return min(64, (65536 // per_block) * warps)


def budget_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Which variants break which budget on :data:`BUDGETS`' architecture."""
    checked = [r for r in rows if r["arch"] == BUDGETS["arch"]]
    broken: dict[str, list[str]] = {}
    for r in checked:
        for b in r["broken"] or []:
            broken.setdefault(b, []).append(r["id"])
    limits = {k: v for k, v in BUDGETS.items() if k != "arch"}
    return {
        "arch": BUDGETS["arch"],
        "limits": limits,
        "checked": len(checked),
        "broken": broken,
        "variants_breaking": sorted({i for ids in broken.values() for i in ids}),
        "ok": bool(checked) and not broken,
    }


def step_summary(variants: Sequence[Variant], rows: Sequence[dict[str, Any]]) -> list[dict]:
    """Per training step captured (model, schedule, precision): its launches, distinct
    variants and the sum of their modelled µs (*estimated*) on the budgets' architecture (or
    the first one compiled), over the ``modelled_launches`` whose variant was compiled."""
    archs = [r["arch"] for r in rows]
    arch = BUDGETS["arch"] if BUDGETS["arch"] in archs else (archs[0] if archs else None)
    rates = {
        r["id"]: flop_rate(r["dtype"], bool(r.get("mma")))[0] for r in rows if r["arch"] == arch
    }
    steps: dict[tuple, dict[str, Any]] = {}
    for v in variants:
        for ctx, launch in v.uses:
            key = (ctx["model"], ctx["schedule"], ctx["precision"])
            new = {**ctx, "arch": arch, "launches": 0, "variants": [], "modelled_launches": 0}
            s = steps.setdefault(key, new | {"modelled_us": 0.0})
            s["launches"] += 1
            s["variants"] += [v.key] if v.key not in s["variants"] else []
            if v.key in rates:
                cost = launch_cost(launch)
                us = modelled_us(cost["bytes"], cost["flops"], rates[v.key])
                s["modelled_us"] = round(s["modelled_us"] + us, 2)
                s["modelled_launches"] += 1
    return sorted(steps.values(), key=lambda s: (s["model"], str(s["schedule"]), s["precision"]))


def step_table(steps: Sequence[dict[str, Any]], baseline: dict[str, Any]) -> list[dict]:
    """The modelled bf16 training steps (*estimated*): each captured step's routing kernels
    (:func:`step_summary`) plus the rest of its operators (``other_us``, aot_ops.py), against
    ``baseline`` (ResNet-18's step, modelled from its operators alike); ``complete`` where
    every launch's variant was compiled."""
    out = []
    for s in steps:
        if s["precision"] != "bf16":
            continue
        step = s["modelled_us"] + s["other_us"]
        out.append({
            "model": s["model"], "router": s["router"], "schedule": s["schedule"],
            "routing_us": s["modelled_us"], "other_us": s["other_us"],
            "step_us": round(step, 2), "vs_baseline": round(step / baseline["modelled_us"], 3),
            "complete": s["modelled_launches"] == s["launches"],
        })  # fmt: skip
    return out
