"""``capsctl export``, ``capsctl inspect-routing`` and ``capsctl plot``: parse, one call, render."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer

from capsctl.cli.app import OUTPUTS, JsonOpt, app
from capsctl.cli.inputs import require_input
from capsctl.curves.plot import known_metrics
from capsctl.numbers import MAX_COUNT, MAX_IMAGES, MAX_ITERATIONS, Float, Int, Ints


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
        Path | None,
        typer.Option(
            "--out",
            "-o",
            help="Output file, or folder for hf (default: CKPT's name in the current folder).",
            rich_help_panel=OUTPUTS,
        ),
    ] = None,
    data_dir: Annotated[
        str | None,
        typer.Option(
            "--data-dir",
            help="Where the checkpoint's dataset lives (real images for the parity check).",
        ),
    ] = None,
    check_images: Annotated[
        int,
        typer.Option(
            "--check-images",
            help="Test images to check parity on.",
            parser=Int("--check-images", 1, MAX_IMAGES),
        ),
    ] = 16,
    tolerance: Annotated[
        float,
        typer.Option(
            help="Largest allowed |exported - eager| (float32).",
            parser=Float("--tolerance", 0, 1),
        ),
    ] = 1e-4,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite", help="Replace an existing output (never the checkpoint itself)."
        ),
    ] = False,
    json_out: JsonOpt = False,
) -> None:
    """Export to ONNX (self-contained, dynamic batch), torch.export (.pt2), a weights-only
    safetensors release (with a JSON sidecar) or a Hugging Face-style model folder (hf: --out
    is the folder), each checked against eager PyTorch. CKPT may itself be a model folder."""
    from capsctl.export import export_checkpoint
    from capsctl.views.artifacts import print_export
    from capsctl.views.common import print_json, spinner

    require_input(ckpt)
    status = spinner(f"exporting {ckpt.name} to {fmt}")
    with status if not json_out else contextlib.nullcontext():
        res = export_checkpoint(
            ckpt,
            fmt,
            out,
            check_images=check_images,
            data_dir=data_dir,
            tolerance=tolerance,
            overwrite=overwrite,
        )
    if json_out:
        print_json(res.to_dict())
    else:
        print_export(res)


@app.command("inspect-routing")
def inspect_cmd(
    ckpt: Annotated[Path, typer.Argument(help="A capsctl checkpoint of a capsule network.")],
    split: Annotated[
        str, typer.Option(help="Dataset split the --indices refer to: train, val or test.")
    ] = "test",
    indices: Annotated[
        Sequence[int] | None,
        typer.Option(
            help="Images of the split, e.g. 0,3,10-12 (default 0-7).",
            parser=Ints("--indices", 0, MAX_IMAGES, ranges=True),
            metavar="<indices>",
        ),
    ] = None,
    image: Annotated[
        list[Path] | None, typer.Option("--image", help="Image file(s) instead of the dataset.")
    ] = None,
    random: Annotated[
        int | None,
        typer.Option(
            help="A seeded random batch of N images instead.",
            parser=Int("--random", 1, MAX_IMAGES),
        ),
    ] = None,
    data_dir: Annotated[
        str | None, typer.Option("--data-dir", help="Where the dataset lives.")
    ] = None,
    iterations: Annotated[
        int | None,
        typer.Option(help="Override T.", parser=Int("--iterations", 1, MAX_ITERATIONS)),
    ] = None,
    routing: Annotated[
        str | None, typer.Option(help="Override routing: concurrent or sequential.")
    ] = None,
    top: Annotated[
        int,
        typer.Option(help="How many parents/children to list.", parser=Int("--top", 1, MAX_COUNT)),
    ] = 5,
    dump: Annotated[
        Path | None,
        typer.Option(
            "--dump", help="Write raw coefficients to FILE.safetensors.", rich_help_panel=OUTPUTS
        ),
    ] = None,
    png: Annotated[
        Path | None,
        typer.Option(
            "--png",
            help=r"Write heatmaps and overlays to DIR (needs capsctl\[plot]).",
            rich_help_panel=OUTPUTS,
        ),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite", help="Replace existing --dump and --png files (never the checkpoint)."
        ),
    ] = False,
    json_out: JsonOpt = False,
) -> None:
    """What the routing does: entropy, confidence, changes across iterations, which parents and
    which child capsules carry the prediction.

    Example: capsctl inspect-routing quickstart.idpa --indices 0-7 --png routing/
    """
    from capsctl.inspection import inspect_checkpoint
    from capsctl.views.artifacts import print_inspection
    from capsctl.views.common import print_json

    result = inspect_checkpoint(
        ckpt,
        split=split,
        indices=indices,
        image_files=image,
        random=random,
        data_dir=data_dir,
        iterations=iterations,
        routing=routing,
        top=top,
        dump=dump,
        png_dir=png,
        overwrite=overwrite,
    )
    if json_out:
        print_json(result.to_dict())
    else:
        print_inspection(result)


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
            help="Picture to write (.png, .svg or .pdf). Default: curves.png in the current "
            "folder (a run folder keeps its own curves.png).",
            rich_help_panel=OUTPUTS,
        ),
    ] = None,
    metric: Annotated[
        list[str] | None,
        typer.Option(
            "--metric",
            "-m",
            help=f"What to draw (repeatable): {', '.join(known_metrics())}. "
            "Default: loss, accuracy, lr.",
        ),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace an existing picture at --out.")
    ] = False,
    json_out: JsonOpt = False,
) -> None:
    """Training curves (loss, accuracy, learning rate per epoch) of one or several runs."""
    from capsctl.curves import plot_runs, resolve_metrics
    from capsctl.views.artifacts import print_plot
    from capsctl.views.common import print_json

    keys = resolve_metrics(metric)
    read: list[dict] = []
    path = plot_runs(runs, out, keys, overwrite=overwrite, on_event=read.append)
    if json_out:
        runs_read = [{k: e[k] for k in ("name", "path", "epochs")} for e in read]
        print_json({"out": str(path), "metrics": keys, "runs": runs_read})
    else:
        print_plot(path, keys, read)
