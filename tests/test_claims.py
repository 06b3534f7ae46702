"""A suite's claims as differences with Welch's 95% interval: typed numbers worked by hand."""

from __future__ import annotations

import math

import pytest

from capsctl.errors import ConfigError
from capsctl.suites.claims import Claim, judge, paragraph, parse_claims, verdict, welch_interval

T_975_4 = 2.7764451051977987  # Student's t, 97.5% quantile, 4 degrees of freedom (tables: 2.776)


def test_welch_interval_with_equal_spreads_has_2n_minus_2_degrees_of_freedom() -> None:
    # means 92 and 89, variances 1 and 1: se = sqrt(1/3 + 1/3), dof = (2/3)^2 / (2 * (1/3)^2 / 2)
    diff, low, high, dof = welch_interval([91.0, 92.0, 93.0], [88.0, 89.0, 90.0])  # type: ignore[misc]
    half = T_975_4 * math.sqrt(2 / 3)
    assert diff == pytest.approx(3.0)
    assert dof == pytest.approx(4.0)
    assert (low, high) == pytest.approx((3.0 - half, 3.0 + half))


def test_welch_degrees_of_freedom_with_unequal_spreads() -> None:
    # variances 0.1233 and 0.0433 over 3 seeds each (the idpa and dynamic accuracies of one
    # suite): Welch-Satterthwaite gives 0.05556^2 / (0.04111^2 / 2 + 0.01444^2 / 2) = 3.251
    got = welch_interval([89.6, 89.2, 89.9], [89.5, 89.6, 89.9])
    assert got is not None and got[3] == pytest.approx(3.251, abs=1e-3)
    assert got[0] == pytest.approx(-0.1)


def test_one_seed_gives_no_interval_and_no_spread_gives_the_point() -> None:
    assert welch_interval([90.0], [89.0, 88.0]) is None
    assert welch_interval([90.0, 90.0], [89.0, 89.0]) == (1.0, 1.0, 1.0, math.inf)


@pytest.mark.parametrize(
    "low,high,word",
    [
        (0.7, 5.3, "ahead"),
        (-5.3, -0.7, "behind"),
        (-0.55, 0.35, "level"),
        (-3.5, 5.5, "inconclusive"),
        (-1.0, 1.0, "level"),
        (-1.01, 0.5, "inconclusive"),
    ],
)
def test_verdicts(low: float, high: float, word: str) -> None:
    assert verdict(low, high) == word


def test_judge_and_the_paragraph() -> None:
    ahead = Claim("routing", "idpa beats dynamic routing", "idpa", "dynamic", "ahead")
    level = Claim("parity", "idpa is at par with ResNet-18", "idpa", "resnet18", "level")
    d1 = judge(ahead, "test", [0.91, 0.92, 0.93], [0.88, 0.89, 0.90])
    d2 = judge(level, "test", [0.900, 0.902, 0.904], [0.901, 0.903, 0.905])
    d3 = judge(level, "test", [0.90], [0.89, 0.90])
    assert (d1.verdict, d1.holds) == ("ahead", True)
    assert (d2.verdict, d2.holds) == ("level", True)
    assert d2.low == pytest.approx(-0.1 - T_975_4 * math.sqrt(2 * 0.04 / 3))
    assert (d3.verdict, d3.holds, d3.low) == ("inconclusive", False, None)
    text = paragraph([d1, d2, d3]).splitlines()
    assert text[0] == (
        "1. idpa beats dynamic routing (idpa - dynamic, test): +3.00 points, 95% CI "
        "[+0.73, +5.27] over 3 and 3 seeds: ahead; the claim holds."
    )
    assert text[1].endswith("level; the claim holds.")
    assert "inconclusive, 1 and 2 seeds" in text[2]


@pytest.mark.parametrize(
    "raw,message",
    [
        ("x", "must be a list"),
        ([{"name": "a b", "says": "s", "a": "idpa", "b": "cnn"}], ".name"),
        ([{"name": "c", "says": "s\nrm -rf", "a": "idpa", "b": "cnn"}], ".says: one line"),
        ([{"name": "c", "says": "s", "a": "idpa", "b": "nope"}], ".b: not a member"),
        ([{"name": "c", "says": "s", "a": "idpa", "b": "cnn", "expect": "x"}], ".expect"),
        ([{"name": "c", "says": "s", "a": "idpa", "b": "cnn", "why": 1}], "unknown field"),
    ],
)
def test_claims_are_checked_against_the_members(raw: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_claims(raw, ["idpa", "cnn"], "suite.yaml")


def test_the_multimnist_ledger_judges_the_papers_third_claim() -> None:
    """The bundled suite's claim, judged by ``suite report`` on the shipped ledger: the
    capsule net is 0.99 points behind the CNN (82.35 against 83.34%, three seeds each, each
    member at its validation-chosen learning rate)."""
    from pathlib import Path

    from capsctl.suites import load_suite, report_suite

    ledger = Path(__file__).resolve().parents[1] / "benchmarks" / "suites" / "multimnist-cpu"
    assert [c.name for c in load_suite("multimnist").claims] == ["caps-vs-cnn"]
    doc = report_suite(load_suite(str(ledger / "suite.yaml")), ledger, score=False).to_dict()
    (d,) = doc["claims"]
    assert (d["verdict"], d["holds"], d["seeds_a"], d["seeds_b"]) == ("behind", False, 3, 3)
    assert d["points"] == pytest.approx(-0.99, abs=0.005)
    assert (d["low"], d["high"]) == pytest.approx((-1.34, -0.65), abs=0.01)
    assert doc["claims_text"].startswith("1. the capsule net beats a CNN")
