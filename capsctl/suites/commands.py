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

from capsctl.errors import CapsctlError, UsageError
from capsctl.suites.runner import check_suite, matched_budget, plan_pairs
from capsctl.suites.spec import CONTROL_CHARS, Suite

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
    pairs = plan_pairs(suite, out, only, seeds)
    check_suite(suite, pairs)
    lines = []
    limit = matched_budget(suite, out)
    for pair in pairs:
        overrides = suite.overrides(pair.member, pair.seed)
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
