"""CHANGELOG.md is a list of releases in Keep a Changelog's format (issue 40, item 4): a title,
an Unreleased section, then each release as ``## [x.y.z] - YYYY-MM-DD``, newest first, the
newest being the package's version; under each, only the six standard groups, each at most
once, with entries as list items; no commit hashes, and at most 200 lines (the measured history
is in docs/HISTORY.md)."""

from __future__ import annotations

import datetime
import re

import pytest
from conftest import ROOT

from capsctl.version import __version__

MAX_LINES = 200
GROUPS = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")
_RELEASE = re.compile(r"## \[(\d+)\.(\d+)\.(\d+)\] - (\d{4}-\d{2}-\d{2})")
# a commit hash: 7 to 40 hex digits with at least one digit and one letter
_HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def problems(text: str, version: str) -> list[str]:
    """What keeps ``text`` from being a changelog in the format, whose newest release is
    ``version``; empty when it is one."""
    lines = text.splitlines()
    found: list[str] = []
    if len(lines) > MAX_LINES:
        found.append(f"{len(lines)} lines, more than {MAX_LINES}")
    if not lines or lines[0] != "# Changelog":
        found.append("the first line is not '# Changelog'")
    sections = [line for line in lines if line.startswith("## ")]
    if not sections or sections[0] != "## [Unreleased]":
        found.append("the first section is not '## [Unreleased]'")
    releases: list[tuple[tuple[int, ...], datetime.date]] = []
    for heading in sections[1:]:
        match = _RELEASE.fullmatch(heading)
        if match is None:
            found.append(f"{heading!r} is not '## [x.y.z] - YYYY-MM-DD'")
            continue
        try:
            day = datetime.date.fromisoformat(match[4])
        except ValueError:
            found.append(f"{heading!r}: no such date")
            continue
        releases.append((tuple(int(n) for n in match.groups()[:3]), day))
    versions, days = [r[0] for r in releases], [r[1] for r in releases]
    newest_first = all(a > b for a, b in zip(versions, versions[1:], strict=False))
    if not newest_first or days != sorted(days, reverse=True):
        found.append("the releases are not newest first")
    if releases and ".".join(map(str, releases[0][0])) != version:
        found.append(f"the newest release is not the package's version {version}")
    seen: set[str] = set()
    for line in lines[1:]:
        if line.startswith("## "):
            seen = set()
        elif line.startswith("### "):
            group = line[4:]
            if group not in GROUPS:
                found.append(f"{line!r} is not one of {', '.join(GROUPS)}")
            elif group in seen:
                found.append(f"{line!r} twice in one section")
            seen.add(group)
        elif line.startswith("#"):
            found.append(f"{line!r}: only '#', '##' and '###' headings")
    found += [f"a commit hash: {h}" for h in _HASH.findall(text)]
    return found


def test_the_changelog_follows_the_format() -> None:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert problems(text, __version__) == []


GOOD = """# Changelog

## [Unreleased]

### Added
- A feature.

## [0.2.0] - 2026-12-04

### Fixed
- A fix.

## [0.1.0] - 2026-12-03

### Added
- The first release.
"""


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        (GOOD.replace("# Changelog", "# Changes"), "first line"),
        (GOOD.replace("## [Unreleased]", "## Unreleased"), "first section"),
        (GOOD.replace("[0.2.0] - 2026-12-04", "0.2.0 (2026-12-04)"), "is not '## [x.y.z]"),
        (GOOD.replace("2026-12-04", "2026-13-04"), "no such date"),
        (GOOD.replace("2026-12-03", "2026-12-05"), "newest first"),
        (GOOD.replace("[0.1.0]", "[0.3.0]"), "newest first"),
        (GOOD.replace("[0.2.0]", "[0.3.0]"), "package's version"),
        (GOOD.replace("### Fixed", "### Notes"), "is not one of"),
        (GOOD.replace("- A fix.", "- A fix.\n\n### Fixed\n- Another."), "twice"),
        (GOOD.replace("- A feature.", "- A feature.\n\n#### Details"), "only '#'"),
        (GOOD.replace("- A fix.", "- A fix (3fddbd1b4)."), "commit hash"),
        (GOOD + "- more\n" * MAX_LINES, "more than"),
    ],
    ids=lambda v: v if len(v) < 40 else None,
)
def test_each_departure_from_the_format_is_found(bad: str, problem: str) -> None:
    assert problems(GOOD, "0.2.0") == []
    assert any(problem in p for p in problems(bad, "0.2.0")), problems(bad, "0.2.0")
