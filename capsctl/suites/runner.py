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
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capsctl.atomic import write_text_atomic
from capsctl.errors import CapsctlError, UsageError
from capsctl.events import EventFn, emit
from capsctl.provenance import provenance
from capsctl.suites.run_files import (
    TESTS_FILE,
    check_run_files,
    epochs_trained,
    is_finished,
    read_json,
)
from capsctl.suites.spec import Member, Suite, lr_text

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

#: Preset fields that may differ between a pair's folder and the suite without it being another
#: run: where the data lives, the device, and a matched member's measured time limit.
_FREE_FIELDS = (("data", "data_dir"), ("data", "download"), ("train", "device"))


@dataclass(frozen=True)
class Pair:
    """One run of a suite: a member's seed (``lr``: its chosen learning rate where it is not
    the suite file's), or with ``tuning``, a tuning run of the member at learning rate ``lr``
    (:mod:`capsctl.suites.tuning`)."""

    member: Member
    seed: int
    folder: Path
    lr: float | None = None
    tuning: bool = False

    @property
    def label(self) -> str:
        if self.tuning and self.lr is not None:
            return f"{self.member.name} lr {lr_text(self.lr)} (tuning)"
        return f"{self.member.name} seed {self.seed}"

    @property
    def relpath(self) -> Path:
        """The pair's folder inside a suite folder or ledger."""
        if self.tuning and self.lr is not None:
            return tune_relpath(self.member.name, self.lr)
        return Path(self.member.name, f"seed-{self.seed}")


def tune_relpath(member: str, lr: float) -> Path:
    """A tuning run's folder inside a suite folder or ledger: ``tune/<member>/lr-<lr>``."""
    return Path("tune", member, f"lr-{lr_text(lr)}")


def plan_pairs(
    suite: Suite,
    out: Path,
    only: Sequence[str] = (),
    seeds: Sequence[int] = (),
    lrs: Mapping[str, float] | None = None,
) -> list[Pair]:
    """The suite's pairs in running order (seed by seed, so that every member has a first seed
    before any has a second; matched members last), restricted to ``only`` and ``seeds``;
    ``lrs``: learning rates chosen by tuning runs, by member (for members whose choice the
    suite file does not record yet)."""
    members = [suite.member(n) for n in only] if only else list(suite.members)
    known = {s for m in members for s in suite.seeds_of(m)}
    for s in seeds:
        if s not in known:
            raise UsageError(
                f"--seeds {s}: not a seed of the chosen members; they have "
                f"{', '.join(str(k) for k in sorted(known))}"
            )
    chosen = lrs or {}
    pairs = [
        Pair(m, s, out / m.name / f"seed-{s}", chosen.get(m.name))
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
    """The :class:`~capsctl.config.Preset` a pair trains (with a matched member's time limit);
    an error names the member."""
    from capsctl.config import load_preset

    overrides = pair_overrides(suite, pair)
    if time_limit is not None:
        overrides.append(f"train.time_limit={time_limit:.0f}")
    try:
        return load_preset(suite.recipe, overrides)
    except CapsctlError as e:
        raise _of_member(e, suite, pair.member) from None


def pair_overrides(suite: Suite, pair: Pair) -> list[str]:
    """The ``--set`` overrides of ``pair`` (a tuning run's, or a seed's)."""
    if pair.tuning and pair.lr is not None:
        return suite.tune_overrides(pair.member, pair.lr)
    return suite.overrides(pair.member, pair.seed, pair.lr)


def _of_member(error: CapsctlError, suite: Suite, member: Member) -> CapsctlError:
    """``error`` as one line that names the suite's member it is about."""
    message = f"suite {suite.name}, member {member.name}: {error}"
    if isinstance(error, UsageError):
        return type(error)(message)
    return CapsctlError(message, exit_code=error.exit_code)


def check_suite(suite: Suite, pairs: Sequence[Pair]) -> None:
    """Refuse, before the first run starts, what would stop the suite at a pair's turn, maybe
    hours in: a member whose preset does not resolve (its ``set:`` against the schema, its
    model registered and built, without weights, on the meta device), a pair folder of another
    preset or a damaged run file. Errors name the member or the file."""
    import torch

    from capsctl.models import build_model_from_config

    built: set[str] = set()
    for pair in pairs:
        preset = resolved_pair_preset(suite, pair)
        if pair.member.name not in built:
            try:
                with torch.device("meta"):  # the layers' shapes: no memory, no time
                    build_model_from_config(preset.model)
            except CapsctlError as e:
                raise _of_member(e, suite, pair.member) from None
            built.add(pair.member.name)
        if not awaiting_tuning(suite, pair):  # its preset is not known before its tuning
            check_folder_is_pair(suite, pair)
        check_run_files(pair.folder)


def awaiting_tuning(suite: Suite, pair: Pair) -> bool:
    """Whether ``pair`` is a run of a member whose learning rate is still to be chosen (the
    suite tunes it, its file records no choice, and no tuning run has made one)."""
    return (
        not pair.tuning
        and pair.lr is None
        and suite.tunes(pair.member)
        and pair.member.tuned is None
    )


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
    """The folder's preset with the defaults of fields added since it was written filled in
    (so that a new field does not make every earlier run another preset)."""
    from capsctl.config import preset_from_dict, preset_to_dict
    from capsctl.config.yaml_io import read_preset_file

    path = folder / "preset.yaml"
    if not path.exists():
        return None
    raw = read_preset_file(path)  # a damaged one is a one-line error naming it
    try:
        return preset_to_dict(preset_from_dict(raw))
    except CapsctlError:
        return raw  # not a valid preset today: compared as written, and so refused


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
        for k in sorted(set(a) | set(b), key=str):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))
    return f"{path}: {_short(a)} in the folder, {_short(b)} in the suite"


def _short(value: Any) -> str:
    """``value``'s repr cut to 40 characters (an error message stays one short line)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def pair_status(suite: Suite, pair: Pair) -> str:
    """``done``, ``scored``, ``partial`` or ``new`` (see the module docstring)."""
    f = pair.folder
    if (f / "results.json").exists():
        return "done" if missing_tests(suite, f) == [] else "scored"
    if (f / "last.safetensors").exists():
        return "partial"
    return "new"


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


def _record_provenance(folder: Path, resumed: bool, record: dict[str, Any]) -> None:
    """Append this process's commit, machine and versions (``record``: as taken when its
    training started, since the checkout may move on while it trains) to the run's
    ``provenance.json``: every process that trained a run is named (a resumed run has
    several). A damaged file is refused (:func:`read_json`), never replaced."""
    path = folder / "provenance.json"
    doc = read_json(path)
    doc.setdefault("trained_by", []).append({**record, "resumed": resumed})
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
    and record what trained it, once this process holds the pair's folder: a pair another
    process holds (busy) gets no record from this one."""
    from capsctl.training import train_from_preset

    started = provenance()  # the code that trains: the commit as it starts
    state = {"owned": False, "recorded": False}

    def record(event: dict[str, Any] | None = None) -> None:
        """Name the starting commit once this process holds the folder and the folder holds a
        checkpoint: a resumed run at its ``resume`` event, a new one at its first checkpoint
        (or the one an interruption leaves), so a run resumed later keeps it."""
        kind = None if event is None else event.get("event")
        if event is not None:
            state["owned"] = True  # training emits nothing before it holds the folder's lock
            if on_event is not None:
                on_event(event)
        due = kind == "resume" if resume else kind in (None, "checkpoint")
        due = due and state["owned"] and not state["recorded"]
        if due and (pair.folder / "last.safetensors").exists():
            _record_provenance(pair.folder, resume, started)
            state["recorded"] = True

    common = {"on_event": record, "handle_sigint": handle_sigint, "data_dir": data_dir}
    try:
        if resume:
            train_from_preset(resume=pair.folder / "last.safetensors", **common)
            return
        overrides = pair_overrides(suite, pair)
        if limit is not None:
            overrides.append(f"train.time_limit={limit:.0f}")
        train_from_preset(suite.recipe, out=pair.folder, overrides=overrides, **common)
    finally:
        record()
