"""Training-loop speed against ResNet-18: images/s of the real training loop on CIFAR-10, the
ratio to ResNet-18 measured in the same process, and where each epoch's time went.

    python scripts/loop_speed.py                                  # CIFAR-10 in $CAPSCTL_DATA
    python scripts/loop_speed.py --set train.channels_last=true   # any preset override
    python scripts/loop_speed.py --dry-run                        # toy sizes, random data (CI)

Each repeat trains every model for one short epoch of the ``cifar10-caps-simple`` recipe (batch
128, crops and flips, SGD, the per-step schedule) without a validation split, through
:mod:`capsctl.training`, exactly as ``capsctl train`` does. Images/s leave out the first step
(one-time set-up of kernels and buffers); the seconds per phase are the epoch's metrics line
(capsctl/training/phases.py), first step included. Models take turns within a repeat, so a
slow or fast stretch of the machine touches all of them; each ratio is taken within a repeat
and reported min-max over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from capsctl.threads import short_omp_spin

short_omp_spin()  # before torch is imported, as the capsctl command does

import torch  # noqa: E402

from capsctl.data.synthetic import write_random_cifar10  # noqa: E402
from capsctl.memory import keep_freed_memory  # noqa: E402
from capsctl.training import train_from_preset  # noqa: E402
from capsctl.training.phases import PHASES  # noqa: E402

MODELS = ("resnet18", "cifar10-caps-simple", "cifar10-caps")
STEPS = {"resnet18": 6, "cifar10-caps": 6}  # timed steps; other models: DEFAULT_STEPS
DEFAULT_STEPS = 30


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", default=list(MODELS), help="the first is the reference")
    ap.add_argument("--steps", action="append", default=[], help="MODEL=N timed steps")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--set", action="append", default=[], dest="overrides", help="KEY=VALUE")
    ap.add_argument("--data-dir", help="where CIFAR-10 is (default: $CAPSCTL_DATA)")
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on random data (CI)")
    ap.add_argument("--json", type=Path, help="write every figure to this file")
    args = ap.parse_args(argv)
    keep_freed_memory()  # as the capsctl command does
    steps = {**STEPS, **dict(_pair(s) for s in args.steps)}
    with tempfile.TemporaryDirectory(prefix="capsctl-loop-") as tmp:
        data_dir = args.data_dir
        batch = args.batch_size
        if args.dry_run:
            data_dir, batch = str(write_random_cifar10(Path(tmp) / "data", train=64)), 8
            steps = dict.fromkeys(args.models, 2)
        runs = [
            {
                m: _measure(m, steps.get(m, DEFAULT_STEPS), batch, args, data_dir, tmp)
                for m in args.models
            }
            for _ in range(args.repeats)
        ]
    report = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "omp_spincount": os.environ.get("GOMP_SPINCOUNT", "default"),
        "batch_size": batch,
        "overrides": args.overrides,
        "runs": runs,
        "summary": summarize(runs, args.models[0]),
    }
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def _pair(text: str) -> tuple[str, int]:
    name, _, n = text.partition("=")
    return name, int(n)


def _measure(
    model: str, steps: int, batch: int, args: argparse.Namespace, data_dir: str | None, tmp: str
) -> dict[str, Any]:
    """One short epoch of ``model``: images/s after the first step and seconds per phase."""
    stamps: list[float] = []

    def on_event(e: dict[str, Any]) -> None:
        if e.get("event") == "step":
            stamps.append(time.perf_counter())

    overrides = [
        f"model={model}",
        "data.val_size=0",
        "train.epochs=1",
        f"train.steps_per_epoch={steps + 1}",
        f"train.batch_size={batch}",
        "log.curves=false",
        *([f"data.data_dir={data_dir}"] if data_dir else []),
        *args.overrides,
    ]
    out = Path(tempfile.mkdtemp(prefix=f"{model}-", dir=tmp)) / "run"
    result = train_from_preset(
        "cifar10-caps-simple", out=out, overrides=overrides, on_event=on_event, handle_sigint=False
    )
    record = result.history[-1]
    timed = len(stamps) - 1
    return {
        "steps": timed,
        "images_per_s": timed * batch / max(stamps[-1] - stamps[0], 1e-9),
        "epoch_seconds": record["epoch_seconds"],
        **{p: record[f"{p}_seconds"] for p in PHASES},
    }


def summarize(runs: list[dict[str, dict[str, Any]]], ref: str) -> list[dict[str, Any]]:
    """Per model: images/s and the ratio to ``ref`` min-max over repeats; phase shares of the
    epoch (sums over repeats) and the share outside forward and backward."""
    rows = []
    for model in runs[0]:
        speeds = [r[model]["images_per_s"] for r in runs]
        ratios = [r[model]["images_per_s"] / r[ref]["images_per_s"] for r in runs]
        total = sum(r[model]["epoch_seconds"] for r in runs)
        shares = {p: sum(r[model][p] for r in runs) / total for p in PHASES}
        rows.append(
            {
                "model": model,
                "steps": runs[0][model]["steps"],
                "images_per_s": [min(speeds), max(speeds)],
                "vs_ref": [min(ratios), max(ratios)],
                "shares": shares,
                "outside_forward_backward": 1.0 - shares["forward"] - shares["backward"],
            }
        )
    return rows


def render(report: dict[str, Any]) -> str:
    ref = report["summary"][0]["model"]
    head = f"{'model':<22}{'steps':>6}{'images/s':>16}{'vs ' + ref:>16}"
    head += "".join(f"{p:>10}" for p in PHASES) + f"{'outside f/b':>13}"
    lines = [
        f"training loop, batch {report['batch_size']}, {report['threads']} threads "
        f"(GOMP_SPINCOUNT {report['omp_spincount']}), torch "
        f"{report['torch']}, {len(report['runs'])} repeats (min-max); phases: share of the epoch",
        head,
    ]
    for row in report["summary"]:
        lo, hi = row["images_per_s"]
        rlo, rhi = row["vs_ref"]
        line = f"{row['model']:<22}{row['steps']:>6}{f'{lo:.1f}-{hi:.1f}':>16}"
        line += f"{f'{rlo:.2f}-{rhi:.2f}x':>16}"
        line += "".join(f"{row['shares'][p]:>10.1%}" for p in PHASES)
        lines.append(line + f"{row['outside_forward_backward']:>13.1%}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
