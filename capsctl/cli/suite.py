"""``capsctl suite list|run|report``: parse, one call into :mod:`capsctl.suites`, render."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer

from capsctl.cli.app import OUTPUTS, JsonOpt, app
from capsctl.errors import UsageError
from capsctl.numbers import MAX_IMAGES, MAX_SEED, Int, Ints

suite_app = typer.Typer(
    help="Run sets of (model, seed) trainings described as data, and report mean ± std.",
    no_args_is_help=True,
)
app.add_typer(suite_app, name="suite")

#: The copy of the suite a run folder keeps, so ``suite report DIR`` needs nothing else.
SUITE_COPY = "suite.yaml"


@suite_app.command("list")
def list_cmd(json_out: JsonOpt = False) -> None:
    """The bundled suites."""
    from capsctl.suites import list_suites
    from capsctl.views.common import print_json
    from capsctl.views.suite import print_suite_list

    suites = list_suites()
    if json_out:
        print_json([{"name": n, "description": d} for n, d in suites])
    else:
        print_suite_list(suites)


@suite_app.command("run")
def run_cmd(
    suite: Annotated[str, typer.Argument(help="A bundled suite (capsctl suite list) or a file.")],
    out: Annotated[
        Path,
        typer.Option("--out", "-o", help="Folder of the suite's runs.", rich_help_panel=OUTPUTS),
    ],
    only: Annotated[
        list[str] | None, typer.Option("--only", help="Only this member (repeatable).")
    ] = None,
    seeds: Annotated[
        Sequence[int] | None,
        typer.Option(
            "--seeds",
            help="Only these seeds, e.g. 0,1.",
            parser=Ints("--seeds", 0, MAX_SEED),
            metavar="<seeds>",
        ),
    ] = None,
    data_dir: Annotated[
        str | None, typer.Option("--data-dir", help="Where datasets live (default $CAPSCTL_DATA).")
    ] = None,
    print_commands: Annotated[
        bool,
        typer.Option(
            "--print-commands",
            help="Print one capsctl train command per pair (for a scheduler) and train nothing.",
        ),
    ] = False,
    json_out: JsonOpt = False,
) -> None:
    """Train every (member, seed) pair into OUT/MEMBER/seed-S; skips finished runs and resumes
    interrupted ones, so the same command continues a suite.

    Example: capsctl suite run cifar10-fast --out runs/suite --seeds 0 --print-commands
    """
    from capsctl.suites import load_suite, pair_commands, run_suite
    from capsctl.views.common import print_json, print_plain
    from capsctl.views.suite import SuiteProgress

    spec = load_suite(suite)
    chosen = list(seeds or [])
    if print_commands:
        lines = pair_commands(spec, out, only or [], chosen)
        if json_out:
            print_json({"commands": lines})
        else:
            print_plain("".join(line + "\n" for line in lines))
        return
    from capsctl.suites.pairs import check_suite, plan_pairs
    from capsctl.suites.tuning import chosen_lrs

    lrs = chosen_lrs(spec, [out])
    check_suite(spec, plan_pairs(spec, out, only or [], chosen, lrs))  # before OUT is written
    _keep_suite_copy(spec, out)
    with SuiteProgress(quiet=json_out) as progress:
        result = run_suite(
            spec, out, only=only or [], seeds=chosen, data_dir=data_dir, on_event=progress
        )
    if json_out:
        print_json(result.to_dict())
        return
    from shlex import quote

    from capsctl.views.common import note

    waiting = [p for p in result.pairs if p["status"] in ("waiting", "busy", "untuned")]
    note(
        f"suite {spec.name}: {len(result.pairs) - len(waiting)} of {len(result.pairs)} pairs "
        f"finished; capsctl suite report {quote(str(out))}"
    )


def _keep_suite_copy(spec: object, out: Path) -> None:
    """``OUT/suite.yaml``: the suite as run (refusing a folder that holds another suite, or one
    in a run folder or another suite's folder)."""
    from capsctl.atomic import check_output, write_text_atomic
    from capsctl.config.yaml_io import parse_yaml, to_yaml
    from capsctl.outputs import SUITE

    check_output(out, kind=SUITE)
    doc = spec.to_dict()  # type: ignore[attr-defined]
    path = out / SUITE_COPY
    if path.exists():
        old = parse_yaml(path.read_text(encoding="utf-8"), str(path))
        if isinstance(old, dict) and old.get("name") not in (None, doc["name"]):
            raise UsageError(
                f"--out {out}: holds suite {old.get('name')!r}, not {doc['name']!r}; choose "
                "another --out"
            )
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, to_yaml(doc))


@suite_app.command("tune")
def tune_cmd(
    suite: Annotated[str, typer.Argument(help="A bundled suite (capsctl suite list) or a file.")],
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            "-o",
            help="Folder of the suite's runs (tuning runs go to OUT/tune).",
            rich_help_panel=OUTPUTS,
        ),
    ],
    only: Annotated[
        list[str] | None,
        typer.Option("--only", help="Only this member (repeatable); tunes it even if chosen."),
    ] = None,
    data_dir: Annotated[
        str | None, typer.Option("--data-dir", help="Where datasets live (default $CAPSCTL_DATA).")
    ] = None,
    status: Annotated[
        bool, typer.Option("--status", help="Show where tuning stands and train nothing.")
    ] = False,
    json_out: JsonOpt = False,
) -> None:
    """Choose each member's learning rate on a validation split (the suite's tune block): one
    run per grid point into OUT/tune/MEMBER/lr-LR, the grid extended past an edge; the test
    set is never touched. Prints the tuned: line to record in the suite file.

    Example: capsctl suite tune cifar10-fast --out runs/suite --only idpa
    """
    from capsctl.suites import load_suite
    from capsctl.suites.tuning import TuneResult, member_tuning, tune_suite, tuned_members
    from capsctl.views.common import print_json
    from capsctl.views.suite import SuiteProgress, print_tuning

    spec = load_suite(suite)
    if not status:  # refuse an --out that is a file or in another run's folder, first
        from capsctl.atomic import check_output
        from capsctl.outputs import SUITE

        check_output(out, kind=SUITE)
    members = tuned_members(spec, only or [])
    if status:
        result = TuneResult(spec.name, [member_tuning(spec, m, [out]) for m in members])
    else:
        _keep_suite_copy(spec, out)
        with SuiteProgress(quiet=json_out) as progress:
            result = tune_suite(spec, out, only=only or [], data_dir=data_dir, on_event=progress)
    if json_out:
        print_json(result.to_dict())
    else:
        print_tuning(result.to_dict())


@suite_app.command("report")
def report_cmd(
    folders: Annotated[
        list[Path],
        typer.Argument(
            help="Folders given to capsctl suite run --out, or ledgers of their records; "
            "their pairs are merged.",
            metavar="FOLDER",
            show_default=False,
        ),
    ],
    suite: Annotated[
        str | None,
        typer.Option("--suite", help="The suite (default: the copy suite run keeps in FOLDERS)."),
    ] = None,
    data_dir: Annotated[
        str | None, typer.Option("--data-dir", help="Where datasets live (for scoring).")
    ] = None,
    no_score: Annotated[
        bool,
        typer.Option("--no-score", help="Do not score finished runs on missing test files."),
    ] = False,
    results: Annotated[
        Path | None,
        typer.Option(
            "--results",
            help="Also write the results file (CSV) to this path.",
            rich_help_panel=OUTPUTS,
        ),
    ] = None,
    png: Annotated[
        Path | None,
        typer.Option(
            "--png",
            help="Folder for accuracy vs parameters and GFLOPs plots.",
            rich_help_panel=OUTPUTS,
        ),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace existing --results and --png files.")
    ] = False,
    robustness: Annotated[
        bool,
        typer.Option(
            "--robustness",
            help="Add FGSM and PGD-10 accuracy at 8/255 and the mean CIFAR-10-C corruption "
            "accuracy (measured once per run, cached in its folder).",
        ),
    ] = False,
    robustness_limit: Annotated[
        int,
        typer.Option(
            "--robustness-limit",
            help="Test images attacked and corrupted.",
            parser=Int("--robustness-limit", 1, MAX_IMAGES),
        ),
    ] = 1000,
    json_out: JsonOpt = False,
    csv_out: Annotated[bool, typer.Option("--csv", help="Print the results CSV.")] = False,
) -> None:
    """Top-1 mean ± std over seeds per member, with parameters, GFLOPs, epochs, wall time and
    training speed; several FOLDERS (run folders and ledgers) are reported as one suite.

    Example: capsctl suite report benchmarks/suites/multimnist-cpu --no-score
    """
    from capsctl.suites import load_suite, report_suite, write_results
    from capsctl.suites.results_file import results_csv
    from capsctl.views.common import print_json, print_plain
    from capsctl.views.progress import simple_progress
    from capsctl.views.suite import print_suite_report

    if json_out and csv_out:
        raise UsageError("--json and --csv exclude each other")
    spec = load_suite(_suite_of(folders, suite))
    if results is not None:  # refused before any scoring, as the pictures are
        from capsctl.atomic import check_output
        from capsctl.outputs import RESULTS_CSV

        check_output(results, kind=RESULTS_CSV, overwrite=overwrite)
    if png is not None:
        from capsctl.suites.plot import check_plot_files

        check_plot_files(spec.name, png, overwrite=overwrite)
    settings = None
    if robustness:
        from capsctl.suites.robust import RobustSettings

        settings = RobustSettings(limit=robustness_limit, corruption_limit=robustness_limit)
    with simple_progress("scoring", quiet=json_out or csv_out) as on_event:
        report = report_suite(
            spec,
            folders,
            score=not no_score,
            data_dir=data_dir,
            on_event=on_event,
            robustness=settings,
        )
    if results is not None:
        write_results(report, results, overwrite=overwrite)
    doc = report.to_dict()
    if png is not None:
        from capsctl.suites.plot import suite_plot

        doc["png"] = suite_plot(doc, png, overwrite=overwrite)
    if json_out:
        print_json(json.loads(json.dumps(doc)))
    elif csv_out:
        print_plain(results_csv(report))
    else:
        print_suite_report(doc)
    if not json_out:
        from capsctl.views.common import note, warning_line

        for line in report.notes:
            note(warning_line(line, "note:"))


def _suite_of(folders: list[Path], suite: str | None) -> str:
    """``--suite``, else the suite copy the folders keep (all naming the same suite)."""
    from capsctl.config.yaml_io import parse_yaml

    for folder in folders:
        if not folder.is_dir():
            raise UsageError(f"{folder}: no such folder; give the --out of capsctl suite run")
    if suite is not None:
        return suite
    copies = [f / SUITE_COPY for f in folders if (f / SUITE_COPY).exists()]
    if not copies:
        raise UsageError(
            f"{folders[0]}: holds no {SUITE_COPY}; name the suite with --suite NAME|FILE"
        )
    names = {}
    for path in copies:
        doc = parse_yaml(path.read_text(encoding="utf-8"), str(path))
        names[path] = doc.get("name") if isinstance(doc, dict) else None
    first = copies[0]
    for path, name in names.items():
        if name != names[first]:
            raise UsageError(
                f"{first} is suite {names[first]!r} but {path} is {name!r}; report one suite "
                "at a time, or name it with --suite"
            )
    return str(first)


@suite_app.command("archive")
def archive_cmd(
    folders: Annotated[
        list[Path],
        typer.Argument(
            help="Folders given to capsctl suite run --out (or other ledgers).",
            metavar="FOLDER",
            show_default=False,
        ),
    ],
    to: Annotated[
        Path,
        typer.Option(
            "--to",
            help="The ledger: LEDGER/MEMBER/seed-S records, no checkpoints.",
            rich_help_panel=OUTPUTS,
        ),
    ],
    suite: Annotated[
        str | None,
        typer.Option("--suite", help="The suite (default: the copy suite run keeps in FOLDERS)."),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="Replace records that differ from the folders' runs."),
    ] = False,
    json_out: JsonOpt = False,
) -> None:
    """Keep every finished, scored pair's small files (results, test scores, provenance,
    preset, metrics; no checkpoints) as a record in a ledger, which capsctl suite report reads
    like a run folder; a record that differs from the ledger's is refused without --overwrite."""
    import shlex

    from capsctl.suites import load_suite
    from capsctl.suites.ledger import archive_suite
    from capsctl.views.common import note, print_json, print_plain

    spec = load_suite(_suite_of(folders, suite))
    _keep_suite_copy(spec, to)
    result = archive_suite(spec, folders, to, overwrite=overwrite)
    if json_out:
        print_json(result.to_dict())
        return
    said = {"kept": "already in the ledger", "unfinished": "not finished; not archived"}
    for p in result.pairs:
        what = said.get(p["status"], p["status"])
        if p["status"] == "unscored":
            runs = Path(p["from"]).parents[1]
            what = (
                f"not scored on {', '.join(p['missing'])}; not archived (capsctl suite report "
                f"{shlex.quote(str(runs))} scores it)"
            )
        run = f"lr {p['lr']:g} (tuning)" if "lr" in p else f"seed {p['seed']}"
        print_plain(f"{p['member']} {run}: {what}\n")
    statuses = [p["status"] for p in result.pairs]
    written = statuses.count("added") + statuses.count("replaced")
    kept = statuses.count("kept")
    note(
        f"ledger {to}: written {written}, already there {kept}, not archived "
        f"{len(statuses) - written - kept}"
    )
