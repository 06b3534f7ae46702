"""The README is a product page of at most 200 lines with its sections in order and one
generated headline table; docs/ holds one generated block, opened and closed, for each results
file and each suite's robustness measurements (the scripts that fill the blocks replace only
what lies between their markers); every relative link of the README, the CHANGELOG and docs/
leads to a file (and a heading) that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 200

SECTIONS = [
    "Set-up",
    "Trying the shipped weights",
    "Results",
    "Commands",
    "Documentation",
    "Development",
    "Licence and data",
]
# what the README links to in docs/: every page the README promises
LINKED_PAGES = [
    "RESULTS.md",
    "ROBUSTNESS.md",
    "TIME-TO-ACCURACY.md",
    "PERFORMANCE.md",
    "METHOD.md",
    "USAGE.md",
    "ARCHITECTURE.md",
    "GPU-KERNELS.md",
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


def test_the_readme_has_at_most_200_lines() -> None:
    assert len(README.splitlines()) <= MAX_README_LINES


def test_the_sections_are_all_there_in_order() -> None:
    found = re.findall(r"^## (.+)$", README, re.M)
    assert [s for s in found if s in SECTIONS] == SECTIONS


def test_the_readme_links_every_page_of_docs_it_promises() -> None:
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)\)", README))
    assert set(LINKED_PAGES) <= linked
    assert all((ROOT / "docs" / page).is_file() for page in LINKED_PAGES)


def test_the_readme_has_one_generated_table_and_docs_have_it_too() -> None:
    blocks = _blocks(README)
    assert blocks == [("results", "cifar10-fast-cpu")]
    in_docs = {b for page in DOCS for b in _blocks(page.read_text(encoding="utf-8"))}
    assert set(blocks) <= in_docs


def test_each_results_file_and_robustness_suite_has_one_closed_block_in_docs() -> None:
    blocks = [b for page in DOCS for b in _blocks(page.read_text(encoding="utf-8"))]
    assert len(blocks) == len(set(blocks)), "a block appears twice in docs/"
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


def _anchors(text: str) -> set[str]:
    body = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # no headings in code blocks
    return {_anchor(h) for h in re.findall(r"^#+ (.+)$", body, re.M)}


def _broken_links(page: Path, root: Path) -> list[str]:
    """The local links and pictures of ``page`` that lead nowhere: a missing file, a path
    outside ``root``, or an anchor that the page it points into has no heading for."""
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"^```.*?^```|`[^`\n]*`", "", text, flags=re.M | re.S)  # code is not a link
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        missing = not dest.exists() or not dest.is_relative_to(root.resolve())
        if missing or (anchor and dest.suffix == ".md" and anchor not in _anchors_of(dest)):
            broken.append(target)
    return broken


def _anchors_of(page: Path) -> set[str]:
    return _anchors(page.read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    "page",
    [ROOT / "README.md", ROOT / "CHANGELOG.md", *DOCS],
    ids=lambda p: p.relative_to(ROOT).as_posix(),
)
def test_every_relative_link_and_picture_leads_somewhere(page: Path) -> None:
    assert _broken_links(page, ROOT) == []


def test_a_broken_link_or_picture_is_found(tmp_path: Path) -> None:
    (tmp_path / "docs/img").mkdir(parents=True)
    (tmp_path / "docs/img/a.png").write_bytes(b"")
    (tmp_path / "docs/B.md").write_text("# B page\n\n## Part two\n")
    (tmp_path / "README.md").write_text(
        "## Set-up and more\n![ok](docs/img/a.png) ![gone](docs/img/b.png) "
        "[x](#set-up-and-more) [y](#nowhere) [web](https://example.org/z)\n"
        "[page](docs/B.md#part-two) [no part](docs/B.md#part-three) [no page](docs/C.md)\n"
        "`code[x](y)` and\n```\n[block](z)\n```\n"
    )
    (tmp_path / "docs/A.md").write_text(
        "[up](../README.md#set-up-and-more) [pic](img/a.png) [wrong base](docs/B.md) "
        "[out](../../elsewhere.md)\n"
    )
    assert _broken_links(tmp_path / "README.md", tmp_path) == [
        "docs/img/b.png",
        "#nowhere",
        "docs/B.md#part-three",
        "docs/C.md",
    ]
    assert _broken_links(tmp_path / "docs/A.md", tmp_path) == ["docs/B.md", "../../elsewhere.md"]
