"""A suite's claims as differences between two members, with a 95% confidence interval over
seeds (Welch's t interval), and a verdict in words.

A suite file may list its claims::

    claims:
    - name: routing
      says: inverted dot-product attention beats dynamic routing
      a: idpa
      b: dynamic
      expect: ahead        # or "level": parity, judged by the interval lying within +-1 point

For each claim the report gives ``a - b`` in points of accuracy (on the suite's first test file
unless the claim names ``test``), its 95% interval and a verdict:

- *ahead* or *behind* when the interval excludes 0;
- *level* when it lies within +-1 point (:data:`LEVEL_POINTS`);
- *inconclusive* otherwise, and wherever a member has fewer than two seeds.

A claim *holds* when its verdict is the one it expects (``ahead``), or, for ``expect: level``,
when the interval lies within +-1 point.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from capsctl.errors import ConfigError

__all__ = [
    "LEVEL_POINTS",
    "Claim",
    "Difference",
    "judge",
    "judge_summary",
    "paragraph",
    "parse_claims",
    "verdict",
    "welch_from_summary",
    "welch_interval",
]

#: Half-width in points of accuracy of the band called *level*.
LEVEL_POINTS = 1.0
#: Coverage of the confidence interval.
CONFIDENCE = 0.95
_EXPECT = ("ahead", "level")
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


@dataclass(frozen=True)
class Claim:
    """One claim of a suite: member ``a`` against member ``b`` on ``test`` (None: the suite's
    first test file), expected ``ahead`` or ``level``; ``says`` is the claim in words."""

    name: str
    says: str
    a: str
    b: str
    expect: str = "ahead"
    test: str | None = None


@dataclass(frozen=True)
class Difference:
    """``a - b`` in points of accuracy over seeds, its 95% interval (None with fewer than two
    seeds on either side), the verdict and whether the claim holds."""

    claim: Claim
    test: str
    seeds_a: int
    seeds_b: int
    points: float | None
    low: float | None
    high: float | None
    dof: float | None
    verdict: str
    holds: bool

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["claim"] = asdict(self.claim)
        return out


def parse_claims(raw: Any, members: Sequence[str], where: str) -> list[Claim]:
    """The ``claims:`` list of a suite file, checked against its ``members`` (ConfigError, one
    line naming the claim and the field)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: claims must be a list of mappings")
    out: list[Claim] = []
    for i, item in enumerate(raw):
        at = f"{where}: claims[{i}]"
        if not isinstance(item, Mapping):
            raise ConfigError(f"{at}: expected a mapping with name, says, a, b and expect")
        unknown = set(item) - {"name", "says", "a", "b", "expect", "test"}
        if unknown:
            raise ConfigError(f"{at}: unknown field {sorted(unknown)[0]!r}")
        claim = Claim(**{k: item[k] for k in item})
        if not isinstance(claim.name, str) or not _NAME.match(claim.name):
            raise ConfigError(f"{at}.name: letters, digits, '.', '_' or '-' (64 at most)")
        if not isinstance(claim.says, str) or "\n" in claim.says or not claim.says.strip():
            raise ConfigError(f"{at}.says: one line of text")
        for side in ("a", "b"):
            if getattr(claim, side) not in members:
                raise ConfigError(f"{at}.{side}: not a member of the suite; use one of {members}")
        if claim.expect not in _EXPECT:
            raise ConfigError(f"{at}.expect: 'ahead' or 'level', got {claim.expect!r}")
        out.append(claim)
    return out


def welch_interval(
    a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE
) -> tuple[float, float, float, float] | None:
    """``(mean(a) - mean(b), low, high, degrees of freedom)``: Welch's t interval for the
    difference of two means with unequal variances; None with fewer than two values on either
    side. Where both samples have no spread the interval is the point itself (dof infinite)."""
    if len(a) < 2 or len(b) < 2:
        return None
    return welch_from_summary(
        (statistics.fmean(a), statistics.stdev(a), len(a)),
        (statistics.fmean(b), statistics.stdev(b), len(b)),
        confidence,
    )


def welch_from_summary(
    a: tuple[float, float, int], b: tuple[float, float, int], confidence: float = CONFIDENCE
) -> tuple[float, float, float, float] | None:
    """:func:`welch_interval` from each side's ``(mean, standard deviation (ddof 1), n)``, as a
    results file keeps them."""
    from scipy.stats import t as student_t

    (ma, sa, na), (mb, sb, nb) = a, b
    if na < 2 or nb < 2:
        return None
    diff = ma - mb
    va, vb = sa**2 / na, sb**2 / nb
    se = math.sqrt(va + vb)
    if se == 0.0:
        return diff, diff, diff, math.inf
    dof = (va + vb) ** 2 / (va**2 / (na - 1) + vb**2 / (nb - 1))
    half = float(student_t.ppf(0.5 + confidence / 2, dof)) * se
    return diff, diff - half, diff + half, dof


def verdict(low: float, high: float, band: float = LEVEL_POINTS) -> str:
    """*ahead* or *behind* when ``[low, high]`` excludes 0, *level* when it lies within
    ``+-band``, *inconclusive* otherwise."""
    if low > 0:
        return "ahead"
    if high < 0:
        return "behind"
    if -band <= low and high <= band:
        return "level"
    return "inconclusive"


def judge(claim: Claim, test: str, a: Sequence[float], b: Sequence[float]) -> Difference:
    """The claim on accuracies ``a`` and ``b`` (fractions in [0, 1], one per seed)."""

    def summary(v: Sequence[float]) -> tuple[float, float, int]:
        if not v:
            return math.nan, math.nan, 0
        return statistics.fmean(v), statistics.stdev(v) if len(v) >= 2 else math.nan, len(v)

    return judge_summary(claim, test, summary(a), summary(b))


def judge_summary(
    claim: Claim, test: str, a: tuple[float, float, int], b: tuple[float, float, int]
) -> Difference:
    """The claim on each side's ``(mean, standard deviation, seeds)`` of accuracy (fractions in
    [0, 1]), as a results file keeps them."""
    got = welch_from_summary((100.0 * a[0], 100.0 * a[1], a[2]), (100.0 * b[0], 100.0 * b[1], b[2]))
    if got is None:
        points = 100.0 * (a[0] - b[0]) if a[2] and b[2] else None
        return Difference(claim, test, a[2], b[2], points, None, None, None, "inconclusive", False)
    points, low, high, dof = got
    word = verdict(low, high)
    if claim.expect == "level":
        holds = low >= -LEVEL_POINTS and high <= LEVEL_POINTS
    else:
        holds = word == "ahead"
    return Difference(claim, test, len(a), len(b), points, low, high, dof, word, holds)


def paragraph(diffs: Sequence[Difference]) -> str:
    """The claim-by-claim paragraph: one line per claim, what it says, the difference with its
    interval and the verdict."""
    lines = []
    for i, d in enumerate(diffs, 1):
        c = d.claim
        head = f"{i}. {c.says} ({c.a} - {c.b}, {d.test}):"
        if d.low is None or d.high is None or d.points is None:
            seeds = f"{d.seeds_a} and {d.seeds_b} seeds"
            lines.append(f"{head} inconclusive, {seeds} (two or more each are needed).")
            continue
        judged = "holds" if d.holds else "does not hold"
        lines.append(
            f"{head} {d.points:+.2f} points, 95% CI [{d.low:+.2f}, {d.high:+.2f}] over "
            f"{d.seeds_a} and {d.seeds_b} seeds: {d.verdict}; the claim {judged}."
        )
    return "\n".join(lines)
