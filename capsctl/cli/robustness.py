"""``capsctl robustness``: parse, one library call, render."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from capsctl.cli.app import JsonOpt, app
from capsctl.errors import UsageError


def _numbers(flag: str, text: str | None) -> list[float] | None:
    """``1/255,2/255,0.01`` -> floats (fractions allowed)."""
    if text is None:
        return None
    values = []
    for part in (p.strip() for p in text.split(",")):
        try:
            num, _, den = part.partition("/")
            values.append(float(num) / (float(den) if den else 1.0))
        except (ValueError, ZeroDivisionError):
            raise UsageError(f"{flag} {text}: expected numbers like 1/255,8/255 or 0.03") from None
    return values


def _attacks(text: str | None, shift: str | None, corruptions: bool) -> tuple[str, ...]:
    """The attacks asked for; by default fgsm,pgd, unless only shifts or corruptions are."""
    if text is None:
        return () if shift or corruptions else ("fgsm", "pgd")
    if text.strip() == "none":
        return ()
    return tuple(a.strip() for a in text.split(",") if a.strip())


@app.command("robustness")
def robustness_cmd(
    ckpts: Annotated[list[Path], typer.Argument(help="Checkpoints or model folders.")],
    attack: Annotated[
        str | None,
        typer.Option(help="fgsm,pgd or none (default fgsm,pgd unless --shift/--corruptions)."),
    ] = None,
    eps: Annotated[
        str, typer.Option(help="L-inf radii on [0, 1] pixels.")
    ] = "1/255,2/255,4/255,8/255",
    targeted: Annotated[bool, typer.Option(help="Targeted to (label + 1) mod classes.")] = False,
    steps: Annotated[int, typer.Option(help="PGD steps (step size 2.5 * eps / steps).")] = 10,
    loss: Annotated[
        str,
        typer.Option(
            help="own (the model's training loss) or cw (Carlini-Wagner margin: checks that a "
            "flat own loss is not masking the gradient)."
        ),
    ] = "own",
    shift: Annotated[
        str | None, typer.Option(help="affine (affNIST-style, 40x40 models), translate, rotate.")
    ] = None,
    magnitudes: Annotated[
        str | None, typer.Option(help="Shift magnitudes: degrees, pixels or affNIST share.")
    ] = None,
    corruptions: Annotated[
        bool, typer.Option("--corruptions", help="The 15 x 5 CIFAR-10-C corruptions.")
    ] = False,
    limit: Annotated[int | None, typer.Option(help="Only the first N test images.")] = None,
    batch_size: Annotated[int | None, typer.Option("--batch-size", "-b")] = None,
    seed: Annotated[int, typer.Option(help="Seed of PGD starts, shifts and corruptions.")] = 0,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or mps.")] = "auto",
    data_dir: Annotated[str | None, typer.Option("--data-dir", help="Where datasets live.")] = None,
    png: Annotated[
        Path | None, typer.Option("--png", help="Folder for accuracy-vs-eps/shift pictures.")
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace existing pictures.")] = False,
    resume_file: Annotated[
        Path | None,
        typer.Option(
            "--resume-file",
            help="Keep each finished setting in this file; a rerun with it measures only the "
            "settings missing there (a Ctrl-C loses at most the one in progress).",
        ),
    ] = None,
    json_out: JsonOpt = False,
    csv_out: Annotated[bool, typer.Option("--csv", help="Print CSV rows.")] = False,
) -> None:
    """Robust accuracy under white-box FGSM/PGD (each model's own loss), shifted test sets and
    CIFAR-10-C corruptions; one table per checkpoint, side by side for several."""
    from capsctl.robustness.run import run_robustness
    from capsctl.views.common import print_json
    from capsctl.views.progress import simple_progress
    from capsctl.views.robustness import print_robustness, robustness_csv

    if json_out and csv_out:
        raise UsageError("--json and --csv exclude each other")
    with simple_progress("robustness", quiet=json_out or csv_out) as on_event:
        run = run_robustness(
            [str(c) for c in ckpts],
            png=png,
            overwrite=overwrite,
            resume_file=resume_file,
            on_event=on_event,
            attacks=_attacks(attack, shift, corruptions),
            eps=_numbers("--eps", eps) or [],
            targeted=targeted,
            steps=steps,
            loss=loss,
            shift=shift,
            magnitudes=_numbers("--magnitudes", magnitudes),
            corruptions=corruptions,
            limit=limit,
            batch_size=batch_size,
            seed=seed,
            device=device,
            data_dir=data_dir,
        )
    if json_out:
        print_json(run.to_dict())
    elif csv_out:
        sys.stdout.write(robustness_csv(run.results))
    else:
        print_robustness(run.results)
