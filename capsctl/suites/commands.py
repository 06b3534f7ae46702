"""``capsctl suite run --print-commands``: each pair of a suite as one ``capsctl train`` command
line, to hand to a scheduler (SLURM arrays, GNU parallel) instead of training here.

The lines are meant for a shell, one line at a time: every word is shell-quoted, and no line
holds a line break, so a suite's text (its descriptions, notes, ``set:`` values, preset paths)
can never run as a command of its own.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from capsctl.errors import CapsctlError, UsageError
from capsctl.suites.pairs import (
    Pair,
    awaiting_tuning,
    check_suite,
    matched_budget,
    pair_overrides,
    plan_pairs,
    tune_relpath,
)
from capsctl.suites.spec import CONTROL_CHARS, Member, Suite

__all__ = ["pair_commands"]


def pair_commands(
    suite: Suite, out: Path, only: Sequence[str] = (), seeds: Sequence[int] = ()
) -> list[str]:
    """One ``capsctl train`` command line per pair; a matched member whose budget is not known
    yet gets a ``#`` comment line instead. Every word of every line is shell-quoted and each
    line is one line, so that feeding them to a shell (or a scheduler, line by line) runs
    exactly these commands whatever the suite's text holds. The suite is checked first
    (:func:`check_suite`)."""
    if CONTROL_CHARS.search(str(out)):
        raise UsageError(
            f"--out {str(out)!r:.60}: holds a line break or control character; printed commands "
            "are one line each, choose another --out"
        )
    from capsctl.suites.tuning import chosen_lrs, member_tuning

    pairs = plan_pairs(suite, out, only, seeds, chosen_lrs(suite, [out]))
    check_suite(suite, pairs)
    lines = []
    limit = matched_budget(suite, out)
    tuning_shown: set[str] = set()
    for pair in pairs:
        if awaiting_tuning(suite, pair):
            if pair.member.name not in tuning_shown:
                tuning_shown.add(pair.member.name)
                lines += _tuning_lines(suite, pair.member, out, member_tuning)
            continue
        overrides = pair_overrides(suite, pair)
        if pair.member.budget == "matched":
            if limit is None:
                lines.append(
                    _comment(
                        f"{pair.label}: its time limit is the median wall time of the finished "
                        "runs of the other members, print the commands again once they have "
                        "finished"
                    )
                )
                continue
            overrides.append(f"train.time_limit={limit:.0f}")
        words = ["capsctl", "train", "--preset", suite.recipe]
        for o in overrides:
            words += ["--set", o]
        lines.append(_command([*words, "--out", str(pair.folder)]))
    return lines


def _tuning_lines(suite: Suite, member: Member, out: Path, member_tuning: Any) -> list[str]:
    """The commands of ``member``'s tuning runs still to train, and a comment saying that its
    seeds follow once its learning rate is chosen (the grid may grow past an edge first)."""
    state = member_tuning(suite, member, [out])
    lines = []
    for lr in state.todo:
        pair = Pair(member, suite.tune.seed if suite.tune else 0, out, lr, tuning=True)
        words = ["capsctl", "train", "--preset", suite.recipe]
        for o in pair_overrides(suite, pair):
            words += ["--set", o]
        lines.append(_command([*words, "--out", str(out / tune_relpath(member.name, lr))]))
    lines.append(
        _comment(
            f"{member.name}: its seeds train at the learning rate chosen on validation, print "
            "the commands again once these tuning runs have finished, the grid may grow"
        )
    )
    return lines


def _comment(text: str) -> str:
    """A ``#`` comment line: ``text`` on one line (line breaks and control characters as
    spaces), every word shell-quoted, so that nothing of it can run or drive a terminal."""
    return "# " + shlex.join(CONTROL_CHARS.sub(" ", text).split())


def _command(words: Sequence[str]) -> str:
    """``words`` as one shell-quoted line; CapsctlError for a word that cannot be one line."""
    for word in words:
        if CONTROL_CHARS.search(word):
            raise CapsctlError(
                f"{word!r:.60}: holds a line break or control character, which a printed command "
                "cannot keep on one line; rename it"
            )
    return shlex.join(words)
