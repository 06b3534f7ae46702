"""``capsctl suite run``: every (member, seed) pair of a suite trained into its own run folder.

Layout: ``OUT/<member>/seed-<seed>/`` is an ordinary ``capsctl train`` run folder, plus
``tests.json`` (the finished run scored on each of the suite's test files). A pair is

- ``done``: ``results.json`` and ``tests.json`` are there: skipped;
- ``scored``: ``results.json`` is there but not every test file is scored: scored now;
- ``partial``: a ``last.safetensors`` without results: resumed (``capsctl train --resume``);
- ``busy``: another live process holds the folder's lock: left to it;
- ``waiting``: a ``matched`` member while no ``epochs`` member has finished: run last;
- ``untuned``: a member whose learning rate is still to be chosen (its tuning runs are held
  by another process): left for later;
- ``new``: trained from the start.

A pair's folder must hold the pair's own preset: a folder trained with another recipe is an
error, never resumed or overwritten. Before the first run, every chosen pair is checked
(:func:`check_suite`): its member's preset and model, its folder's preset and run files (a
damaged one is an error naming it, :mod:`capsctl.suites.run_files`). Ctrl-C or SIGTERM stops
the current run at its next step with a resumable checkpoint (:mod:`capsctl.training.interrupt`)
and ends the suite; running the same command again continues where it stopped.

The pairs as ``capsctl train`` command lines, for a scheduler, are
:func:`capsctl.suites.commands.pair_commands`'s; ``capsctl suite report`` scores what those runs
lack.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capsctl.atomic import write_text_atomic
from capsctl.events import EventFn, emit
from capsctl.suites.pair_run import train_pair
from capsctl.suites.pairs import (
    Pair,
    awaiting_tuning,
    check_suite,
    matched_budget,
    missing_tests,
    pair_status,
    plan_pairs,
    resolved_pair_preset,
)
from capsctl.suites.run_files import (
    TESTS_FILE,
    epochs_trained,
    is_finished,
    read_json,
)
from capsctl.suites.spec import Suite

__all__ = [
    "TESTS_FILE",
    "Pair",
    "check_suite",
    "epochs_trained",
    "is_finished",
    "matched_budget",
    "missing_tests",
    "pair_status",
    "plan_pairs",
    "read_json",
    "resolved_pair_preset",
    "run_suite",
    "score_run",
]


def score_run(
    suite: Suite, folder: Path, *, data_dir: str | None = None, on_event: EventFn = None
) -> dict[str, Any]:
    """Score a finished run's final weights on each of the suite's test files it lacks and
    store them in ``tests.json`` (atomically); returns the file's content."""
    from capsctl.evaluation import evaluate_checkpoint

    path = folder / TESTS_FILE
    doc = read_json(path) or {"tests": {}}
    for test in missing_tests(suite, folder):
        emit(on_event, "suite_score", folder=str(folder), test=test)
        result, _ = evaluate_checkpoint(
            folder / "best.safetensors", data_dir=data_dir, test_file=test, device="auto"
        )
        keep = ("accuracy", "count", "loss", "loss_name", "metric", "top5", "flip", "dataset")
        doc["tests"][test] = {k: v for k, v in result.to_dict().items() if k in keep}
        write_text_atomic(path, json.dumps(doc, indent=2))
    return doc


@dataclass
class SuiteRunResult:
    pairs: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return {"pairs": self.pairs}


def run_suite(
    suite: Suite,
    out: Path,
    *,
    only: Sequence[str] = (),
    seeds: Sequence[int] = (),
    data_dir: str | None = None,
    on_event: EventFn = None,
    handle_sigint: bool = True,
) -> SuiteRunResult:
    """Tune the members whose learning rate is still to be chosen
    (:mod:`capsctl.suites.tuning`), then train, resume or score every selected pair; see the
    module docstring."""
    from capsctl.suites.tuning import chosen_lrs, tune_suite
    from capsctl.training.ownership import FolderBusy

    check_suite(suite, plan_pairs(suite, out, only, seeds, chosen_lrs(suite, [out])))
    untuned = [
        m.name
        for m in ([suite.member(n) for n in only] if only else suite.members)
        if suite.tunes(m) and m.tuned is None
    ]
    if untuned:
        tune_suite(
            suite,
            out,
            only=untuned,
            data_dir=data_dir,
            on_event=on_event,
            handle_sigint=handle_sigint,
        )
    pairs = plan_pairs(suite, out, only, seeds, chosen_lrs(suite, [out]))
    check_suite(suite, pairs)
    done: list[dict[str, Any]] = []
    for index, pair in enumerate(pairs):
        status = pair_status(suite, pair)
        if awaiting_tuning(suite, pair):
            status = "untuned"
        limit = None
        if pair.member.budget == "matched" and status in ("new",):
            limit = matched_budget(suite, out)
            if limit is None:
                status = "waiting"
        emit(
            on_event,
            "suite_pair",
            member=pair.member.name,
            seed=pair.seed,
            status=status,
            step=index + 1,
            steps=len(pairs),
            folder=str(pair.folder),
        )
        record = {"member": pair.member.name, "seed": pair.seed, "status": status}
        if status in ("done", "waiting", "untuned"):
            done.append(record)
            continue
        if status in ("new", "partial"):
            try:
                train_pair(
                    suite, pair, status == "partial", limit, on_event, handle_sigint, data_dir
                )
            except FolderBusy:
                record["status"] = "busy"
                done.append(record)
                emit(on_event, "suite_pair_busy", member=pair.member.name, seed=pair.seed)
                continue
        score_run(suite, pair.folder, data_dir=data_dir, on_event=on_event)
        record["status"] = "done"
        done.append(record)
    return SuiteRunResult(done)
