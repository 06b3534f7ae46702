"""The README keeps its shape: its sections in order, and one generated block, opened and
closed, for each results file and each suite's robustness measurements (the scripts that fill
the blocks replace only what lies between their markers)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")

SECTIONS = [
    "Set-up",
    "Commands",
    "Training and resume",
    "Several GPUs or machines",
    "Suites: comparisons with seeds",
    "Inspecting, exporting, comparing",
    "Predicting, sharing, plotting",
    "Routing algorithms",
    "Robustness",
    "Presets and data",
    "Python API",
    "The method as implemented",
    "Performance",
    "Time to accuracy and the comparison",
    "Development",
    "Licence and data",
]
MARKER = re.compile(r"<!-- (/?)(results|robustness):([\w.-]+) -->")


def _blocks(text: str) -> list[tuple[str, str]]:
    """(kind, name) of each block, checking that each is closed before the next opens."""
    blocks, open_block = [], None
    for m in MARKER.finditer(text):
        closing, key = m.group(1) == "/", (m.group(2), m.group(3))
        if closing:
            assert open_block == key, f"{m.group(0)} closes {open_block}"
            blocks.append(key)
            open_block = None
        else:
            assert open_block is None, f"{m.group(0)} opens inside {open_block}"
            open_block = key
    assert open_block is None, f"{open_block} is never closed"
    return blocks


def test_the_sections_are_all_there_in_order() -> None:
    found = re.findall(r"^## (.+)$", README, re.M)
    assert [s for s in found if s in SECTIONS] == SECTIONS


def test_each_results_file_and_robustness_suite_has_one_closed_block() -> None:
    blocks = _blocks(README)
    assert len(blocks) == len(set(blocks)), "a block appears twice"
    want = {("results", p.stem) for p in (ROOT / "capsctl" / "results").glob("*.csv")}
    robust = ROOT / "benchmarks" / "robustness"
    want |= {("robustness", p.name) for p in robust.iterdir() if p.is_dir()}
    assert set(blocks) == want


def test_the_block_check_finds_a_block_left_open() -> None:
    text = "<!-- results:a -->\nx\n<!-- robustness:b -->\n<!-- /robustness:b -->\n"
    with pytest.raises(AssertionError, match="opens inside"):
        _blocks(text)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _broken_links(text: str, root: Path) -> list[str]:
    """The README's local links and pictures that lead nowhere: a missing file or an anchor
    no heading has."""
    anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        if (path and not (root / path).exists()) or (not path and anchor not in anchors):
            broken.append(target)
    return broken


def test_every_local_link_and_picture_leads_somewhere() -> None:
    assert _broken_links(README, ROOT) == []


def test_a_broken_link_or_picture_is_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/a.png").write_bytes(b"")
    text = (
        "## Set-up and more\n![ok](docs/a.png) ![gone](docs/b.png) [x](#set-up-and-more) "
        "[y](#nowhere) [web](https://example.org/z)\n"
    )
    assert _broken_links(text, tmp_path) == ["docs/b.png", "#nowhere"]
