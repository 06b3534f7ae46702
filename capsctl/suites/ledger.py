"""Suite ledgers: the small files of finished (member, seed) runs kept as records, so that a
suite trained in pieces (on machines whose run folders do not survive, or into several output
folders) is reported as one.

A ledger has a suite run folder's layout without the checkpoints: ``LEDGER/suite.yaml`` and
``LEDGER/<member>/seed-<seed>/`` holding those of :data:`RECORD_FILES` the run has.
``capsctl suite report`` reads ledgers and run folders alike, several at once: a pair finished in
more than one of them counts once, and is an error when its results differ
(:func:`pick_pair_folder`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from capsctl.errors import CapsctlError
from capsctl.suites.runner import TESTS_FILE, is_finished, missing_tests, read_json
from capsctl.suites.spec import Member, Suite

__all__ = [
    "RECORD_FILES",
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
    why = "scoring is off" if has_weights else "it has no checkpoint to score them with"
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
