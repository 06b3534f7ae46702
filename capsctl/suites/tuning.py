"""``capsctl suite tune``: each member's learning rate chosen on a validation split.

For a suite with a ``tune:`` block (:class:`~capsctl.suites.spec.Tune`), each tuned member
trains one run per learning rate of its grid into ``OUT/tune/<member>/lr-<lr>/``: the suite's
recipe and the member's changes, ``tune.epochs`` epochs, seed ``tune.seed``, ``tune.val_size``
training images held out (the same images for every learning rate: the split is drawn from
the seed) and no final test, so the test set is never touched while choosing. The run's score
is its validation accuracy after its last epoch, the weights a final run keeps.

A run whose loss becomes non-finite ends there; its folder's ``results.json`` then records
``diverged`` (epoch and step) and no score, and the grid point counts as tried and worse than
any score. The choice is the grid point with the best score (a tie goes to the smaller rate).
While it lies
on an edge of the grid, the grid grows past that edge by ``tune.step`` and the new point is
trained, at most ``tune.extend`` times; a choice still on an edge after that is reported as
such. Tuning runs are ordinary run folders: an interrupted one resumes, a finished one is
skipped, so the same command continues.

The choice is written into the suite file by hand (``tuned: {lr, grid}`` under the member, as
``capsctl suite tune`` prints it); ``capsctl suite run`` tunes a member whose choice the file
does not record before its runs, from the same folders.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capsctl.errors import CapsctlError, DivergedError, UsageError
from capsctl.events import EventFn, emit
from capsctl.suites.pairs import Pair, check_folder_is_pair, tune_relpath
from capsctl.suites.run_files import read_json
from capsctl.suites.spec import Member, Suite, lr_text

__all__ = [
    "MemberTuning",
    "TuneResult",
    "TuneRun",
    "chosen_lrs",
    "diverged",
    "member_tuning",
    "own_lr",
    "tune_finished",
    "tune_pairs",
    "tune_suite",
    "tuned_members",
]


@dataclass
class TuneRun:
    """One grid point: its learning rate, folder, whether it finished, and its score."""

    lr: float
    folder: str
    finished: bool
    val_accuracy: float | None = None
    epochs: int | None = None
    seconds: float | None = None
    diverged: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "lr": self.lr,
            "folder": self.folder,
            "finished": self.finished,
            "diverged": self.diverged,
            "val_accuracy": self.val_accuracy,
            "epochs": self.epochs,
            "seconds": self.seconds,
        }


@dataclass
class MemberTuning:
    """Where one member's tuning stands: its grid's runs, the learning rates still to train
    (``todo``), and the choice once none is left (``on_edge``: the best still lies on an edge
    of the grid after every extension)."""

    member: str
    own_lr: float
    runs: list[TuneRun] = field(default_factory=list)
    todo: list[float] = field(default_factory=list)
    chosen: float | None = None
    on_edge: bool = False

    @property
    def grid(self) -> list[float]:
        return sorted(r.lr for r in self.runs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "member": self.member,
            "own_lr": self.own_lr,
            "grid": self.grid,
            "runs": [r.to_dict() for r in sorted(self.runs, key=lambda r: r.lr)],
            "todo": self.todo,
            "chosen": self.chosen,
            "on_edge": self.on_edge,
            "suite_entry": None if self.chosen is None else self.suite_entry,
        }

    @property
    def suite_entry(self) -> str:
        """The member's ``tuned:`` line for the suite file."""
        grid = ", ".join(lr_text(x) for x in self.grid)
        return f"tuned: {{lr: {lr_text(self.chosen or 0.0)}, grid: [{grid}]}}"


@dataclass
class TuneResult:
    suite: str
    members: list[MemberTuning]

    def to_dict(self) -> dict[str, Any]:
        return {"suite": self.suite, "members": [m.to_dict() for m in self.members]}


def own_lr(suite: Suite, member: Member) -> float:
    """The member's learning rate before tuning: the recipe's with the suite's and the
    member's changes."""
    from capsctl.config import load_preset

    try:
        preset = load_preset(suite.recipe, [*suite.set, *member.set])
    except CapsctlError as e:
        raise CapsctlError(f"suite {suite.name}, member {member.name}: {e}") from None
    return float(preset.train.lr)


def tuned_members(suite: Suite, only: Sequence[str] = ()) -> list[Member]:
    """The members the suite tunes (all of them, or those named in ``only``; naming one the
    suite does not tune is a UsageError)."""
    if suite.tune is None:
        raise UsageError(
            f"suite {suite.name}: has no tune block; add one (val_size, epochs, factors) to "
            "choose learning rates on a validation split"
        )
    members = [suite.member(n) for n in only] if only else list(suite.members)
    for m in members:
        if only and not suite.tunes(m):
            why = "its budget is matched" if m.budget == "matched" else "it says tune: false"
            raise UsageError(f"--only {m.name}: suite {suite.name} does not tune it ({why})")
    return [m for m in members if suite.tunes(m)]


def tune_finished(results: dict[str, Any]) -> bool:
    """Whether a tuning run's ``results.json`` is a finished run's: not interrupted, with a
    validation score after its last epoch, or ended by a non-finite loss (:func:`diverged`)."""
    history = results.get("history") or []
    scored = bool(history) and isinstance(history[-1].get("val_accuracy"), (int, float))
    return bool(results) and not results.get("interrupted") and (scored or diverged(results))


def diverged(results: dict[str, Any]) -> bool:
    """Whether a tuning run's ``results.json`` records that its loss became non-finite."""
    return isinstance(results.get("diverged"), dict)


def _record_divergence(folder: Path, error: DivergedError, seconds: float) -> None:
    """Write the ``results.json`` of a tuning run whose loss became non-finite: where
    (``diverged``), the epochs it finished (from its ``metrics.jsonl``), no test."""
    from capsctl.atomic import write_text_atomic
    from capsctl.curves.history import read_history

    folder.mkdir(parents=True, exist_ok=True)  # a run can end before it writes anything
    history = read_history(folder) if (folder / "metrics.jsonl").is_file() else []
    doc = {
        "test": None,
        "interrupted": False,
        "epochs_done": len(history),
        "seconds": seconds,
        "history": history,
        "diverged": {"epoch": error.epoch, "step": error.step, "message": str(error)},
    }
    write_text_atomic(folder / "results.json", json.dumps(doc, indent=2) + "\n")


def _run(member: Member, lr: float, roots: Sequence[Path]) -> TuneRun:
    """The grid point ``lr`` of ``member`` as found in ``roots`` (the first root holding it
    finished, else the first root's folder)."""
    folders = [root / tune_relpath(member.name, lr) for root in roots]
    for folder in folders:
        res = read_json(folder / "results.json")
        if tune_finished(res) and diverged(res):
            seconds = float(res.get("seconds", 0.0))
            return TuneRun(lr, str(folder), True, None, None, seconds, diverged=True)
        if tune_finished(res):
            last = res["history"][-1]
            return TuneRun(
                lr,
                str(folder),
                True,
                float(last["val_accuracy"]),
                int(last.get("epoch", len(res["history"]))),
                float(res.get("seconds", 0.0)),
            )
    return TuneRun(lr, str(folders[0]), False)


def _initial_grid(suite: Suite, own: float) -> list[float]:
    assert suite.tune is not None
    if suite.tune.grid:
        return list(suite.tune.grid)
    return sorted({float(lr_text(own * f)) for f in suite.tune.factors})


def member_tuning(suite: Suite, member: Member, roots: Sequence[Path]) -> MemberTuning:
    """Where ``member``'s tuning stands in ``roots`` (suite folders or ledgers, the first one
    the folder new runs go to): the grid's runs, what is left to train, the choice."""
    assert suite.tune is not None
    own = own_lr(suite, member)
    state = MemberTuning(member.name, own)
    grid = _initial_grid(suite, own)
    state.runs = [_run(member, lr, roots) for lr in grid]
    while True:  # each turn trains nothing or adds one grid point, at most tune.extend of them
        state.todo = [r.lr for r in state.runs if not r.finished]
        if state.todo:
            return state
        runs = sorted(state.runs, key=lambda r: r.lr)
        # a diverged run ranks below every score
        best = max(runs, key=lambda r: (-1.0 if r.diverged else r.val_accuracy or 0.0, -r.lr))
        low, high = best.lr == runs[0].lr, best.lr == runs[-1].lr
        if not (low or high) or len(runs) == 1:
            state.chosen = best.lr
            return state
        extensions = len(runs) - len(grid)
        if extensions >= suite.tune.extend:
            state.chosen, state.on_edge = best.lr, True
            return state
        step = suite.tune.step
        nxt = float(lr_text(best.lr / step if low else best.lr * step))
        state.runs.append(_run(member, nxt, roots))


def chosen_lrs(suite: Suite, roots: Sequence[Path]) -> dict[str, float]:
    """The learning rates chosen by the tuning runs in ``roots`` for the tuned members whose
    choice the suite file does not record (members still tuning are left out)."""
    if suite.tune is None:
        return {}
    out = {}
    for m in suite.members:
        if suite.tunes(m) and m.tuned is None:
            chosen = member_tuning(suite, m, roots).chosen
            if chosen is not None:
                out[m.name] = chosen
    return out


def tune_pairs(suite: Suite, root: Path) -> list[Pair]:
    """The tuning runs held in ``root`` (``tune/<member>/lr-<lr>/``), of the suite's tuned
    members, sorted by member and learning rate."""
    pairs = []
    if suite.tune is None:
        return pairs
    for m in suite.members:
        folder = root / "tune" / m.name
        if not suite.tunes(m) or not folder.is_dir():
            continue
        for sub in sorted(folder.iterdir()):
            lr = _lr_of(sub.name)
            if lr is not None and sub.is_dir():
                pairs.append(Pair(m, suite.tune.seed, sub, lr, tuning=True))
    return sorted(pairs, key=lambda p: (p.member.name, p.lr or 0.0))


def _lr_of(name: str) -> float | None:
    """The learning rate a tuning folder's name ``lr-<lr>`` gives, or None."""
    if not name.startswith("lr-"):
        return None
    try:
        lr = float(name[3:])
    except ValueError:
        return None
    return lr if lr > 0 and lr_text(lr) == name[3:] else None


def tune_suite(
    suite: Suite,
    out: Path,
    *,
    only: Sequence[str] = (),
    data_dir: str | None = None,
    on_event: EventFn = None,
    handle_sigint: bool = True,
) -> TuneResult:
    """Train every member's grid (and its extensions) into ``out/tune``; see the module
    docstring. Members whose choice the suite file records are tuned again only when named in
    ``only``, so that a recorded choice can be checked."""
    from capsctl.suites.pair_run import train_pair
    from capsctl.training.ownership import FolderBusy

    members = tuned_members(suite, only)
    if not only:
        members = [m for m in members if m.tuned is None]
    results = []
    for member in members:
        while True:
            state = member_tuning(suite, member, [out])
            if not state.todo:
                break
            lr = state.todo[0]
            seed = suite.tune.seed if suite.tune else 0
            pair = Pair(member, seed, out / tune_relpath(member.name, lr), lr, tuning=True)
            check_folder_is_pair(suite, pair)
            partial = (pair.folder / "last.safetensors").exists()
            emit(
                on_event,
                "suite_tune",
                member=member.name,
                lr=lr,
                status="partial" if partial else "new",
                folder=str(pair.folder),
            )
            started = time.monotonic()
            try:
                train_pair(suite, pair, partial, None, on_event, handle_sigint, data_dir)
            except FolderBusy:
                emit(on_event, "suite_pair_busy", member=member.name, seed=pair.seed)
                break
            except DivergedError as e:  # a result of the grid point: recorded, then the next
                _record_divergence(pair.folder, e, time.monotonic() - started)
                emit(on_event, "suite_tune_diverged", member=member.name, lr=lr, message=str(e))
                continue
            if not tune_finished(read_json(pair.folder / "results.json")):
                raise CapsctlError(
                    f"{pair.folder}: the tuning run ended without a validation score; check "
                    "its metrics.jsonl, move the folder away and run again"
                )
        results.append(state)
    return TuneResult(suite.name, results)
