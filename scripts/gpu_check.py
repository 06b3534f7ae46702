"""GPU readiness check: speed of the capsule models against ResNet-18, the routed pass's chunk
size, and time to accuracy of two training recipes, in one command that fits in 15 minutes.

    python scripts/gpu_check.py                      # on a CUDA machine, CIFAR-10 in $CAPSCTL_DATA
    python scripts/gpu_check.py --dry-run            # anywhere: the same code at toy sizes (CI)

1. Bench, batch 128: ResNet-18, cifar10-caps, cifar10-caps-simple (concurrent and sequential),
   each in fp32, bf16 autocast + channels_last, and the same compiled (``torch.compile``); the
   ratios are to ResNet-18 under the same settings.
2. Chunk size of the routed passes (capsctl/layers/backend/chunks.py): cifar10-caps-simple
   sequential, one training step at several ``DEVICE_CHUNK_BYTES``.
3. Training: ``cifar10-caps-fast`` as its preset says and ``cifar10-caps`` on a one-cycle
   schedule fitted to ``--minutes``, both in bf16 with channels_last and a 5,000-image
   validation split; reports the seconds to 90% and 94% validation accuracy and the final test
   accuracy.

``--dry-run`` runs every step on the CPU at toy sizes (batch 2, one timed step, two training
steps on a tiny synthetic CIFAR-10 folder), so the script cannot rot where no GPU is; compiled
rows are skipped on a CPU without a C++ compiler. ``--json FILE`` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from capsctl.threads import short_omp_spin

short_omp_spin()  # before torch is imported, as the capsctl command does

import torch  # noqa: E402

from capsctl.bench import BenchRow, add_ratios, run_bench  # noqa: E402
from capsctl.data.synthetic import write_random_cifar10  # noqa: E402
from capsctl.layers import chunks  # noqa: E402
from capsctl.memory import keep_freed_memory  # noqa: E402
from capsctl.training import train_from_preset  # noqa: E402

BENCH_MODELS = (
    ("resnet18", None),
    ("cifar10-caps", None),
    ("cifar10-caps-simple", "concurrent"),
    ("cifar10-caps-simple", "sequential"),
)
SETTINGS = (
    ("fp32", {"amp": False, "channels_last": False, "compile": False}),
    ("bf16+cl", {"amp": True, "channels_last": True, "compile": False}),
    ("bf16+cl+compile", {"amp": True, "channels_last": True, "compile": True}),
)
CHUNK_MIB = (4, 16, 64, 256)
TARGETS = (0.90, 0.94)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU (CI)")
    ap.add_argument("--minutes", type=float, default=3.0, help="budget of the cifar10-caps run")
    ap.add_argument("--data-dir", help="where CIFAR-10 is (default: $CAPSCTL_DATA)")
    ap.add_argument("--json", type=Path, help="write all figures to this file")
    args = ap.parse_args(argv)
    keep_freed_memory()  # as the capsctl command does

    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; run with --dry-run to check the script on a CPU")
        return 1
    device = "cpu" if dry else "cuda"
    report: dict[str, Any] = {"device": _device_name(device), "torch": torch.__version__}
    print(f"gpu_check on {report['device']}, torch {torch.__version__}" + (" (dry run)" * dry))

    report["bench"] = bench(device, dry)
    report["chunks"] = chunk_sizes(device, dry)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        data_dir = args.data_dir
        if dry and data_dir is None:
            data_dir = str(write_random_cifar10(Path(tmp) / "data"))
        report["training"] = training(device, dry, args.minutes, data_dir, Path(tmp))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def bench(device: str, dry: bool) -> list[dict[str, Any]]:
    batch, iters, warmup = (2, 1, 1) if dry else (128, 5, 2)
    rows: list[dict[str, Any]] = []
    print(f"\n1. training step and inference, batch {batch}, median of {iters}")
    print(f"{'model':<32}{'setting':<17}{'train step':>11}{'infer img/s':>13}{'vs resnet18':>13}")
    for label, flags in SETTINGS:
        if flags["compile"] and device == "cpu" and shutil.which("c++") is None:
            print(f"{'(all)':<32}{label:<17} skipped: torch.compile on a CPU needs a C++ compiler")
            continue
        measured: list[BenchRow] = []
        for name, routing in BENCH_MODELS:
            (row,) = run_bench(
                [name],
                batch_size=batch,
                iters=iters,
                warmup=warmup,
                device=device,
                routing=routing,
                **flags,
            )
            if routing is not None:
                row.name = f"{name} ({routing})"
            measured.append(row)
        add_ratios(measured, measured[0])
        for row in measured:
            ratio = f"{row.train_ratio:.2f}x" if row.train_ratio is not None else "-"
            print(
                f"{row.name:<32}{label:<17}{row.train_step_s * 1e3:>9.1f}ms"
                f"{row.infer_images_per_s or 0:>13.0f}{ratio:>13}"
            )
            rows.append({"setting": label, **row.to_dict()})
    return rows


def chunk_sizes(device: str, dry: bool) -> list[dict[str, Any]]:
    """One training step of cifar10-caps-simple (sequential) per accelerator chunk size."""
    batch, iters = (2, 1) if dry else (128, 5)
    print(f"\n2. routed-pass chunk size, cifar10-caps-simple sequential, batch {batch}")
    out = []
    before = chunks.DEVICE_CHUNK_BYTES
    try:
        for mib in CHUNK_MIB:
            chunks.DEVICE_CHUNK_BYTES = mib * 2**20
            (row,) = run_bench(
                ["cifar10-caps-simple"],
                batch_size=batch,
                iters=iters,
                warmup=1,
                device=device,
                routing="sequential",
                infer=False,
                amp=not dry,
                channels_last=not dry,
            )
            step = row.train_step_s or 0.0
            note = " (a CPU uses its own cache-sized chunks)" * (device == "cpu")
            print(f"  {mib:>4} MiB  {step * 1e3:8.1f} ms{note}")
            out.append({"chunk_mib": mib, "train_step_s": step})
    finally:
        chunks.DEVICE_CHUNK_BYTES = before
    return out


def training(
    device: str, dry: bool, minutes: float, data_dir: str | None, tmp: Path
) -> list[dict[str, Any]]:
    print("\n3. training (bf16, channels_last), seconds to a validation accuracy")
    common = [f"train.device={device}", "data.val_size=5000"]
    if not dry:
        common += ["train.amp=true", "train.channels_last=true"]
    if data_dir is not None:
        common.append(f"data.data_dir={data_dir}")
    toy = [
        "data.val_size=16",
        "train.epochs=1",
        "train.steps_per_epoch=2",
        "train.batch_size=8",
        "train.eval_batch_size=16",
        "train.time_limit=null",
    ]
    runs = {
        "cifar10-caps-fast": [],
        "cifar10-caps": [
            "train.schedule=onecycle",
            "train.epochs=40",
            "train.batch_size=256",
            "train.lr=0.2",
            "train.nesterov=true",
            "train.label_smoothing=0.1",
            f"train.time_limit={minutes * 60:.0f}",
        ],
    }
    out = []
    print(
        f"{'preset':<20}{'epochs':>7}{'seconds':>9}{'to 90%':>9}{'to 94%':>9}{'test':>8}  test set"
    )
    for preset, extra in runs.items():
        reached: dict[float, float] = {}
        t0 = time.perf_counter()

        def on_event(
            e: dict[str, Any], reached: dict[float, float] = reached, t0: float = t0
        ) -> None:
            acc = e.get("val_accuracy") if e.get("event") == "epoch_end" else None
            for target in TARGETS:
                if acc is not None and acc >= target and target not in reached:
                    reached[target] = time.perf_counter() - t0

        overrides = [*common, *extra, *(toy if dry else [])]
        result = train_from_preset(
            preset,
            out=tmp / preset,
            overrides=overrides,
            on_event=on_event,
            handle_sigint=False,
        )
        test = result.test
        times = [f"{reached[t]:.0f}s" if t in reached else "-" for t in TARGETS]
        acc = f"{test.accuracy:.2%}" if test is not None else "-"
        name = test.dataset if test is not None else "-"
        print(
            f"{preset:<20}{result.epochs_done:>9}{result.seconds:>9.0f}{times[0]:>9}"
            f"{times[1]:>9}{acc:>9}  {name}"
        )
        out.append(
            {
                "preset": preset,
                "overrides": overrides,
                "epochs": result.epochs_done,
                "seconds": result.seconds,
                "seconds_to": {f"{t:.2f}": reached.get(t) for t in TARGETS},
                "test_accuracy": test.accuracy if test is not None else None,
                "test_set": name,
            }
        )
    return out


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu ({torch.get_num_threads()} threads)"


if __name__ == "__main__":
    sys.exit(main())
