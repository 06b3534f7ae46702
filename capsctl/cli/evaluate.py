"""``capsctl eval`` and ``capsctl predict``: parse, one library call, render."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from capsctl.cli.app import JsonOpt, app
from capsctl.cli.inputs import require_input
from capsctl.errors import UsageError
from capsctl.numbers import MAX_BATCH, MAX_COUNT, Int


@app.command("eval")
def eval_cmd(
    ckpt: Annotated[Path, typer.Argument(help="A capsctl .safetensors checkpoint.")],
    data_dir: Annotated[str | None, typer.Option("--data-dir", help="Where datasets live.")] = None,
    split: Annotated[str, typer.Option(help="val or test.")] = "test",
    batch_size: Annotated[
        int | None, typer.Option("--batch-size", "-b", parser=Int("--batch-size", 1, MAX_BATCH))
    ] = None,
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
    """Evaluate a checkpoint: top-1/top-5, per-class accuracy, confusion matrix, loss, speed.

    Example: capsctl eval cifar10-fast.idpa --json
    """
    from capsctl.evaluation import evaluate_checkpoint
    from capsctl.views.common import print_json, print_plain
    from capsctl.views.evaluation import eval_csv, print_evaluation
    from capsctl.views.progress import simple_progress

    if json_out and csv_out:
        raise UsageError("--json and --csv exclude each other")
    require_input(ckpt)
    with simple_progress("eval", quiet=json_out or csv_out) as on_event:
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
        print_json({"checkpoint": str(ckpt), "epoch": meta.get("epoch"), **res.to_dict()})
    elif csv_out:
        print_plain(eval_csv(str(ckpt), meta, res.to_dict()))
    else:
        print_evaluation(str(ckpt), meta, res)


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
    top_k: Annotated[
        int,
        typer.Option(
            "--top-k", "-k", help="Classes shown per image.", parser=Int("--top-k", 1, MAX_COUNT)
        ),
    ] = 5,
    skip_bad: Annotated[
        bool,
        typer.Option("--skip-bad", help="Warn about unreadable or missing images and go on."),
    ] = False,
    batch_size: Annotated[
        int,
        typer.Option(
            "--batch-size",
            "-b",
            help="Images per forward pass.",
            parser=Int("--batch-size", 1, MAX_BATCH),
        ),
    ] = 64,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or mps.")] = "auto",
    json_out: JsonOpt = False,
) -> None:
    """Classify image files: the top-k classes and their scores per image. Images are converted
    and resized to the checkpoint's input the way its preprocessing says.

    Example: capsctl predict quickstart.idpa capsctl/samples/fashion-mnist/*.png --top-k 3
    """
    from capsctl.predict import predict_images
    from capsctl.views.common import print_json
    from capsctl.views.evaluation import print_predictions
    from capsctl.views.progress import simple_progress

    require_input(ckpt)
    with simple_progress("predict", quiet=json_out) as on_event:
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
        print_json(res.to_dict())
    else:
        print_predictions(str(ckpt), res)
