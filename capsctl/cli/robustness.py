"""``capsctl robustness``: parse, one library call, render."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer

from capsctl.cli.app import OUTPUTS, JsonOpt, app
from capsctl.errors import UsageError
from capsctl.numbers import MAX_BATCH, MAX_IMAGES, MAX_SEED, MAX_STEPS, Floats, Int, shown

#: Shift magnitudes up to half a turn (degrees); each shift's own range is checked by the
#: library (capsctl/robustness/api.py): translate pixels, affine a share of affNIST's ranges.
_MAGNITUDES = Floats("--magnitudes", 0, 180, "0,15,30 (rotate degrees)")


def _attacks(text: str | None, shift: str | None, corruptions: bool) -> tuple[str, ...]:
    """The attacks asked for; by default fgsm,pgd, unless only shifts or corruptions are."""
    if text is None:
        return () if shift or corruptions else ("fgsm", "pgd")
    if text.strip() == "none":
        return ()
    names = tuple(a.strip() for a in text.split(","))
    if not all(names):
        raise UsageError(f"--attack {shown(text)}: an empty name; give fgsm, pgd, fgsm,pgd or none")
    return tuple(dict.fromkeys(names))  # a repeated name is measured once


@app.command("robustness")
def robustness_cmd(
    ckpts: Annotated[list[Path], typer.Argument(help="Checkpoints or model folders.")],
    attack: Annotated[
        str | None,
        typer.Option(help="fgsm,pgd or none (default fgsm,pgd unless --shift/--corruptions)."),
    ] = None,
    eps: Annotated[
        Sequence[float],
        typer.Option(
            help="L-inf radii on [0, 1] pixels.",
            parser=Floats("--eps", 0, 1, "2/255,8/255"),
            metavar="<numbers>",
        ),
    ] = "1/255,2/255,4/255,8/255",  # type: ignore[assignment]  # the parser makes it numbers
    targeted: Annotated[bool, typer.Option(help="Targeted to (label + 1) mod classes.")] = False,
    steps: Annotated[
        int,
        typer.Option(
            help="PGD steps (step size 2.5 * eps / steps).", parser=Int("--steps", 1, MAX_STEPS)
        ),
    ] = 10,
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
        Sequence[float] | None,
        typer.Option(
            help="Shift magnitudes: rotate degrees (0-180), translate pixels (0-64) or affine "
            "share of affNIST's ranges (0-1).",
            parser=_MAGNITUDES,
            metavar="<numbers>",
        ),
    ] = None,
    corruptions: Annotated[
        bool, typer.Option("--corruptions", help="The 15 x 5 CIFAR-10-C corruptions.")
    ] = False,
    limit: Annotated[
        int | None,
        typer.Option(help="Only the first N test images.", parser=Int("--limit", 1, MAX_IMAGES)),
    ] = None,
    batch_size: Annotated[
        int | None, typer.Option("--batch-size", "-b", parser=Int("--batch-size", 1, MAX_BATCH))
    ] = None,
    seed: Annotated[
        int,
        typer.Option(
            help="Seed of PGD starts, shifts and corruptions.", parser=Int("--seed", 0, MAX_SEED)
        ),
    ] = 0,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or mps.")] = "auto",
    data_dir: Annotated[str | None, typer.Option("--data-dir", help="Where datasets live.")] = None,
    png: Annotated[
        Path | None,
        typer.Option(
            "--png", help="Folder for accuracy-vs-eps/shift pictures.", rich_help_panel=OUTPUTS
        ),
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace existing pictures.")] = False,
    resume_file: Annotated[
        Path | None,
        typer.Option(
            "--resume-file",
            help="Keep each finished setting in this file; a rerun with it measures only the "
            "settings missing there (a Ctrl-C loses at most the one in progress).",
            rich_help_panel=OUTPUTS,
        ),
    ] = None,
    json_out: JsonOpt = False,
    csv_out: Annotated[bool, typer.Option("--csv", help="Print CSV rows.")] = False,
) -> None:
    """Robust accuracy under white-box FGSM/PGD (each model's own loss, or --loss cw), shifted
    test sets and CIFAR-10-C corruptions; one table per checkpoint, side by side for several.

    Example: capsctl robustness cifar10-fast.idpa --attack fgsm,pgd --eps 2/255,8/255 --limit 1000
    """
    from capsctl.robustness.run import run_robustness
    from capsctl.views.common import print_json, print_plain
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
            eps=eps,
            targeted=targeted,
            steps=steps,
            loss=loss,
            shift=shift,
            magnitudes=magnitudes,
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
        print_plain(robustness_csv(run.results))
    else:
        print_robustness(run.results, [str(c) for c in ckpts])
