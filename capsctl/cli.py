"""The ``capsctl`` command line: parse, call one core function, render.

torch is imported only inside commands, so ``capsctl --help`` stays fast.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from capsctl import __version__
from capsctl.errors import CapsctlError, UsageError

app = typer.Typer(
    name="capsctl",
    help="Capsule networks with inverted dot-product attention routing (Tsai et al., ICLR 2020).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

_state = {"debug": False}

JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print one JSON document on stdout and nothing else.")
]


def _version(value: bool) -> None:
    if value:
        print(f"capsctl {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    debug: Annotated[
        bool, typer.Option("--debug", help="Show tracebacks (also CAPSCTL_DEBUG=1).")
    ] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    _state["debug"] = debug or os.environ.get("CAPSCTL_DEBUG", "") not in ("", "0")


# ---------------------------------------------------------------------------------------------
# models, presets


@app.command("models")
def models_cmd(
    pattern: Annotated[str, typer.Argument(help="Shell-style filter, e.g. 'cifar10-*'.")] = "*",
    json_out: JsonOpt = False,
) -> None:
    """List registered models with their parameter counts."""
    from capsctl import render
    from capsctl.models import build_model_from_config, parameter_counts
    from capsctl.models.capsnet import describe
    from capsctl.registry import describe_model, get_config, list_models

    rows = []
    for name in list_models(pattern):
        cfg = get_config(name)
        groups = parameter_counts(build_model_from_config(cfg))
        arch = describe(cfg) if cfg.arch == "capsnet" else cfg.arch
        rows.append(
            {
                "name": name,
                "description": describe_model(name),
                "arch": cfg.arch,
                "structure": arch,
                "params": groups,
                "num_classes": cfg.num_classes,
                "input": [cfg.in_channels, cfg.input_size, cfg.input_size],
            }
        )
    if not rows:
        raise UsageError(f"no registered model matches {pattern!r}; run capsctl models")
    if json_out:
        render.print_json({"models": rows})
        return
    render.out.print(
        render.table(
            "Registered models",
            ["name", "params", "backbone", "capsules", "classes", "input", "description"],
            [
                [
                    r["name"],
                    render.fmt_int(r["params"]["total"]),
                    render.fmt_int(r["params"]["backbone"]),
                    render.fmt_int(r["params"]["capsules"]),
                    r["num_classes"],
                    "x".join(map(str, r["input"])),
                    r["description"],
                ]
                for r in rows
            ],
            right=(1, 2, 3, 4),
        )
    )


@app.command("presets")
def presets_cmd(json_out: JsonOpt = False) -> None:
    """List the bundled presets."""
    from capsctl import render
    from capsctl.config import list_presets

    items = list_presets()
    if json_out:
        render.print_json({"presets": [{"name": n, "description": d} for n, d in items]})
        return
    render.out.print(
        render.table("Presets (capsctl train --preset NAME)", ["name", "description"], items)
    )


# ---------------------------------------------------------------------------------------------
# train


@app.command("train")
def train_cmd(
    preset: Annotated[
        str | None, typer.Option("--preset", "-p", help="Preset name or YAML file.")
    ] = None,
    epochs: Annotated[int | None, typer.Option(help="Number of epochs.")] = None,
    batch_size: Annotated[
        int | None, typer.Option("--batch-size", "-b", help="Training batch size.")
    ] = None,
    lr: Annotated[float | None, typer.Option(help="Base learning rate.")] = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu, cuda or mps.")] = None,
    data_dir: Annotated[
        str | None,
        typer.Option(
            "--data-dir",
            help="Where datasets live (default: $CAPSCTL_DATA, else a per-user cache).",
        ),
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Run folder (default runs/<preset>).")
    ] = None,
    seed: Annotated[int | None, typer.Option(help="Random seed.")] = None,
    deterministic: Annotated[
        bool, typer.Option("--deterministic", help="Deterministic algorithms.")
    ] = False,
    amp: Annotated[bool, typer.Option("--amp", help="bf16 autocast.")] = False,
    compile_: Annotated[bool, typer.Option("--compile", help="torch.compile the model.")] = False,
    resume: Annotated[
        Path | None, typer.Option("--resume", help="Continue from a last.safetensors.")
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace a run already in --out.")
    ] = False,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set", help="Override any preset field, e.g. --set train.lr=0.05 (repeatable)."
        ),
    ] = None,
    nproc: Annotated[
        int | None,
        typer.Option(
            "--nproc",
            help="Launch N processes on this machine with torchrun (DistributedDataParallel).",
        ),
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Train a model from a preset; writes best/last.safetensors, metrics.jsonl and preset.yaml."""
    from capsctl import render

    if nproc is not None:
        _launch_torchrun(nproc)
        return
    silent = os.environ.get("RANK", "0") != "0"  # under torchrun only the first process reports
    from capsctl.config import load_preset, preset_from_dict, preset_to_dict

    overrides = list(set_ or [])
    flag_map: dict[str, Any] = {
        "train.epochs": epochs,
        "train.batch_size": batch_size,
        "train.lr": lr,
        "train.device": device,
        "data.data_dir": data_dir,
        "train.seed": seed,
    }
    flag_map.update(
        {
            "train.deterministic": True if deterministic else None,
            "train.amp": True if amp else None,
            "train.compile": True if compile_ else None,
        }
    )
    flags = [f"{k}={_yaml_scalar(v)}" for k, v in flag_map.items() if v is not None]
    if resume is not None:
        from capsctl.config import apply_overrides
        from capsctl.engine import load_resume_preset

        if not resume.exists():
            raise UsageError(f"--resume {resume}: no such file")
        base = load_resume_preset(resume)
        p = preset_from_dict(apply_overrides(preset_to_dict(base), overrides + flags))
        run_dir = out or resume.parent
    else:
        if preset is None:
            raise UsageError("missing --preset NAME|FILE (see capsctl presets), or --resume CKPT")
        p = load_preset(preset, overrides + flags)
        run_dir = out or Path("runs") / (p.name or Path(preset).stem)

    from capsctl.engine import fit

    with render.TrainProgress(quiet=json_out or silent) as progress:
        result = fit(p, run_dir, resume=resume, overwrite=overwrite, on_event=progress)
    if silent:
        return
    if json_out:
        render.print_json(result.to_dict())
        return
    test = result.test
    render.out.print(f"run folder: {result.out_dir}")
    if result.best_val_accuracy is not None:
        render.out.print(
            f"best validation accuracy {render.fmt_pct(result.best_val_accuracy)} "
            f"(epoch {result.best_epoch})"
        )
    if test is not None:
        render.out.print(
            f"test accuracy {render.fmt_pct(test.accuracy)} on {test.count:,} images "
            f"({test.dataset}), top-5 {render.fmt_pct(test.top5)}, "
            f"{test.loss_name} loss {test.loss:.4f}"
        )
    render.out.print(f"time {result.seconds:.1f} s")


def _launch_torchrun(nproc: int) -> None:
    """Re-run this very command under torchrun with ``nproc`` processes (minus --nproc)."""
    import subprocess

    if nproc < 1:
        raise UsageError(f"--nproc {nproc}: must be >= 1")
    rest: list[str] = []
    args = iter(sys.argv[1:])
    for a in args:
        if a == "--nproc":
            next(args, None)  # drop its value too
        elif not a.startswith("--nproc="):
            rest.append(a)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "capsctl",
        *rest,
    ]
    code = subprocess.call(cmd)
    if code:
        sys.exit(code)


def _yaml_scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


# ---------------------------------------------------------------------------------------------
# eval


@app.command("eval")
def eval_cmd(
    ckpt: Annotated[Path, typer.Argument(help="A capsctl .safetensors checkpoint.")],
    data_dir: Annotated[str | None, typer.Option("--data-dir", help="Where datasets live.")] = None,
    split: Annotated[str, typer.Option(help="val or test.")] = "test",
    batch_size: Annotated[int | None, typer.Option("--batch-size", "-b")] = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or mps.")] = "auto",
    test_file: Annotated[
        str | None, typer.Option("--test-file", help="Test file of an npz folder (e.g. test-jpeg).")
    ] = None,
    json_out: JsonOpt = False,
    csv_out: Annotated[
        bool,
        typer.Option(
            "--csv", help="Print one CSV row with timm's columns (model, img_size, top1, ...)."
        ),
    ] = False,
) -> None:
    """Evaluate a checkpoint: top-1/top-5, per-class accuracy, confusion matrix, loss, speed."""
    from capsctl import render
    from capsctl.engine import evaluate_checkpoint

    if json_out and csv_out:
        raise UsageError("--json and --csv exclude each other")
    if not ckpt.exists():
        raise UsageError(f"{ckpt}: no such file")
    with render.simple_progress("eval", quiet=json_out or csv_out) as on_event:
        res, meta = evaluate_checkpoint(
            ckpt,
            data_dir=data_dir,
            split=split,
            batch_size=batch_size,
            device=device,
            test_file=test_file,
            on_event=on_event,
        )
    if json_out:
        render.print_json({"checkpoint": str(ckpt), "epoch": meta.get("epoch"), **res.to_dict()})
        return
    if csv_out:
        sys.stdout.write(render.eval_csv(str(ckpt), meta, res.to_dict()))
        return
    render.out.print(
        f"[bold]{ckpt}[/]  epoch {meta.get('epoch')}  {res.split} split of {res.dataset}: "
        f"{res.count:,} images"
    )
    name = "top-1" if res.metric == "top-1" else res.metric
    render.out.print(
        f"{name} {render.fmt_pct(res.accuracy)}  top-5 {render.fmt_pct(res.top5)}  "
        f"{res.loss_name} loss {res.loss:.4f}  {res.images_per_s:.0f} images/s"
    )
    n = len(res.classes)
    if not res.confusion:  # multi-label data: per-class recall only
        render.out.print(
            render.table(
                "Per-class recall",
                ["class", "recall"],
                [
                    [c, render.fmt_pct(r, 1)]
                    for c, r in zip(res.classes, res.per_class, strict=True)
                ],
                right=(1,),
            )
        )
        return
    short = [c[:6] for c in res.classes]
    rows = [
        [
            res.classes[i],
            render.fmt_pct(res.per_class[i], 1),
            sum(res.confusion[i]),
            *res.confusion[i],
        ]
        for i in range(n)
    ]
    if n <= 20:
        render.out.print(
            render.table(
                "Per-class accuracy and confusion matrix (rows: true, columns: predicted)",
                ["class", "acc", "n", *short],
                rows,
                right=tuple(range(1, n + 3)),
            )
        )
    else:
        render.out.print(
            render.table(
                "Per-class accuracy", ["class", "acc", "n"], [r[:3] for r in rows], right=(1, 2)
            )
        )


# ---------------------------------------------------------------------------------------------
# predict


@app.command("predict")
def predict_cmd(
    ckpt: Annotated[Path, typer.Argument(help="A capsctl checkpoint.")],
    images: Annotated[
        list[str],
        typer.Argument(
            help="Image files (PNG, JPEG, BMP, GIF, WebP, TIFF; any size and mode), folders "
            "(their image files, not recursive) or quoted glob patterns ('imgs/**/*.png')."
        ),
    ],
    top_k: Annotated[int, typer.Option("--top-k", "-k", help="Classes shown per image.")] = 5,
    skip_bad: Annotated[
        bool,
        typer.Option("--skip-bad", help="Warn about unreadable or missing images and go on."),
    ] = False,
    batch_size: Annotated[
        int, typer.Option("--batch-size", "-b", help="Images per forward pass.")
    ] = 64,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or mps.")] = "auto",
    json_out: JsonOpt = False,
) -> None:
    """Classify image files: the top-k classes and their scores per image. Images are converted
    and resized to the checkpoint's input the way its preprocessing says."""
    from rich.markup import escape

    from capsctl import render
    from capsctl.predict import predict_images

    if not ckpt.exists():
        raise UsageError(f"{ckpt}: no such file")
    with render.simple_progress("predict", quiet=json_out) as on_event:
        res = predict_images(
            ckpt,
            images,
            top_k=top_k,
            device=device,
            skip_bad=skip_bad,
            batch_size=batch_size,
            on_event=on_event,
        )
    if json_out:
        render.print_json(res.to_dict())
        return
    render.out.print(
        f"[bold]{escape(str(ckpt))}[/]  {res.arch}, {res.num_classes} classes, "
        f"{len(res.predictions)} image(s)"
    )
    render.out.print(f"preprocessing: {escape(res.preprocessing)}")
    render.out.print(f"score: {escape(res.score_description)}")
    render.out.print(render.predict_table(f"Top-{res.top_k} classes", res.to_dict()["images"]))
    if res.skipped:
        render.note(f"skipped {len(res.skipped)} file(s); see the warnings above")


# ---------------------------------------------------------------------------------------------
# bench


@app.command("bench")
def bench_cmd(
    models: Annotated[
        list[str], typer.Argument(help="Registered model names (see capsctl models).")
    ],
    batch_size: Annotated[int, typer.Option("--batch-size", "-b")] = 32,
    iters: Annotated[int, typer.Option(help="Timed steps per model (median reported).")] = 5,
    warmup: Annotated[int, typer.Option(help="Untimed warm-up steps.")] = 1,
    train: Annotated[bool, typer.Option("--train", help="Only the training step.")] = False,
    infer: Annotated[bool, typer.Option("--infer", help="Only inference.")] = False,
    device: Annotated[str, typer.Option(help="cpu, cuda, mps or auto.")] = "cpu",
    iterations: Annotated[int | None, typer.Option(help="Override T of capsule models.")] = None,
    routing: Annotated[
        str | None, typer.Option(help="Override routing: concurrent or sequential.")
    ] = None,
    threads: Annotated[int | None, typer.Option(help="torch intra-op threads.")] = None,
    json_out: JsonOpt = False,
    csv_out: Annotated[
        bool,
        typer.Option(
            "--csv",
            help="Print CSV with timm's benchmark columns (infer_samples_per_sec, ...).",
        ),
    ] = False,
) -> None:
    """Median training-step time, inference images/s and peak memory per model, in one process."""
    from capsctl import render
    from capsctl.bench import rows_to_csv, rows_to_json, run_bench

    if train and infer:
        raise UsageError("--train and --infer exclude each other; give neither to measure both")
    if json_out and csv_out:
        raise UsageError("--json and --csv exclude each other")
    with render.simple_progress("bench", quiet=json_out or csv_out) as on_event:
        rows = run_bench(
            models,
            batch_size=batch_size,
            iters=iters,
            warmup=warmup,
            train=not infer,
            infer=not train,
            device=device,
            iterations=iterations,
            routing=routing,
            threads=threads,
            on_event=on_event,
        )
    if json_out:
        render.print_json(rows_to_json(rows, {"iters": iters}))
        return
    if csv_out:
        sys.stdout.write(rows_to_csv(rows))
        return
    ref = any(r.name == "resnet18" for r in rows)
    cols = ["model", "params", "T", "routing", "train step", "min", "infer img/s", "peak mem"]
    if ref:
        cols += ["train vs resnet18", "infer vs resnet18"]
    body = []
    for r in rows:
        row = [
            r.name,
            render.fmt_int(r.params),
            r.iterations or "-",
            r.routing or "-",
            render.fmt_s(r.train_step_s),
            render.fmt_s(r.train_step_min_s),
            "-" if r.infer_images_per_s is None else f"{r.infer_images_per_s:.1f}",
            render.fmt_bytes(
                r.peak_device_bytes if r.peak_device_bytes is not None else r.peak_rss_bytes
            ),
        ]
        if ref:
            row += [render.fmt_ratio(r.train_ratio), render.fmt_ratio(r.infer_ratio)]
        body.append(row)
    import torch

    title = (
        f"capsctl bench  device {rows[0].device}  batch {batch_size}  {iters} timed steps  "
        f"{torch.get_num_threads()} threads  torch {torch.__version__}"
    )
    render.out.print(render.table(title, cols, body, right=(1, 2, 4, 5, 6, 7, 8, 9)))
    render.note(
        "peak mem: resident memory of the whole process while the model ran (device memory on GPU)"
    )


# ---------------------------------------------------------------------------------------------
# plot


@app.command("plot")
def plot_cmd(
    runs: Annotated[
        list[Path],
        typer.Argument(help="Run folders written by capsctl train (or their metrics.jsonl)."),
    ],
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            help="Picture to write (.png, .svg or .pdf). Default: curves.png in the run folder "
            "for one run, in the current folder for several.",
        ),
    ] = None,
    metric: Annotated[
        list[str] | None,
        typer.Option(
            "--metric",
            "-m",
            help="What to draw (repeatable): loss, accuracy, train_loss, val_loss, "
            "train_accuracy, val_accuracy, val_top5, lr, images_per_s, epoch_seconds. "
            "Default: loss, accuracy, lr.",
        ),
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Training curves (loss, accuracy, learning rate per epoch) of one or several runs."""
    from capsctl import render
    from capsctl.curves import CURVES_FILE, metrics_path, plot_runs, resolve_metrics

    keys = resolve_metrics(metric)
    if out is None:
        out = metrics_path(runs[0]).parent / CURVES_FILE if len(runs) == 1 else Path(CURVES_FILE)
    read: list[dict[str, Any]] = []
    path = plot_runs(runs, out, keys, on_event=read.append)
    if json_out:
        render.print_json(
            {
                "out": str(path),
                "metrics": keys,
                "runs": [{k: e[k] for k in ("name", "path", "epochs")} for e in read],
            }
        )
        return
    epochs = ", ".join(f"{e['name']} {e['epochs']} epochs" for e in read)
    render.out.print(f"wrote {path}  ({', '.join(keys)}; {epochs})", soft_wrap=True)


# ---------------------------------------------------------------------------------------------
# compare


@app.command("compare")
def compare_cmd(
    models: Annotated[
        list[str] | None,
        typer.Argument(
            help="Registered models, presets, aliases (caps, "
            "resnet18), preset files or checkpoints."
        ),
    ] = None,
    suite: Annotated[
        str | None,
        typer.Option(
            "--suite", help="A named set: paper (the paper's CIFAR comparison) or paper-cifar10."
        ),
    ] = None,
    speed: Annotated[
        bool, typer.Option("--speed", help="Also measure speed and memory (capsctl bench).")
    ] = False,
    batch_size: Annotated[int, typer.Option("--batch-size", "-b", help="Batch for --speed.")] = 32,
    iters: Annotated[int, typer.Option(help="Timed steps for --speed.")] = 3,
    device: Annotated[str, typer.Option(help="Device for --speed and --eval.")] = "cpu",
    eval_: Annotated[
        bool, typer.Option("--eval", help="Recompute checkpoints' accuracy on the test split.")
    ] = False,
    data_dir: Annotated[
        str | None, typer.Option("--data-dir", help="Where datasets live (for --eval).")
    ] = None,
    json_out: JsonOpt = False,
    csv_out: Annotated[bool, typer.Option("--csv", help="Print CSV instead of a table.")] = False,
) -> None:
    """Parameters, GFLOPs, speed and accuracy side by side, with ratios against resnet18."""
    from capsctl import render
    from capsctl.compare import SUITES, compare

    targets = list(models or [])
    if suite is not None:
        if suite not in SUITES:
            raise UsageError(f"--suite {suite}: unknown; choose one of {', '.join(SUITES)}")
        targets = SUITES[suite] + targets
    if not targets:
        raise UsageError("name models to compare (see capsctl models), or --suite paper")
    if json_out and csv_out:
        raise UsageError("--json and --csv exclude each other")
    quiet = json_out or csv_out
    with render.simple_progress("compare", quiet=quiet) as on_event:
        report = compare(
            targets,
            speed=speed,
            batch_size=batch_size,
            iters=iters,
            device=device,
            evaluate=eval_,
            data_dir=data_dir,
            on_event=on_event,
        )
    if json_out:
        render.print_json(report.to_dict())
        return
    if csv_out:
        sys.stdout.write(report.to_csv())
        return
    cols = ["model", "params", "backbone", "capsules", "GFLOPs", "all passes", "T"]
    if speed:
        cols += ["train step", "infer img/s", "peak mem"]
    cols += ["accuracy", "published"]
    body = []
    for r in report.rows:
        row = [
            r.name,
            render.fmt_int(r.params["total"]),
            render.fmt_int(r.params["backbone"]),
            render.fmt_int(r.params["capsules"]),
            f"{r.gflops:.3f}",
            "-" if r.gflops_all_passes is None else f"{r.gflops_all_passes:.3f}",
            "-" if r.iterations is None else f"{r.iterations} {r.routing}",
        ]
        if speed:
            row += [
                render.fmt_s(r.train_step_s),
                "-" if r.infer_images_per_s is None else f"{r.infer_images_per_s:.1f}",
                render.fmt_bytes(r.peak_memory_bytes),
            ]
        row += [render.fmt_pct(r.accuracy), render.fmt_pct(r.reference_accuracy)]
        body.append(row)
    render.out.print(render.table("capsctl compare", cols, body, right=tuple(range(1, len(cols)))))
    for line in report.footer:
        render.out.print(line)
    render.note(report.flops_note)
    sources = {r.accuracy_source for r in report.rows if r.accuracy_source} | {
        r.reference_source for r in report.rows if r.reference_source
    }
    for src in sorted(sources):
        render.note(f"accuracy source: {src}")


# ---------------------------------------------------------------------------------------------
# export


@app.command("export")
def export_cmd(
    ckpt: Annotated[Path, typer.Argument(help="A capsctl .safetensors checkpoint.")],
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            "-f",
            help="onnx, pt2, safetensors, or hf (a model folder: model.safetensors, config.json "
            "and a README.md model card).",
        ),
    ] = "onnx",
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Output file (default: beside CKPT).")
    ] = None,
    data_dir: Annotated[
        str | None,
        typer.Option(
            "--data-dir",
            help="Where the checkpoint's dataset lives (real images for the parity check).",
        ),
    ] = None,
    check_images: Annotated[
        int, typer.Option("--check-images", help="Test images to check parity on.")
    ] = 16,
    tolerance: Annotated[
        float, typer.Option(help="Largest allowed |exported - eager| (float32).")
    ] = 1e-4,
    json_out: JsonOpt = False,
) -> None:
    """Export to ONNX (self-contained, dynamic batch), torch.export (.pt2), a weights-only
    safetensors release (with a JSON sidecar) or a Hugging Face-style model folder (hf: --out
    is the folder), each checked against eager PyTorch. CKPT may itself be a model folder."""
    from capsctl import render
    from capsctl.checkpoint import read_metadata
    from capsctl.data.samples import sample_images
    from capsctl.errors import DataError
    from capsctl.export import export_checkpoint

    if not ckpt.exists():
        raise UsageError(f"{ckpt}: no such file")
    meta = read_metadata(ckpt)
    try:
        sample = sample_images(
            meta, split="test", indices=list(range(check_images)), data_dir=data_dir
        )
        images, described = sample.normalized, sample.description
    except (DataError, UsageError) as e:
        images, described = None, None
        if not json_out:
            render.note(
                "[yellow]note:[/] checking on random images: the test images are not "
                f"available ({e})"
            )
    with (
        render.err.status(f"exporting {ckpt.name} to {fmt}", spinner="dots")
        if not json_out
        else _null()
    ):
        res = export_checkpoint(
            ckpt, fmt, out, check_images=images, check_description=described, tolerance=tolerance
        )
    if json_out:
        render.print_json(res.to_dict())
        return
    diff = "-" if res.max_abs_diff is None else f"{res.max_abs_diff:.2e}"
    if res.format == "hf":
        render.out.print(
            f"wrote model folder {res.path} ({', '.join(res.files)}; "
            f"{render.fmt_bytes(res.size_bytes)})"
        )
        render.out.print(
            f"max |folder - checkpoint| = {diff} on {res.checked_on} (must be identical)"
        )
        return
    render.out.print(f"wrote {res.path} ({render.fmt_bytes(res.size_bytes)}) and {res.sidecar}")
    render.out.print(
        f"max |exported - eager| = {diff} on {res.checked_on} (tolerance {tolerance:g})"
    )


def _null() -> Any:
    from contextlib import nullcontext

    return nullcontext()


# ---------------------------------------------------------------------------------------------
# inspect-routing


def _parse_indices(text: str | None) -> list[int] | None:
    if text is None:
        return None
    out: list[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                a, b = part.split("-", 1)
                out.extend(range(int(a), int(b) + 1))
            elif part:
                out.append(int(part))
    except ValueError:
        raise UsageError(f"--indices {text}: expected numbers and ranges like 0,3,10-12") from None
    return out


@app.command("inspect-routing")
def inspect_cmd(
    ckpt: Annotated[Path, typer.Argument(help="A capsctl checkpoint of a capsule network.")],
    split: Annotated[
        str, typer.Option(help="Dataset split the --indices refer to: train, val or test.")
    ] = "test",
    indices: Annotated[
        str | None, typer.Option(help="Images of the split, e.g. 0,3,10-12 (default 0-7).")
    ] = None,
    image: Annotated[
        list[Path] | None, typer.Option("--image", help="Image file(s) instead of the dataset.")
    ] = None,
    random: Annotated[
        int | None, typer.Option(help="A seeded random batch of N images instead.")
    ] = None,
    data_dir: Annotated[
        str | None, typer.Option("--data-dir", help="Where the dataset lives.")
    ] = None,
    iterations: Annotated[int | None, typer.Option(help="Override T.")] = None,
    routing: Annotated[
        str | None, typer.Option(help="Override routing: concurrent or sequential.")
    ] = None,
    top: Annotated[int, typer.Option(help="How many parents/children to list.")] = 5,
    dump: Annotated[
        Path | None, typer.Option("--dump", help="Write raw coefficients to FILE.safetensors.")
    ] = None,
    png: Annotated[
        Path | None,
        typer.Option("--png", help="Write heatmaps and overlays to DIR (needs capsctl[plot])."),
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """What the routing does: entropy, confidence, changes across iterations, which parents and
    which child capsules carry the prediction."""
    from capsctl import render
    from capsctl.checkpoint import load_checkpoint
    from capsctl.data.samples import sample_images
    from capsctl.inspect_routing import inspect_routing, write_pngs

    if not ckpt.exists():
        raise UsageError(f"{ckpt}: no such file")
    if sum(x is not None and x != [] for x in (indices, image, random)) > 1:
        raise UsageError("choose one of --indices, --image and --random")
    model, meta = load_checkpoint(ckpt)
    sample = sample_images(
        meta,
        split=split,
        indices=_parse_indices(indices),
        files=image or None,
        random=random,
        data_dir=data_dir,
    )
    report = inspect_routing(
        model,
        sample.normalized,
        labels=sample.labels,
        classes=list(meta["classes"]),
        iterations=iterations,
        routing=routing,
        top=top,
    )
    written: list[str] = []
    if dump is not None:
        report.dump(dump)
        written.append(str(dump))
    if png is not None:
        written += [str(p) for p in write_pngs(report, sample.raw, png)]
    if json_out:
        render.print_json(
            {
                "checkpoint": str(ckpt),
                "inputs": sample.description,
                **report.to_dict(),
                "written": written,
            }
        )
        return
    render.out.print(
        f"[bold]{ckpt}[/]  T={report.iterations} {report.routing}  on {sample.description}"
    )
    rows = []
    for layer in report.layers:
        name = f"{layer.index}: {layer.kind} {layer.child_types}->{layer.parent_types}"
        for it in layer.iterations:
            rows.append(
                [
                    name if it.iteration == 1 else "",
                    it.iteration,
                    f"{it.mean_entropy:.3f}",
                    f"{it.mean_max:.3f}",
                    "-" if it.top_changed is None else render.fmt_pct(it.top_changed, 1),
                    "-" if it.pose_stability is None else f"{it.pose_stability:.3f}",
                ]
            )
    render.out.print(
        render.table(
            "Routing statistics (entropy normalized to [0, 1]; 1 = uniform)",
            ["layer", "iter", "entropy", "max coeff", "top parent changed", "pose stability"],
            rows,
            right=(1, 2, 3, 4, 5),
        )
    )
    rows = [
        [
            f"{layer.index}: {layer.kind}",
            ", ".join(f"{j} ({100 * s:.1f}%)" for j, s in layer.parents_receiving),
        ]
        for layer in report.layers
    ]
    render.out.print(
        render.table(
            "Parent types receiving the most routing (last iteration)",
            ["layer", "parent type (share)"],
            rows,
        )
    )
    rows = []
    for im in report.images:
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
    render.out.print(
        render.table(
            "Child capsules routing into the predicted class",
            ["image", "predicted", "p", "label", "top children (coefficient)"],
            rows,
            right=(0, 2),
        )
    )
    for w in written[:3]:
        render.note(f"wrote {w}")
    if len(written) > 3:
        render.note(f"... and {len(written) - 3} more files")


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """Entry point: one-line errors on stderr, exit code 1 (usage 2); --debug shows tracebacks."""
    debug_flag = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        # Outside standalone mode Typer returns the exit code of a typer.Exit, and turns Ctrl-C
        # (a KeyboardInterrupt before training has installed its own handler) into Exit(130).
        code = app(args=argv, standalone_mode=False)
        if code == 130:
            print("interrupted", file=sys.stderr)
        if isinstance(code, int) and not isinstance(code, bool) and code != 0:
            sys.exit(code)
    except CapsctlError as e:
        if _state["debug"] or debug_flag:
            raise
        from capsctl import render

        render.error(str(e))
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        if _state["debug"] or debug_flag:
            raise
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(1)
    except Exception as e:  # click usage errors carry their own exit code
        code = getattr(e, "exit_code", None)
        if code is not None and hasattr(e, "show"):
            e.show()
            sys.exit(code)
        if _state["debug"] or debug_flag:
            raise
        from capsctl import render

        render.error(f"{type(e).__name__}: {e} (run with --debug for the traceback)")
        sys.exit(1)
