"""Suite ledgers: the small files of finished (member, seed) runs kept as records, so that a
suite trained in pieces (on machines whose run folders do not survive, or into several output
folders) is reported as one.

A ledger has a suite run folder's layout without the checkpoints: ``LEDGER/suite.yaml``,
``LEDGER/<member>/seed-<seed>/`` and the tuning runs' ``LEDGER/tune/<member>/lr-<lr>/``
(validation scores only), each holding those of :data:`RECORD_FILES` the run has.
:func:`archive_suite` (``capsctl suite archive DIR --to LEDGER``) adds the finished, scored
pairs of run folders. ``capsctl suite report`` reads ledgers and run folders alike, several at
once: a pair finished in more than one of them counts once, and is an error when its results
differ (:func:`pick_pair_folder`).

A record is written whole: its files go into a hidden folder next to it, which is renamed into
place (a replaced record is renamed aside first and removed after), so a reader sees the old
record or the new one. A record that differs from the ledger's is refused unless ``overwrite``.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capsctl.atomic import fsync_dir, write_atomic
from capsctl.errors import CapsctlError
from capsctl.suites.pairs import Pair, check_folder_is_pair, missing_tests, plan_pairs
from capsctl.suites.run_files import TESTS_FILE, check_run_files, is_finished, read_json
from capsctl.suites.spec import Member, Suite
from capsctl.suites.tuning import chosen_lrs, tune_finished, tune_pairs

__all__ = [
    "RECORD_FILES",
    "ArchiveResult",
    "archive_suite",
    "pick_pair_folder",
    "robustness_or_note",
    "run_difference",
    "score_or_note",
]

#: A record's files: everything ``capsctl suite report`` reads, the preset ``capsctl suite run``
#: checks, and the per-epoch metrics; never the checkpoints or the curves' PNG.
RECORD_FILES = (
    "results.json",
    TESTS_FILE,
    "provenance.json",
    "preset.yaml",
    "metrics.jsonl",
    "robustness.json",
)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def run_difference(a: Path, b: Path) -> str | None:
    """How the finished runs in folders ``a`` and ``b`` differ (a test file both are scored on,
    or ``results.json`` apart from the folder it names), or None when they are one run."""
    tests_a = read_json(a / TESTS_FILE).get("tests") or {}
    tests_b = read_json(b / TESTS_FILE).get("tests") or {}
    for test in sorted(set(tests_a) & set(tests_b)):
        x, y = tests_a[test], tests_b[test]
        if x != y:
            if (
                isinstance(x, dict)
                and isinstance(y, dict)
                and x.get("accuracy") != y.get("accuracy")
            ):
                return f"{test} accuracy {x.get('accuracy')} vs {y.get('accuracy')}"
            return f"{test} scores differ"
    res_a, res_b = read_json(a / "results.json"), read_json(b / "results.json")
    for key in sorted((set(res_a) | set(res_b)) - {"out_dir"}):
        if res_a.get(key) != res_b.get(key):
            return f"results.json {key}: {_short(res_a.get(key))} vs {_short(res_b.get(key))}"
    return None


def pick_pair_folder(suite: Suite, member: Member, seed: int, roots: Sequence[Path]) -> Path | None:
    """The folder of the (member, seed) pair's finished run among ``roots`` (run folders or
    ledgers): the one scored on most of the suite's test files, then one with a checkpoint,
    then the first given; None when no root holds it finished. CapsctlError (one line, naming
    both folders) when two roots hold it with different results."""
    found = [root / member.name / f"seed-{seed}" for root in roots]
    found = [f for f in found if is_finished(read_json(f / "results.json"))]
    if not found:
        return None
    for i, first in enumerate(found):
        for other in found[i + 1 :]:
            diff = run_difference(first, other)
            if diff is not None:
                raise CapsctlError(
                    f"{member.name} seed {seed}: finished with different results in {first} "
                    f"and in {other} ({diff}); report only the folder whose run counts"
                )
    return min(
        found,
        key=lambda f: (len(missing_tests(suite, f)), not (f / "best.safetensors").exists()),
    )


def score_or_note(
    suite: Suite,
    folder: Path,
    label: str,
    score: bool,
    notes: list[str],
    **kw: Any,
) -> None:
    """Score the test files the finished run in ``folder`` lacks; one that is not scored on
    every test file (scoring off, or no checkpoint: a ledger's record) gets a note."""
    from capsctl.suites.runner import score_run

    lacking = missing_tests(suite, folder)
    if not lacking:
        return
    has_weights = (folder / "best.safetensors").exists()
    if score and has_weights:
        score_run(suite, folder, **kw)
        return
    why = "scoring is off" if has_weights else "no checkpoint to score with"
    notes.append(
        f"{label}: not scored on {', '.join(lacking)} ({why}); left out of "
        f"{'that test file' if len(lacking) == 1 else 'those test files'}"
    )


def robustness_or_note(
    folder: Path, label: str, settings: Any, notes: list[str], data_dir: Any, on_event: Any
) -> dict[str, Any]:
    """The run's robustness summary: cached, else measured (a run without a checkpoint and
    without a cached summary of these settings gets a note and an empty summary)."""
    from capsctl.suites.robust import cached_robustness, run_robustness

    if cached_robustness(folder, settings) is None and not (folder / "best.safetensors").exists():
        notes.append(
            f"{label}: no robustness measured with these settings and no checkpoint to "
            "measure it with; left out of the robustness columns"
        )
        return {}
    return run_robustness(folder, settings, data_dir=data_dir, on_event=on_event)


@dataclass
class ArchiveResult:
    """Per pair of the archived folders: ``added``, ``replaced``, ``kept`` (the ledger already
    holds that record), ``unscored`` (finished, not scored on every test file: not archived)
    or ``unfinished`` (not archived)."""

    ledger: str
    pairs: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return {"ledger": self.ledger, "pairs": self.pairs}


def _record(folder: Path) -> dict[str, bytes]:
    """The record files ``folder`` holds, by name."""
    return {n: (folder / n).read_bytes() for n in RECORD_FILES if (folder / n).is_file()}


def _ready(suite: Suite, pair: Pair) -> dict[str, Any] | None:
    """Why the pair's folder is not archived (``unscored``, ``unfinished``), ``{}`` when it is
    ready, None when it has no folder."""
    if not pair.folder.is_dir():
        return None
    check_run_files(pair.folder)  # a damaged file is refused, never archived or left out
    results = read_json(pair.folder / "results.json")
    if pair.tuning:  # judged on validation, never tested
        return {} if tune_finished(results) else {"status": "unfinished"}
    if not is_finished(results):
        return {"status": "unfinished"}
    lacking = missing_tests(suite, pair.folder)
    return {"status": "unscored", "missing": lacking} if lacking else {}


def _refuse(target: Path, old: dict[str, bytes], new: dict[str, bytes], pair: Pair) -> str:
    """The one line refusing to replace the record ``old`` in ``target`` by ``new``."""
    diff = run_difference(target, pair.folder)
    if diff is None:
        names = sorted(n for n in set(old) | set(new) if old.get(n) != new.get(n))
        diff = f"{names[0]} differs"
    return (
        f"{target}: holds another record of {pair.label} than {pair.folder} ({diff}); pass "
        "--overwrite to replace it"
    )


def archive_suite(
    suite: Suite, sources: Sequence[Path], ledger: Path, *, overwrite: bool = False
) -> ArchiveResult:
    """Keep the finished, scored pairs of ``sources`` (run folders of ``capsctl suite run``, or
    ledgers) as records in ``ledger``. Nothing is written when a record would replace a
    differing one without ``overwrite``, a pair differs between two sources, or a target holds
    more than a record (CapsctlError, one line)."""
    plan: dict[Path, tuple[Pair, dict[str, bytes]]] = {}
    pairs = []
    for source in sources:
        root = Path(source)
        found = [*plan_pairs(suite, root, lrs=chosen_lrs(suite, [root])), *tune_pairs(suite, root)]
        for pair in found:
            entry = {"member": pair.member.name, "seed": pair.seed, "from": str(pair.folder)}
            if pair.tuning:
                entry["lr"] = pair.lr
            why = _ready(suite, pair)
            if why is None:
                continue
            pairs.append({**entry, **why})
            if why:
                continue
            check_folder_is_pair(suite, pair)
            target = ledger / pair.relpath
            files, old = _record(pair.folder), _record(target)
            pairs[-1]["to"] = str(target)
            if target in plan:
                first = plan[target][0].folder
                if plan[target][1] != files:
                    diff = run_difference(first, pair.folder) or "their record files differ"
                    raise CapsctlError(
                        f"{pair.label}: finished in {first} and in {pair.folder} with different "
                        f"results ({diff}); archive one of the two"
                    )
                pairs[-1]["status"] = "kept"
            elif old == files:
                pairs[-1]["status"] = "kept"
            elif old and not overwrite:
                raise CapsctlError(_refuse(target, old, files, pair))
            else:
                _check_target(target)
                plan[target] = (pair, files)
                pairs[-1]["status"] = "replaced" if old else "added"
    for target, (_, files) in plan.items():
        _write_record(target, files)
    return ArchiveResult(str(ledger), pairs)


def _check_target(target: Path) -> None:
    """Refuse to replace a folder holding more than a record (a run folder's checkpoints)."""
    if not target.is_dir():
        return
    extra = sorted(p.name for p in target.iterdir() if p.name not in RECORD_FILES)
    if extra:
        raise CapsctlError(
            f"{target}: holds {', '.join(extra[:3])}, which no record has; archive into a "
            "ledger of its own, not into a run folder"
        )


def _write_record(target: Path, files: dict[str, bytes]) -> None:
    """Write a record whole: staged next to ``target``, then renamed into place."""
    tag = f"{os.getpid()}.{secrets.token_hex(4)}"
    stage = target.with_name(f".{target.name}.{tag}.new")
    aside = target.with_name(f".{target.name}.{tag}.old")
    try:
        stage.mkdir(parents=True)
        for name, data in files.items():
            write_atomic(stage / name, data)
        fsync_dir(stage)
        if target.exists():
            os.rename(target, aside)
        os.rename(stage, target)
        fsync_dir(target.parent)
    except (OSError, CapsctlError) as e:
        shutil.rmtree(stage, ignore_errors=True)
        if aside.exists() and not target.exists():
            os.rename(aside, target)
        if isinstance(e, CapsctlError):
            raise
        raise CapsctlError(
            f"cannot write {target}: {e.strerror or e}; check that the folder is writable and "
            "that no other archive writes that record now"
        ) from None
    shutil.rmtree(aside, ignore_errors=True)
