"""Ahead-of-time report of the Triton kernels, without a GPU: what each compiled variant gets
on sm_80 / sm_90a / sm_100a (registers, spills, stack, shared memory, compile seconds, PTX
counts) and its modelled H100 time (*estimated*), against the budgets of docs/GPU-KERNELS.md.

    python scripts/gpu_aot.py --arch sm_90a                      # the table
    python scripts/gpu_aot.py --arch sm_80,sm_90a,sm_100a --json --out report.json
    python scripts/gpu_aot.py --models 'cifar10-*-simple' --batch 32 --check

Every capsule model of the registry (``--models``: names or shell patterns; inverted
dot-product attention in both schedules) runs one training step at ``--batch`` in float32 and
under bf16 autocast on fake tensors, the kernels' launches captured instead of run
(capsctl/layers/backend/triton/aot.py). Each distinct variant is compiled once per
architecture in a worker process within ``--compile-timeout`` seconds, with Triton's cache in a
fresh temporary folder (compile seconds from an empty cache) or in ``--cache DIR``. ``--cover``
compiles only the variants of the first models that launch each (router, pass, direction,
schedule), and says so in the report's ``scope``.

Progress goes to stderr. The exit code is 0 (a report), or with ``--check`` 1 where a variant
breaks a budget on sm_90a. ``--out`` is rewritten after every compile (``"complete": false``
until the end), so a stopped run keeps what it compiled.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from the tree (PYTHONPATH=.)

import torch  # noqa: E402
import triton  # noqa: E402

from capsctl.config import build_model, resolve_config  # noqa: E402
from capsctl.layers import gpu_aot  # noqa: E402
from capsctl.registry import list_models  # noqa: E402

PRECISIONS = {"float32": False, "bf16": True}  # the step's precision -> autocast
BASELINE = "resnet18"  # the modelled steps' yardstick
KERNELS = "capsctl/layers/backend/triton/"  # kernels_modified: tracked files changed there


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    start = time.perf_counter()
    captures = capture_all(args.models, args.batch, args.precisions)
    baseline = baseline_step(args.batch)
    variants = every = gpu_aot.group_variants(captures)
    scope = "all"
    if args.cover:
        variants, scope = cover(every)
    doc = _doc(args, captures, scope) | {"baseline": baseline}
    doc |= {"distinct_variants": len(every), "compiled_variants": len(variants)}
    if args.capture_only:
        args.arch = []
    fresh = tempfile.TemporaryDirectory(prefix="capsctl-aot-") if args.cache is None else None
    cache = args.cache or fresh.name  # type: ignore[union-attr]
    _log(f"{len(variants)} distinct variants x {len(args.arch)} arch; Triton cache {cache}")
    with (
        fresh or contextlib.nullcontext(),
        gpu_aot.Compiler(cache, args.compile_timeout) as compiler,
    ):
        for i, (v, arch) in enumerate((v, a) for v in variants for a in args.arch):
            row = gpu_aot.variant_row(v, arch, compiler.compile(v.spec(), arch))
            doc["variants"].append(row)
            _log(f"[{i + 1}/{len(variants) * len(args.arch)}] " + _line(row))
            _finish(doc, every, start, complete=False)
            _save(doc, args.out)
    _finish(doc, every, start, complete=True)
    _save(doc, args.out)
    sys.stdout.write(json.dumps(doc, indent=1) + "\n" if args.json else table(doc))
    return 1 if args.check and not doc["budgets"]["ok"] else 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="sm_90a", help="comma-separated: sm_80,sm_90a,sm_100a")
    p.add_argument("--models", default="*", help="comma-separated names or shell patterns")
    p.add_argument("--precisions", default="float32,bf16", help="float32 and/or bf16")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--json", action="store_true", help="print the JSON report, not the table")
    p.add_argument("--out", type=Path, help="write the JSON report here")
    p.add_argument("--cache", help="Triton's cache folder (default: a fresh temporary one)")
    p.add_argument("--compile-timeout", type=float, default=300.0, metavar="S")
    p.add_argument("--cover", action="store_true", help="one model per router/pass/schedule")
    p.add_argument("--check", action="store_true", help="exit 1 where a budget is broken")
    p.add_argument("--capture-only", action="store_true", help="list the variants, compile none")
    args = p.parse_args(argv)
    args.arch = [gpu_aot.arch_number(a) for a in args.arch.split(",") if a.strip()]
    args.precisions = [s.strip() for s in args.precisions.split(",") if s.strip()]
    unknown = set(args.precisions) - set(PRECISIONS)
    if unknown:
        p.error(f"unknown precisions {sorted(unknown)}; choose from {list(PRECISIONS)}")
    args.models = capsule_models([s.strip() for s in args.models.split(",") if s.strip()])
    if not args.models:
        p.error("no capsule model matches --models")
    return args


def capsule_models(patterns: list[str]) -> list[str]:
    """The registry's capsule models matching any of ``patterns``, in registry order."""
    names = [n for n in list_models() if any(fnmatch.fnmatch(n, p) for p in patterns)]
    return [n for n in names if resolve_config(n).arch == "capsnet"]


def capture_all(models: list[str], batch: int, precisions: list[str]) -> list[tuple[dict, list]]:
    """``(context, launches)`` of one training step of each model, schedule and precision."""
    out = []
    for name in models:
        cfg = resolve_config(name)
        router = cfg.router["name"]
        schedules = ["concurrent", "sequential"] if router == "idpa" else [None]
        for schedule in schedules:
            for precision in precisions:
                torch.manual_seed(0)
                net = build_model(cfg).train()
                if schedule is not None:
                    net.set_routing(None, schedule)
                images = (batch, cfg.in_channels, cfg.input_size, cfg.input_size)
                ops: list = []
                launches = gpu_aot.capture_step(
                    net, images, cfg.num_classes, PRECISIONS[precision], ops
                )
                ctx = {"model": name, "router": router, "schedule": schedule}
                ctx |= {"other_us": round(sum(gpu_aot.op_us(o) for o in ops), 2)}
                out.append(({**ctx, "precision": precision}, launches))
                _log(f"captured {name} {schedule or ''} {precision}: {len(launches)} launches")
    return out


def baseline_step(batch: int) -> dict:
    """ResNet-18's bf16 training step at ``batch``, modelled from its operators alone, as the
    capsule models' steps are beside their kernels."""
    cfg = resolve_config(BASELINE)
    torch.manual_seed(0)
    net = build_model(cfg).train()
    ops: list = []
    gpu_aot.capture_step(net, (batch, cfg.in_channels, cfg.input_size, cfg.input_size),
                         cfg.num_classes, True, ops)  # fmt: skip
    return {
        "model": BASELINE, "precision": "bf16", "operators": len(ops),
        "flops": sum(o.flops for o in ops), "bytes": sum(o.bytes for o in ops),
        "modelled_us": round(sum(gpu_aot.op_us(o) for o in ops), 2),
    }  # fmt: skip


def cover(variants: list) -> tuple[list, str]:
    """The variants of the first models (in registry order) that launch each (router, pass,
    direction, schedule) not launched by an earlier chosen model; and the scope's text."""
    combos: dict[tuple, str] = {}
    for v in variants:
        what = gpu_aot.describe(v.launch)
        for ctx, _ in v.uses:
            key = (ctx["router"], what["pass"], what["direction"], ctx["schedule"])
            combos.setdefault(key, ctx["model"])
    chosen = sorted(set(combos.values()))
    kept = [v for v in variants if set(v.contexts("model")) & set(chosen)]
    text = (
        f"cover: {len(kept)} of {len(variants)} variants, those of the models "
        f"{', '.join(chosen)}, which launch every (router, pass, direction, schedule) at least once"
    )
    return kept, text


def _doc(args: argparse.Namespace, captures: list, scope: str) -> dict:
    return {
        "variants": [],
        "budgets": {},
        "steps": [],
        "commit": _git("rev-parse", "--short", "HEAD"),
        "kernels_modified": _git("diff", "--name-only", "HEAD", "--", KERNELS).split(),
        "triton": triton.__version__,
        "torch": torch.__version__,
        "archs": [gpu_aot.arch_name(a) for a in args.arch],
        "batch": args.batch,
        "models": args.models,
        "precisions": args.precisions,
        "captured_steps": len(captures),
        "scope": scope,
        "compile_timeout_s": args.compile_timeout,
        "cache": "fresh temporary folder" if args.cache is None else str(args.cache),
        "cost_model": {"machine": "H100 SXM (docs/GPU.md)", **gpu_aot.H100, "estimated": True},
        "host": {"cpus": os.cpu_count(), "load_average_start": list(os.getloadavg())},
    }


def _finish(doc: dict, variants: list, start: float, complete: bool) -> None:
    doc["budgets"] = gpu_aot.budget_summary(doc["variants"])
    doc["steps"] = gpu_aot.step_summary(variants, doc["variants"])
    doc["modelled_steps"] = gpu_aot.step_table(doc["steps"], doc["baseline"])
    doc["wall_s"] = round(time.perf_counter() - start, 1)
    doc["host"]["load_average_end"] = list(os.getloadavg())
    doc["complete"] = complete


def _git(*args: str) -> str:
    try:
        res = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return ""
    return res.stdout.strip()


def _save(doc: dict, out: Path | None) -> None:
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, out)


def _log(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _cell(row: dict, key: str) -> str:
    v = row.get(key)
    return "-" if v is None else str(v)


def _line(row: dict) -> str:
    if row.get("timed_out") or row.get("error"):
        what = "timed out" if row.get("timed_out") else "error: " + row["error"][:120]
        return f"{row['arch']} {row['id']} {row['pass']} {row['direction']}: {what}"
    return (
        f"{row['arch']} {row['id']} {row['pass']} {row['direction']} ({row['model'][:50]}): "
        f"{row['registers']} regs, {row['spill_bytes']} B spills, {row['stack_bytes']} B stack, "
        f"{row['compile_s']} s, {row['acq_rel_atomics']} acq_rel, {row['mma']} mma"
    )


COLUMNS = (
    ("router", 8), ("pass", 11), ("direction", 9), ("schedule", 11), ("dtype", 8), ("arch", 8),
    ("registers", 5), ("spill_bytes", 6), ("stack_bytes", 6), ("shared_bytes", 7),
    ("compile_s", 8), ("acq_rel_atomics", 4), ("mma", 4), ("int64_offsets", 5),
    ("modelled_us", 9), ("broken", 36), ("model", 40),
)  # fmt: skip
HEADS = {"registers": "regs", "spill_bytes": "spill", "stack_bytes": "stack", "mma": "mma",
         "shared_bytes": "smem", "acq_rel_atomics": "acqr", "int64_offsets": "i64",
         "modelled_us": "model_us", "direction": "dir", "compile_s": "comp_s"}  # fmt: skip


SHORT = {"spill_bytes": "spill", "stack_bytes": "stack", "registers": "regs",
         "acq_rel_atomics": "acq_rel", "compile_s": "compile", "mma": "no-mma"}  # fmt: skip


def _broken(row: dict) -> str:
    return "-" if row["broken"] is None else ",".join(SHORT.get(b, b) for b in row["broken"])


def table(doc: dict) -> str:
    """The report as plain text: one line per variant and architecture, then the budgets."""
    lines = [" ".join(HEADS.get(k, k).ljust(w) for k, w in COLUMNS).rstrip()]
    for row in doc["variants"]:
        cells = []
        for k, w in COLUMNS:
            v = _broken(row) if k == "broken" else _cell(row, k)
            v = "TIMEOUT" if k == "compile_s" and row.get("timed_out") else v
            cells.append(v[:w].ljust(w))
        lines.append(" ".join(cells).rstrip())
    b = doc["budgets"]
    lines += ["", f"budgets on {b['arch']} ({b['checked']} variants): {b['limits']}"]
    for name, ids in b["broken"].items():
        lines.append(f"  {name}: broken by {len(ids)}")
    lines.append("  all kept" if b["ok"] else f"  {len(b['variants_breaking'])} variants break one")
    lines += ["", *step_lines(doc)]
    lines.append(f"modelled times are estimated (H100 model); commit {doc['commit']}")
    return "\n".join(lines) + "\n"


def step_lines(doc: dict) -> list[str]:
    """The modelled bf16 training steps against ResNet-18's, one line each."""
    base = doc["baseline"]
    head = f"modelled bf16 training step at batch {doc['batch']}, us (estimated):"
    lines = [head, f"  {base['model']:<34} {base['modelled_us']:>9.0f}  1.00x"]
    for s in doc["modelled_steps"]:
        name = s["model"] + (f" ({s['schedule']})" if s["schedule"] else "")
        note = "" if s["complete"] else "  (partial: not every variant compiled)"
        lines.append(
            f"  {name:<34} {s['step_us']:>9.0f}  {s['vs_baseline']:.2f}x"
            f"  routing {s['routing_us']:.0f}{note}"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
