"""The time plan of scripts/gpu_check.py: how many seconds each of its parts may take on a
fresh H100, derived from the kernels' ahead-of-time report (scripts/gpu_aot.py: each variant's
compile seconds and each model's modelled training step, *estimated*), 8 minutes in all.

    python scripts/gpu_check.py --plan        # the table below, and whether it fits

A part's budget is a fixed allowance for what no report models (building a model and moving it
to the device: :data:`ROW_S` a row) plus its modelled work:

- ``warm``: Triton compiles every variant the later parts launch, once, from an empty cache:
  the report's compile CPU seconds of the variants of the models timed, counted twice (the
  check's batch 8 and the bench's batch 128 specialize their own variants) and times
  :data:`COMPILE_FACTOR`, plus one step a row;
- ``check``: :data:`ROW_S` a row (each row: two forward and backward passes at batch 8);
- ``bench``: per row, :data:`ROW_S` plus its steps (warm-up, timed, inference) at the modelled
  bf16 step (float32: :data:`FP32_FACTOR` times it; the torch code's rows:
  :data:`TORCH_FACTOR` times the fused step);
- ``compile``: :data:`COMPILE_MODEL_S` a model (inductor's compile, not modelled);
- ``train``: its ``--minutes`` and :data:`TRAIN_OVERHEAD_S` (data, the test evaluation).

Each part starts no row that would end past its budget at the pace of its slowest row so far
(scripts/gpu_check.py's ``Part``), so the plan holds also where an estimate is off.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "BUDGET_S",
    "REPORT",
    "Budget",
    "Rows",
    "load_report",
    "plan",
    "plan_table",
]

REPO = Path(__file__).resolve().parent.parent
#: The report the plan reads: the newest full report of the CIFAR-10 models.
REPORT = REPO / "benchmarks" / "gpu" / "aot-after-59e2a36.json"
#: Seconds the whole check may take on a fresh H100, compiles included.
BUDGET_S = 480.0
#: Seconds a row needs beyond its modelled work: a model built, moved and synchronized.
ROW_S = 2.0
#: A compile on the GPU machine from an empty cache against the report's CPU seconds (measured
#: on a loaded 2-core machine; a GPU host's cores are no slower).
COMPILE_FACTOR = 1.0
#: A float32 step against the modelled bf16 one (no bf16 tensor cores for the convolutions).
FP32_FACTOR = 2.0
#: The torch code's step against the fused one (the votes built chunk by chunk in torch).
TORCH_FACTOR = 10.0
#: Seconds of torch.compile (inductor) for one model's training step.
COMPILE_MODEL_S = 45.0
#: Seconds the train part spends beyond its minutes: data, the test evaluation.
TRAIN_OVERHEAD_S = 30.0


@dataclass(frozen=True)
class Budget:
    """One part's seconds and how they were reached."""

    part: str
    seconds: float
    basis: str


@dataclass(frozen=True)
class Rows:
    """What the parts run (scripts/gpu_check.py's model lists, as names and counts)."""

    check: list[str]  # registered names of the check's models (each in fp32 and bf16)
    bench: list[tuple[str, str, str]]  # (name, setting, passes) of each bench row
    compiled: list[str]  # names of the compile part's models
    bench_steps: int  # warm-up + timed + inference steps of a bench row
    train_minutes: float


def plan(rows: Rows, report: dict[str, Any]) -> list[Budget]:
    """The parts' budgets (module docstring) from what they run and the kernels' report."""
    timed = set(rows.check) | {name for name, _, _ in rows.bench}
    compile_s = sum(
        float(v.get("compile_cpu_s", v["compile_s"]))
        for v in report["variants"]
        if timed & set(v.get("models") or [])
    )
    warm_rows = 2 * len(rows.check) + sum(1 for _, _, p in rows.bench if p == "fused")
    warm = 2 * compile_s * COMPILE_FACTOR + warm_rows * ROW_S
    bench = sum(
        ROW_S + rows.bench_steps * _step_s(report, name, setting, passes)
        for name, setting, passes in rows.bench
    )
    return [
        Budget(
            "warm",
            round(warm, 1),
            f"{2 * compile_s:.0f} s of compiles x {COMPILE_FACTOR}"
            f" + {warm_rows} steps x {ROW_S:g} s",
        ),  # fmt: skip
        Budget("check", 2 * len(rows.check) * ROW_S, f"{2 * len(rows.check)} rows x {ROW_S:g} s"),
        Budget(
            "bench",
            round(bench, 1),
            f"{len(rows.bench)} rows x ({ROW_S:g} s + {rows.bench_steps} modelled steps)",
        ),  # fmt: skip
        Budget(
            "compile",
            len(rows.compiled) * COMPILE_MODEL_S,
            f"{len(rows.compiled)} models x {COMPILE_MODEL_S:g} s",
        ),  # fmt: skip
        Budget(
            "train",
            rows.train_minutes * 60 + TRAIN_OVERHEAD_S,
            f"{rows.train_minutes:g} min + {TRAIN_OVERHEAD_S:g} s",
        ),  # fmt: skip
    ]


def _step_s(report: dict[str, Any], name: str, setting: str, passes: str) -> float:
    """A bench row's modelled training step in seconds (bf16; the report's baseline for
    ResNet-18; a model the report lacks counts as its slowest step)."""
    base = report["baseline"]
    steps: dict[str, float] = {}  # each model's slowest schedule
    for s in report.get("modelled_steps", []):
        steps[s["model"]] = max(steps.get(s["model"], 0.0), s["step_us"])
    if name == base["model"]:
        us = base["modelled_us"]
    else:
        us = steps.get(name, max(steps.values(), default=base["modelled_us"]))
    us *= FP32_FACTOR if setting == "fp32" else 1.0
    us *= TORCH_FACTOR if passes == "torch" else 1.0
    return us / 1e6


def load_report(path: Path = REPORT) -> dict[str, Any]:
    """The kernels' ahead-of-time report the plan reads."""
    return json.loads(path.read_text(encoding="utf-8"))


def plan_table(budgets: list[Budget], report: Path) -> str:
    """The plan as text, its total against :data:`BUDGET_S`."""
    lines = [f"{'part':<9}{'seconds':>9}  basis (estimated; report {report.name})"]
    lines += [f"{b.part:<9}{b.seconds:>9.0f}  {b.basis}" for b in budgets]
    total = sum(b.seconds for b in budgets)
    fits = "fits" if total <= BUDGET_S else "does NOT fit"
    lines.append(f"{'total':<9}{total:>9.0f}  {fits} in {BUDGET_S / 60:g} minutes")
    return "\n".join(lines)
