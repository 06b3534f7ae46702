"""``capsctl suite run``: every (member, seed) pair of a suite trained into its own run folder.

Layout: ``OUT/<member>/seed-<seed>/`` is an ordinary ``capsctl train`` run folder, plus
``tests.json`` (the finished run scored on each of the suite's test files). A pair is

- ``done``: ``results.json`` and ``tests.json`` are there: skipped;
- ``scored``: ``results.json`` is there but not every test file is scored: scored now;
- ``partial``: a ``last.safetensors`` without results: resumed (``capsctl train --resume``);
- ``busy``: another live process holds the folder's lock: left to it;
- ``waiting``: a ``matched`` member while no ``epochs`` member has finished: run last;
- ``new``: trained from the start.

A pair's folder must hold the pair's own preset: a folder trained with another recipe is an
error, never resumed or overwritten. Ctrl-C or SIGTERM stops the current run at its next step
with a resumable checkpoint (:mod:`capsctl.training.interrupt`) and ends the suite; running the
same command again continues where it stopped.

:func:`pair_commands` prints each pair as one ``capsctl train`` command line, so the pairs can
be handed to a scheduler; ``capsctl suite report`` scores what those runs lack.
"""

from __future__ import annotations

import json
import shlex
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capsctl.atomic import write_text_atomic
from capsctl.errors import CapsctlError, UsageError
from capsctl.events import EventFn, emit
from capsctl.provenance import provenance
from capsctl.suites.spec import Member, Suite

__all__ = [
    "TESTS_FILE",
    "Pair",
    "epochs_trained",
    "is_finished",
    "matched_budget",
    "missing_tests",
    "pair_commands",
    "pair_status",
    "plan_pairs",
    "read_json",
    "resolved_pair_preset",
    "run_suite",
    "score_run",
]

TESTS_FILE = "tests.json"
#: Preset fields that may differ between a pair's folder and the suite without it being another
#: run: where the data lives, the device, and a matched member's measured time limit.
_FREE_FIELDS = (("data", "data_dir"), ("data", "download"), ("train", "device"))


@dataclass(frozen=True)
class Pair:
    member: Member
    seed: int
    folder: Path

    @property
    def label(self) -> str:
        return f"{self.member.name} seed {self.seed}"


def plan_pairs(
    suite: Suite, out: Path, only: Sequence[str] = (), seeds: Sequence[int] = ()
) -> list[Pair]:
    """The suite's pairs in running order (seed by seed, so that every member has a first seed
    before any has a second; matched members last), restricted to ``only`` and ``seeds``."""
    members = [suite.member(n) for n in only] if only else list(suite.members)
    known = {s for m in members for s in suite.seeds_of(m)}
    for s in seeds:
        if s not in known:
            raise UsageError(
                f"--seeds {s}: not a seed of the chosen members; they have "
                f"{', '.join(str(k) for k in sorted(known))}"
            )
    pairs = [
        Pair(m, s, out / m.name / f"seed-{s}")
        for m in members
        for s in suite.seeds_of(m)
        if not seeds or s in seeds
    ]
    order = {m.name: i for i, m in enumerate(suite.members)}
    return sorted(
        pairs,
        key=lambda p: (
            p.member.budget == "matched",
            suite.seeds_of(p.member).index(p.seed),
            order[p.member.name],
        ),
    )


def resolved_pair_preset(suite: Suite, pair: Pair, time_limit: float | None = None) -> Any:
    """The :class:`~capsctl.config.Preset` a pair trains (with a matched member's time limit)."""
    from capsctl.config import load_preset

    overrides = suite.overrides(pair.member, pair.seed)
    if time_limit is not None:
        overrides.append(f"train.time_limit={time_limit:.0f}")
    return load_preset(suite.recipe, overrides)


def _comparable(preset_dict: dict[str, Any], matched: bool) -> dict[str, Any]:
    out = json.loads(json.dumps(preset_dict, default=str))
    for section, key in _FREE_FIELDS:
        out.get(section, {}).pop(key, None)
    if matched:
        out.get("train", {}).pop("time_limit", None)
    out.pop("description", None)
    out.pop("restored_from", None)  # a record's note on where it was restored from
    return out


def _stored_preset(folder: Path) -> dict[str, Any] | None:
    from capsctl.config.yaml_io import load_yaml

    path = folder / "preset.yaml"
    if not path.exists():
        return None
    data = load_yaml(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else None


def check_folder_is_pair(suite: Suite, pair: Pair) -> None:
    """Refuse a pair folder that holds a run of another preset (a changed suite or recipe)."""
    from capsctl.config import preset_to_dict

    stored = _stored_preset(pair.folder)
    if stored is None:
        return
    want = preset_to_dict(resolved_pair_preset(suite, pair))
    matched = pair.member.budget == "matched"
    if _comparable(stored, matched) != _comparable(want, matched):
        diff = _first_difference(_comparable(stored, matched), _comparable(want, matched))
        raise CapsctlError(
            f"{pair.folder}: holds a run of another preset than suite {suite.name}'s "
            f"{pair.label} ({diff}); move that folder away or choose another --out"
        )


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{path}.{k}" if path else k)
    return f"{path}: {a!r} in the folder, {b!r} in the suite"


def pair_status(suite: Suite, pair: Pair) -> str:
    """``done``, ``scored``, ``partial`` or ``new`` (see the module docstring)."""
    f = pair.folder
    if (f / "results.json").exists():
        return "done" if missing_tests(suite, f) == [] else "scored"
    if (f / "last.safetensors").exists():
        return "partial"
    return "new"


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file's content; ``{}`` when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def is_finished(results: dict[str, Any]) -> bool:
    """Whether a ``results.json`` content is a finished run's: it has the final test, or it is
    a record restored from a results file (``restored_from``; its final test was not kept)."""
    return bool(results.get("test")) or bool(results.get("restored_from"))


def _epoch_images(record: dict[str, Any]) -> float | None:
    """The images one epoch's record says it trained on (older records: rate x time)."""
    if isinstance(record.get("images"), (int, float)):
        return float(record["images"])
    rate, seconds = record.get("images_per_s"), record.get("epoch_seconds")
    if isinstance(rate, (int, float)) and isinstance(seconds, (int, float)):
        return float(rate) * float(seconds)
    return None


def epochs_trained(results: dict[str, Any]) -> float:
    """The epochs a run trained (its ``results.json``): its whole epochs, plus the part of the
    last one when a time limit cut it short (its images against a whole epoch's)."""
    done = float(results.get("epochs_done", 0))
    history = [h for h in results.get("history", []) if isinstance(h, dict)]
    if not history or not history[-1].get("time_limit"):
        return done
    whole = [_epoch_images(h) for h in history[:-1]]
    full = max((w for w in whole if w), default=None)
    last = _epoch_images(history[-1])
    if full is None or last is None:
        return done  # nothing to measure a whole epoch by
    return done - 1 + min(1.0, round(last / full, 6))


def missing_tests(suite: Suite, folder: Path) -> list[str]:
    """The suite's test files the run in ``folder`` is not scored on (``tests.json``)."""
    have = read_json(folder / TESTS_FILE).get("tests", {})
    return [t for t in suite.tests if t not in have]


def matched_budget(suite: Suite, out: Path) -> float | None:
    """The median wall time (s) of the finished runs of the suite's ``epochs`` members in
    ``out``; None while none has finished."""
    times = []
    for m in suite.members:
        if m.budget != "epochs":
            continue
        for s in suite.seeds_of(m):
            res = read_json(out / m.name / f"seed-{s}" / "results.json")
            if isinstance(res.get("seconds"), (int, float)) and is_finished(res):
                times.append(float(res["seconds"]))
    return statistics.median(times) if times else None


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


def _record_provenance(folder: Path, resumed: bool, record: dict[str, Any] | None = None) -> None:
    """Append this process's commit, machine and versions (``record``: as taken when its
    training started, since the checkout may move on while it trains) to the run's
    ``provenance.json``: every process that trained a run is named (a resumed run has
    several)."""
    path = folder / "provenance.json"
    doc = read_json(path) or {"trained_by": []}
    doc["trained_by"].append({**(record or provenance()), "resumed": resumed})
    write_text_atomic(path, json.dumps(doc, indent=2))


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
    """Train, resume or score every selected pair; see the module docstring."""
    from capsctl.training.ownership import FolderBusy

    pairs = plan_pairs(suite, out, only, seeds)
    for p in pairs:
        check_folder_is_pair(suite, p)
    done: list[dict[str, Any]] = []
    for index, pair in enumerate(pairs):
        status = pair_status(suite, pair)
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
        if status in ("done", "waiting"):
            done.append(record)
            continue
        if status in ("new", "partial"):
            try:
                _train_pair(
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


def _train_pair(
    suite: Suite,
    pair: Pair,
    resume: bool,
    limit: float | None,
    on_event: EventFn,
    handle_sigint: bool,
    data_dir: str | None,
) -> None:
    """Train a new pair (``limit``: a matched member's time limit) or resume a partial one,
    and record what trained it."""
    from capsctl.training import train_from_preset

    common = {"on_event": on_event, "handle_sigint": handle_sigint, "data_dir": data_dir}
    if resume:
        _record_provenance(pair.folder, True)
        train_from_preset(resume=pair.folder / "last.safetensors", **common)
        return
    overrides = suite.overrides(pair.member, pair.seed)
    if limit is not None:
        overrides.append(f"train.time_limit={limit:.0f}")
    started = provenance()  # the code that trains: the commit as it starts
    recorded = False

    def record(event: dict[str, Any] | None = None) -> None:
        """Name the starting commit once the run folder holds a checkpoint (the first one, or
        the one an interruption leaves), so a run resumed later keeps it."""
        nonlocal recorded
        if event is not None and on_event is not None:
            on_event(event)
        due = event is None or event.get("event") == "checkpoint"
        if due and not recorded and (pair.folder / "last.safetensors").exists():
            _record_provenance(pair.folder, False, started)
            recorded = True

    try:
        train_from_preset(
            suite.recipe, out=pair.folder, overrides=overrides, **common | {"on_event": record}
        )
    finally:
        record()


def pair_commands(
    suite: Suite, out: Path, only: Sequence[str] = (), seeds: Sequence[int] = ()
) -> list[str]:
    """One ``capsctl train`` command line per pair (shell-quoted); a matched member whose
    budget is not known yet gets a ``#`` comment line instead."""
    lines = []
    recipe = suite.recipe
    limit = matched_budget(suite, out)
    for pair in plan_pairs(suite, out, only, seeds):
        overrides = suite.overrides(pair.member, pair.seed)
        if pair.member.budget == "matched":
            if limit is None:
                lines.append(
                    f"# {pair.label}: its time limit is the median wall time of the other "
                    "members' finished runs; print the commands again once they have finished"
                )
                continue
            overrides.append(f"train.time_limit={limit:.0f}")
        words = ["capsctl", "train", "--preset", recipe]
        for o in overrides:
            words += ["--set", o]
        words += ["--out", str(pair.folder)]
        lines.append(shlex.join(words))
    return lines
