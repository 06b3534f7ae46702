"""Numbers a user types: parsed, checked finite and within a stated range, and refused as one
:class:`~capsctl.errors.UsageError` line naming the option and its range
(``--epochs nan: expected an integer in [1, 100000]``).

A parser is an object named after its option (``Int("--epochs", 1, MAX_EPOCHS)``), called on
the text typed (or on a default already parsed); ``capsctl.cli`` passes one to every numeric
option as ``typer.Option(parser=...)``, so the check runs while the command line is parsed,
before any work. :class:`Floats` and :class:`Ints` take comma-separated lists (``2/255,8/255``,
``0,3,10-12``), :class:`Duration` a number of seconds or one with ``s``, ``m`` or ``h``. The
library checks values it is given with :func:`check_numbers` and the same ranges.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

from capsctl.errors import UsageError

__all__ = [
    "MAX_BATCH",
    "MAX_COUNT",
    "MAX_EPOCHS",
    "MAX_IMAGES",
    "MAX_ITERATIONS",
    "MAX_LR",
    "MAX_SECONDS",
    "MAX_SEED",
    "MAX_STEPS",
    "Duration",
    "Float",
    "Floats",
    "Int",
    "Ints",
    "NumberParser",
    "Range",
    "check_numbers",
    "duration_seconds",
    "shown",
]

#: Upper bounds of the numbers an option takes; above them a value is a typo, not a choice.
MAX_BATCH = 65_536  # images per batch
MAX_IMAGES = 10_000_000  # images of a test set (larger than any dataset capsctl reads)
MAX_EPOCHS = 100_000
MAX_LR = 10  # a learning rate
MAX_STEPS = 100_000  # timed or warm-up steps, attack steps
MAX_ITERATIONS = 100  # routing iterations
MAX_COUNT = 10_000  # classes or capsules listed, threads, processes
MAX_SEED = 2**32 - 1  # as the presets' train.seed
MAX_SECONDS = 366 * 24 * 3600  # a year of wall time
#: The most numbers one list option expands to (``--indices 0-99999999`` would be 10**8).
MAX_ITEMS = 100_000

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


@dataclass(frozen=True)
class Range:
    """``[lo, hi]``, or ``(lo, hi]`` with ``lo_open``; nan and inf are never inside."""

    lo: float
    hi: float
    lo_open: bool = False

    def __contains__(self, x: object) -> bool:
        if not isinstance(x, (int, float)) or isinstance(x, bool):
            return False
        above = x > self.lo if self.lo_open else x >= self.lo
        return math.isfinite(x) and above and x <= self.hi

    def __str__(self) -> str:
        return f"{'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}]"


def shown(text: object) -> str:
    """A value as typed, on one short line: ``repr`` when it is empty, long, padded or holds
    characters that would break the line."""
    s = str(text)
    if s and s.isprintable() and s.strip() == s and len(s) <= 40:
        return s
    return repr(s[:40]) + ("..." if len(s) > 40 else "")


def check_numbers(
    flag: str, values: Sequence[float], within: Range, what: str, why: str = ""
) -> None:
    """UsageError ``"<flag> <values>: expected <what> in <range><why>"`` unless every value
    is in ``within``."""
    if any(v not in within for v in values):
        typed = ",".join(f"{v:g}" for v in values)
        raise UsageError(f"{flag} {shown(typed)}: expected {what} in {within}{why}")


def duration_seconds(text: str) -> float:
    """Seconds of ``1800``, ``90s``, ``30m`` or ``1.5h``; nan when ``text`` is none of those."""
    raw = text.strip().lower()
    scale = _UNITS.get(raw[-1:])
    try:
        return float(raw[:-1] if scale is not None else raw) * (scale or 1.0)
    except ValueError:
        return math.nan


class NumberParser:
    """Base of the parsers: ``flag`` names the option, ``within`` its range, ``what`` and
    ``example`` its values in the error line."""

    what = "a number"
    example = ""

    def __init__(self, flag: str, within: Range) -> None:
        self.flag = flag
        self.within = within

    def refuse(self, text: object) -> NoReturn:
        example = f", e.g. {self.example}" if self.example else ""
        raise UsageError(
            f"{self.flag} {shown(text)}: expected {self.what} in {self.within}{example}"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.flag!r}, {self.within})"


class Int(NumberParser):
    """A whole number in ``[lo, hi]``."""

    what = "an integer"

    def __init__(self, flag: str, lo: int, hi: int) -> None:
        super().__init__(flag, Range(lo, hi))

    def __call__(self, text: str | int) -> int:
        try:
            value = text if isinstance(text, int) else int(str(text).strip())
        except ValueError:
            self.refuse(text)
        if value not in self.within:
            self.refuse(text)
        return value


class Float(NumberParser):
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""

    def __init__(self, flag: str, lo: float, hi: float, *, lo_open: bool = False) -> None:
        super().__init__(flag, Range(lo, hi, lo_open))

    def __call__(self, text: str | float) -> float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            self.refuse(text)
        if value not in self.within:
            self.refuse(text)
        return value


class Floats(NumberParser):
    """Comma-separated numbers in ``[lo, hi]``; each may be a fraction such as ``2/255``."""

    what = "numbers"

    def __init__(self, flag: str, lo: float, hi: float, example: str) -> None:
        super().__init__(flag, Range(lo, hi))
        self.example = example

    def _one(self, part: str) -> float:
        num, _, den = part.strip().partition("/")
        top, bottom = float(num), float(den) if den else 1.0
        if not (math.isfinite(top) and math.isfinite(bottom)):
            raise ValueError(part)
        return top / bottom

    def __call__(self, text: str | Sequence[float]) -> tuple[float, ...]:
        try:
            values = (
                tuple(float(v) for v in text)
                if not isinstance(text, str)
                else tuple(self._one(p) for p in text.split(","))
            )
        except (ValueError, ZeroDivisionError):
            self.refuse(text if isinstance(text, str) else ",".join(map(str, text)))
        if not values or any(v not in self.within for v in values):
            self.refuse(text if isinstance(text, str) else ",".join(map(str, text)))
        return values


class Ints(NumberParser):
    """Comma-separated whole numbers in ``[lo, hi]``; with ``ranges``, also ``a-b`` for every
    number from ``a`` to ``b``."""

    what = "integers"

    def __init__(self, flag: str, lo: int, hi: int, *, ranges: bool = False) -> None:
        super().__init__(flag, Range(lo, hi))
        self.ranges = ranges
        self.example = "0,3,10-12" if ranges else "0,1"
        self.what = "integers and ranges" if ranges else "integers"

    def _part(self, text: str, part: str) -> list[int]:
        a, dash, b = part.strip().partition("-") if self.ranges else (part, "", "")
        first, last = int(a), int(b) if dash else int(a)
        if first not in self.within or last not in self.within:
            self.refuse(text)
        if last < first:
            raise UsageError(f"{self.flag} {shown(text)}: the range {part.strip()} goes down; "
                             f"write it as {last}-{first}")  # fmt: skip
        if last - first >= MAX_ITEMS:
            self.refuse(text)
        return list(range(first, last + 1))

    def __call__(self, text: str | Sequence[int]) -> tuple[int, ...]:
        if not isinstance(text, str):
            text = ",".join(map(str, text))
        values: list[int] = []
        try:
            for part in text.split(","):
                values += self._part(text, part)
        except ValueError:
            self.refuse(text)
        if not values or len(values) > MAX_ITEMS:
            self.refuse(text)
        return tuple(values)


class Duration(NumberParser):
    """Seconds in ``(0, hi]``: a number of seconds, or one with ``s``, ``m`` or ``h``."""

    what = "a duration"
    example = "1800, 90s, 30m or 1.5h"

    def __init__(self, flag: str, hi: float = MAX_SECONDS) -> None:
        super().__init__(flag, Range(0, hi, lo_open=True))

    def __call__(self, text: str | float) -> float:
        seconds = float(text) if isinstance(text, (int, float)) else duration_seconds(text)
        if seconds not in self.within:
            self.refuse(text)
        return seconds

    def refuse(self, text: object) -> NoReturn:
        raise UsageError(
            f"{self.flag} {shown(text)}: expected a duration in {self.within} seconds, "
            f"e.g. {self.example}"
        )
