"""``capsctl bench`` and ``capsctl compare``: parse, one library call, render."""

from __future__ import annotations

from typing import Annotated

import typer

from capsctl.cli.app import JsonOpt, app
from capsctl.errors import UsageError
from capsctl.numbers import MAX_BATCH, MAX_COUNT, MAX_ITERATIONS, MAX_STEPS, Int


@app.command("bench")
def bench_cmd(
    models: Annotated[
        list[str], typer.Argument(help="Registered model names (see capsctl models).")
    ],
    batch_size: Annotated[
        int, typer.Option("--batch-size", "-b", parser=Int("--batch-size", 1, MAX_BATCH))
    ] = 32,
    iters: Annotated[
        int,
        typer.Option(
            help="Timed steps per model (median reported).", parser=Int("--iters", 1, MAX_STEPS)
        ),
    ] = 5,
    warmup: Annotated[
        int, typer.Option(help="Untimed warm-up steps.", parser=Int("--warmup", 0, MAX_STEPS))
    ] = 1,
    train: Annotated[bool, typer.Option("--train", help="Only the training step.")] = False,
    infer: Annotated[bool, typer.Option("--infer", help="Only inference.")] = False,
    device: Annotated[
        str,
        typer.Option(
            help="cpu, cuda, mps or auto; cpu by default, unlike eval and predict (auto), so "
            "that timings taken on different machines measure the same device."
        ),
    ] = "cpu",
    iterations: Annotated[
        int | None,
        typer.Option(
            help="Override T of capsule models.",
            parser=Int("--iterations", 1, MAX_ITERATIONS),
        ),
    ] = None,
    routing: Annotated[
        str | None, typer.Option(help="Override routing: concurrent or sequential.")
    ] = None,
    threads: Annotated[
        int | None,
        typer.Option(help="torch intra-op threads.", parser=Int("--threads", 1, MAX_COUNT)),
    ] = None,
    amp: Annotated[
        bool | None,
        typer.Option(
            "--amp/--no-amp",
            help="bf16 autocast on or off (default: auto, as train's: bf16 where the device "
            "trains faster in it).",
            show_default=False,
        ),
    ] = None,
    channels_last: Annotated[
        bool, typer.Option("--channels-last", help="channels_last memory format.")
    ] = False,
    compile_: Annotated[
        bool, typer.Option("--compile", help="Time torch.compile(model) (compiles in warm-up).")
    ] = False,
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
    from capsctl.bench import rows_to_csv, rows_to_json, run_bench
    from capsctl.views.common import print_json, print_plain
    from capsctl.views.measure import print_bench
    from capsctl.views.progress import simple_progress

    if train and infer:
        raise UsageError("--train and --infer exclude each other; give neither to measure both")
    if json_out and csv_out:
        raise UsageError("--json and --csv exclude each other")
    if compile_:
        from capsctl.compile_cache import use_private_compile_cache

        use_private_compile_cache()  # never the shared $TMPDIR/torchinductor_<user>
    with simple_progress("bench", quiet=json_out or csv_out) as on_event:
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
            amp="auto" if amp is None else amp,
            channels_last=channels_last,
            compile=compile_,
            on_event=on_event,
        )
    if json_out:
        print_json(rows_to_json(rows, {"iters": iters}))
    elif csv_out:
        print_plain(rows_to_csv(rows))
    else:
        print_bench(rows, batch_size, iters)


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
            "--suite",
            help="A named set: paper (the paper's CIFAR comparison) or paper-cifar10; or a "
            "capsctl suite (e.g. cifar10-fast), whose rows carry its measured accuracy.",
        ),
    ] = None,
    speed: Annotated[
        bool, typer.Option("--speed", help="Also measure speed and memory (capsctl bench).")
    ] = False,
    batch_size: Annotated[
        int,
        typer.Option(
            "--batch-size",
            "-b",
            help="Batch for --speed.",
            parser=Int("--batch-size", 1, MAX_BATCH),
        ),
    ] = 32,
    iters: Annotated[
        int, typer.Option(help="Timed steps for --speed.", parser=Int("--iters", 1, MAX_STEPS))
    ] = 3,
    device: Annotated[
        str,
        typer.Option(
            help="Device for --speed and --eval: cpu, cuda, mps or auto; cpu by default, unlike "
            "eval and predict (auto), so that timings taken on different machines compare."
        ),
    ] = "cpu",
    eval_: Annotated[
        bool, typer.Option("--eval", help="Recompute checkpoints' accuracy on the test split.")
    ] = False,
    data_dir: Annotated[
        str | None, typer.Option("--data-dir", help="Where datasets live (for --eval).")
    ] = None,
    json_out: JsonOpt = False,
    csv_out: Annotated[bool, typer.Option("--csv", help="Print CSV instead of a table.")] = False,
) -> None:
    """Parameters, GFLOPs, speed and accuracy side by side, with ratios against resnet18.

    Example: capsctl compare caps resnet18 cifar10-fast.idpa --speed
    """
    from capsctl.compare import compare, suite_targets
    from capsctl.compare.targets import SUITES
    from capsctl.views.common import print_json, print_plain
    from capsctl.views.measure import footer_lines, print_compare
    from capsctl.views.progress import simple_progress

    if json_out and csv_out:
        raise UsageError("--json and --csv exclude each other")
    targets = suite_targets(suite, models or [])
    with simple_progress("compare", quiet=json_out or csv_out) as on_event:
        report = compare(
            targets,
            speed=speed,
            batch_size=batch_size,
            iters=iters,
            device=device,
            evaluate=eval_,
            data_dir=data_dir,
            on_event=on_event,
            suite_names=[suite] if suite is not None and suite not in SUITES else [],
        )
    if json_out:
        print_json({**report.to_dict(), "footer": footer_lines(report)})
    elif csv_out:
        print_plain(report.to_csv())
    else:
        print_compare(report, speed)
