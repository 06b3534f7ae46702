"""The comparison tables of README.md and docs/, generated from capsctl/results/*.csv.

``python scripts/results_table.py`` prints every suite's table; ``--write`` replaces the text
between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->`` with the table of
``capsctl/results/NAME.csv`` (every other line is left as it is) in README.md and every
``docs/*.md``, or in the files named after it; ``--check`` exits 1 when a file's tables differ
from the results files (CI runs it through the tests). The README holds the headline table,
docs/RESULTS.md every comparison table, docs/ROBUSTNESS.md the expanded-MNIST one.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from capsctl.atomic import write_text_atomic  # noqa: E402
from capsctl.suites import list_suites, load_suite  # noqa: E402
from capsctl.suites.claims import judge_summary, paragraph  # noqa: E402
from capsctl.suites.results_file import read_results  # noqa: E402
from capsctl.views.common import fmt_duration  # noqa: E402

RESULTS = ROOT / "capsctl" / "results"
_BLOCK = re.compile(
    r"(<!-- results:(?P<name>[\w.-]+) -->\n)(.*?)(<!-- /results:(?P=name) -->)", re.S
)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.2f}"


def _cell(row: dict) -> str:
    if row["top1_mean"] is None:
        return "-"
    std = "" if row["top1_std"] is None else f" ± {_pct(row['top1_std'])}"
    se = "" if row["top1_se"] is None else f" (se {_pct(row['top1_se'])})"
    return f"{_pct(row['top1_mean'])}{std}{se}"


def table(path: Path) -> str:
    """A markdown table of one results file: a row per member, a column per test set."""
    rows = read_results(path)
    tests: list[str] = []
    members: dict[str, dict[str, dict]] = defaultdict(dict)
    metrics: dict[str, str] = {}  # test set -> what its accuracy is
    for r in rows:
        if r.get("metric"):
            metrics.setdefault(r["test_set"], r["metric"])
        if r["test_set"] not in tests:
            tests.append(r["test_set"])
        members[r["member"]][r["test_set"]] = r
    head = [
        "member",
        "model",
        *[f"{metrics.get(t) or 'top-1'} % {t} (mean ± std)" for t in tests],
        "seeds",
        "epochs",
        "wall s",
        "train img/s",
        "params",
        "GFLOPs",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for member, by_test in members.items():
        first = by_test[tests[0]] if tests[0] in by_test else next(iter(by_test.values()))
        matched = first.get("budget") == "matched"
        cells = [
            f"{member} †" if matched else member,
            first["model"],
            *[_cell(by_test[t]) if t in by_test else "-" for t in tests],
        ]
        cells += [
            str(first["seeds_run"] or 0),
            "-" if first["epochs"] is None else f"{first['epochs']:.1f}",
            "-" if first["wall_s"] is None else f"{first['wall_s']:.0f}",
            "-" if first["train_images_per_s"] is None else f"{first['train_images_per_s']:.0f}",
            f"{first['params']:,}" if first["params"] else "-",
            "-" if first["gflops"] is None else f"{first['gflops']:.3f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if any(r.get("budget") == "matched" for r in rows):
        lines += [
            "",
            "† stopped at the other members' median wall time (its epochs column says how far it "
            "got), not after the same epochs.",
        ]
    lines += _claims(rows, members, tests[0])
    done = [r for r in rows if r["seeds_run"]]
    machines = _machines(done)
    commits: dict[str, list[str]] = defaultdict(list)
    for r in done:
        for c in str(r["commit"] or "not recorded").split(" + "):
            if r["member"] not in commits[c[:9]]:
                commits[c[:9]].append(r["member"])
    if machines:
        named = len(machines) > 1  # name the members that ran on each machine
        where = "; ".join(
            f"{cpu} ({cores} cores, torch {torch}" + (f": {', '.join(members)})" if named else ")")
            for (cpu, cores, torch), members in machines.items()
        )
        which = ", ".join(f"{c} ({', '.join(m)})" for c, m in commits.items())
        firsts = {r["member"]: r for r in reversed(done)}.values()  # one row per member
        spent = sum((r["wall_s"] or 0.0) * r["seeds_run"] for r in firsts)
        runs = sum(r["seeds_run"] for r in firsts)
        lines += [
            "",
            f"Trained on {where}, {fmt_duration(spent)} of machine time over {runs} runs (the sum "
            f"of their wall times); capsctl commits {which}; `capsctl/results/{path.name}`.",
            "",
            _shared(list(firsts)),
        ]
    return "\n".join(lines) + "\n"


def _machines(rows: list[dict]) -> dict[tuple[str, str, str], list[str]]:
    """Each machine ``(cpu, cores, torch)`` the rows' runs trained on, with the members that
    used it; a row's ``cpu`` names its seeds' machines joined by `` + ``."""
    out: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for r in rows:
        for cpu in str(r["cpu"]).split(" + "):
            key = (cpu, str(r["cores"]), str(r["torch"]))
            if r["member"] not in out[key]:
                out[key].append(r["member"])
    return dict(sorted(out.items()))


def _shared(rows: list[dict]) -> str:
    """Which members' runs shared the machine (``shared_runs``), or that none recorded it."""
    known = [r for r in rows if r.get("shared_runs") is not None]
    if not known:
        return "No run recorded the machine's load, so whether one shared the machine is unknown."
    shared = [
        f"{r['member']} {r['shared_runs']} of {r['seeds_run']}" for r in known if r["shared_runs"]
    ]
    unknown = [r["member"] for r in rows if r.get("shared_runs") is None]
    text = (
        "Runs that shared the machine (a load average at least 1 above the CPUs as an epoch "
        f"ended; their seconds are upper bounds): {', '.join(shared) or 'none'}"
    )
    return text + (f"; load not recorded: {', '.join(unknown)}." if unknown else ".")


def _claims(rows: list[dict], members: dict[str, dict[str, dict]], test: str) -> list[str]:
    """The suite's claims on ``test``, as ``capsctl suite report`` judges them (Welch's 95%
    interval over seeds, from each member's mean, standard deviation and seeds)."""
    if not rows or rows[0]["suite"] not in {name for name, _ in list_suites()}:
        return []  # a results file of a suite capsctl does not bundle: no claims to judge
    suite = load_suite(rows[0]["suite"])
    if not suite.claims:
        return []
    diffs = []
    for claim in suite.claims:
        a, b = (members.get(m, {}).get(claim.test or test) for m in (claim.a, claim.b))
        if a is None or b is None or a["top1_mean"] is None or b["top1_mean"] is None:
            continue
        summary = [(r["top1_mean"], r["top1_std"] or 0.0, r["seeds_run"] or 0) for r in (a, b)]
        diffs.append(judge_summary(claim, claim.test or test, *summary))
    return ["", "The claims (`capsctl suite report`), on the first test set:", "", paragraph(diffs)]


def render(text: str) -> str:
    """``text`` with every results block replaced by its table."""

    def one(m: re.Match[str]) -> str:
        path = RESULTS / f"{m.group('name')}.csv"
        body = table(path) if path.is_file() else "(no results file yet)\n"
        return m.group(1) + body + m.group(4)

    return _BLOCK.sub(one, text)


def documents(root: Path) -> list[Path]:
    """The files that hold generated blocks: README.md and every page of docs/."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def readme_main(
    argv: list[str] | None,
    *,
    doc: str,
    what: str,
    source: str,
    script: str,
    render: Callable[[str], str],
    print_all: Callable[[], None],
    root: Path,
    pictures: Callable[[Path, bool], list[Path]] | None = None,
) -> int:
    """The command line of a script (``scripts/<script>``) that generates the ``what`` blocks
    of the documents from ``source``: ``--write [FILE...]`` replaces them (atomically, only
    when they change), ``--check [FILE...]`` exits 1 with one line on stderr per file whose
    blocks differ, and no option prints every table (``print_all``). Without files, both take
    the documents under ``root`` (:func:`documents`). With ``pictures``, ``--png DIR
    [--overwrite]`` draws them into DIR instead (``pictures(DIR, overwrite)`` returns the files
    written)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    group = ap.add_mutually_exclusive_group()
    where = "default: README.md and docs/*.md"
    group.add_argument(
        "--write", type=Path, nargs="*", metavar="FILE", help=f"replace the {what} blocks ({where})"
    )
    group.add_argument(
        "--check", type=Path, nargs="*", metavar="FILE", help=f"exit 1 when stale ({where})"
    )
    if pictures is not None:
        group.add_argument("--png", type=Path, help="draw the pictures into this folder")
        ap.add_argument("--overwrite", action="store_true", help="replace pictures that exist")
    args = ap.parse_args(argv)
    if pictures is not None and args.png is not None:
        for written in pictures(args.png, args.overwrite):
            print(written)
        return 0
    paths = args.write if args.write is not None else args.check
    if paths is None:
        print_all()
        return 0
    stale = 0
    for path in paths or documents(root):
        text = path.read_text(encoding="utf-8")
        new = render(text)
        if new == text:
            continue
        if args.check is not None:
            print(
                f"{path}: {what} tables differ from {source}; run python scripts/{script} "
                f"--write {path}",
                file=sys.stderr,
            )
            stale = 1
            continue
        write_text_atomic(path, new)
    return stale


def main(argv: list[str] | None = None) -> int:
    def print_all() -> None:
        for f in sorted(RESULTS.glob("*.csv")):
            print(f"## {f.stem}\n\n{table(f)}")

    return readme_main(
        argv,
        doc=__doc__ or "",
        what="results",
        source="capsctl/results/",
        script="results_table.py",
        render=render,
        print_all=print_all,
        root=ROOT,
    )


if __name__ == "__main__":
    sys.exit(main())
