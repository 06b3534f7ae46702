"""``capsctl train``: parse, one call to :func:`capsctl.training.train_from_preset`, render."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from capsctl.cli.app import OUTPUTS, JsonOpt, app
from capsctl.errors import UsageError
from capsctl.numbers import (
    MAX_BATCH,
    MAX_COUNT,
    MAX_EPOCHS,
    MAX_LR,
    MAX_SEED,
    Duration,
    Float,
    Int,
)


@app.command("train")
def train_cmd(
    preset: Annotated[
        str | None, typer.Option("--preset", "-p", help="Preset name or YAML file.")
    ] = None,
    epochs: Annotated[
        int | None,
        typer.Option(help="Number of epochs.", parser=Int("--epochs", 1, MAX_EPOCHS)),
    ] = None,
    time_limit: Annotated[
        float | None,
        typer.Option(
            "--time-limit",
            help="Wall-time budget of the whole run, e.g. 30m, 1.5h or 1800 (seconds): the LR "
            "schedule is fitted to it and training stops in time for the final test.",
            parser=Duration("--time-limit"),
            metavar="<duration>",
        ),
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option(
            "--batch-size",
            "-b",
            help="Training batch size.",
            parser=Int("--batch-size", 1, MAX_BATCH),
        ),
    ] = None,
    lr: Annotated[
        float | None,
        typer.Option(help="Base learning rate.", parser=Float("--lr", 0, MAX_LR, lo_open=True)),
    ] = None,
    router: Annotated[
        str | None,
        typer.Option(
            "--router",
            help="Route with this algorithm (idpa, dynamic, em or self) and its own defaults: "
            "--set model.router=NAME.",
        ),
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(
            help="auto, cpu, cuda or mps; by default the preset's train.device (auto: a GPU "
            "where there is one; the quickstart's is cpu)."
        ),
    ] = None,
    data_dir: Annotated[
        str | None,
        typer.Option(
            "--data-dir",
            help="Where datasets live (default: $CAPSCTL_DATA, else a per-user cache).",
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", "-o", help="Run folder (default runs/<preset>).", rich_help_panel=OUTPUTS
        ),
    ] = None,
    seed: Annotated[
        int | None, typer.Option(help="Random seed.", parser=Int("--seed", 0, MAX_SEED))
    ] = None,
    deterministic: Annotated[
        bool, typer.Option("--deterministic", help="Deterministic algorithms.")
    ] = False,
    amp: Annotated[
        bool | None,
        typer.Option(
            "--amp/--no-amp",
            help="bf16 autocast on or off (default: the preset's train.amp, auto unless it "
            "says otherwise: bf16 where the device trains faster in it, a GPU or a CPU with AMX).",
            show_default=False,
        ),
    ] = None,
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
            parser=Int("--nproc", 1, MAX_COUNT),
        ),
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Train a model from a preset; writes best/last.safetensors, metrics.jsonl and preset.yaml.

    Example: capsctl train --preset quickstart --router dynamic --epochs 2
    """
    from capsctl.views.common import print_json
    from capsctl.views.progress import TrainProgress
    from capsctl.views.training import print_fit_result

    if nproc is not None:
        _launch_torchrun(nproc)
        return
    silent = os.environ.get("RANK", "0") != "0"  # under torchrun only the first process reports
    from capsctl.training import train_from_preset

    with TrainProgress(quiet=json_out or silent) as progress:
        result = train_from_preset(
            preset,
            resume=resume,
            out=out,
            overrides=set_ or [],
            overwrite=overwrite,
            on_event=progress,
            epochs=epochs,
            time_limit=time_limit,
            batch_size=batch_size,
            lr=lr,
            router=router,
            device=device,
            data_dir=data_dir,
            seed=seed,
            deterministic=deterministic,
            amp=amp,
            compile=compile_,
        )
    if silent:
        return
    if json_out:
        print_json(result.to_dict())
        return
    print_fit_result(result)


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
