"""The terminal views: tables fit the terminal and never cut a number (issue 26, finding 8)."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from capsctl.views.tables import fit_tables, shorten_path

CLASSES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]


def render(tables: list, width: int) -> str:
    buf = io.StringIO()
    console = Console(file=buf, width=width, markup=False, highlight=False, color_system=None)
    for t in tables:
        console.print(t)
    return buf.getvalue()


def confusion_rows() -> list[list[object]]:
    n = len(CLASSES)
    rows: list[list[object]] = []
    for i, name in enumerate(CLASSES):
        counts = [0] * n
        counts[i], counts[(i + 1) % n] = 159, 41
        rows.append([name, "79.5%", 200, *counts])
    return rows


@pytest.mark.parametrize("width", [80, 200])
def test_confusion_matrix_numbers_are_whole(width: int) -> None:
    columns = ["class", "acc", "n", *[c[:6] for c in CLASSES]]
    tables = fit_tables(
        "confusion", columns, confusion_rows(), width=width, right=range(1, len(columns))
    )
    text = render(tables, width)
    assert all(len(line) <= width for line in text.splitlines())
    cells = [re.findall(r"│([^│┃]*)", line) for line in text.splitlines() if "│" in line]
    numbers = [c.strip() for row in cells for c in row[1:] if c.strip()]
    assert numbers.count("79.5%") == len(CLASSES) and numbers.count("200") == len(CLASSES)
    assert numbers.count("159") == len(CLASSES) and numbers.count("41") == len(CLASSES)
    assert set(numbers) == {"79.5%", "200", "159", "41", "0"}
    assert "Ankle" in text and ("Bag" in text)
    assert len(tables) == (1 if width == 200 else 2)
    for name in CLASSES:  # every block repeats the class column, unwrapped
        assert sum(line.startswith(f"│ {name} ") for line in text.splitlines()) == len(tables)


def words(text: str) -> set[str]:
    """Runs of letters, digits and ``/.%-`` (table borders and spaces split them)."""
    return set(re.findall(r"[\w/.%-]+", text))


@pytest.mark.parametrize("width", [40, 80, 200])
def test_no_word_is_broken_in_headers_or_text(width: int) -> None:
    """Headers of number columns and text cells wrap at word boundaries (issue 40, item 5): a
    class name heads its column whole, a long model name is not cut."""
    columns = ["class", "acc", "n", *CLASSES]
    tables = fit_tables(
        "confusion", columns, confusion_rows(), width=width, right=range(1, len(columns))
    )
    rows = [["a-model-with-a-long-name", "trained under a matched budget of wall time", "1.5"]]
    tables += fit_tables("models", ["model", "note", "epochs"], rows, width=width, right=(2,))
    text = render(tables, width)
    assert all(len(line) <= width for line in text.splitlines()), text
    given = words(" ".join(["confusion models continued", *columns, "model note epochs"]))
    given |= words(" ".join(str(c) for row in [*confusion_rows(), *rows] for c in row))
    assert words(text) <= given, (words(text) - given, text)


def test_shorten_path_cuts_from_the_left_at_a_folder() -> None:
    path = "runs/a/very/deep/folder/img.png"
    assert shorten_path(path, 40) == path
    short = shorten_path(path, 20)
    assert short.startswith("…") and short.endswith("/img.png") and len(short) <= 20
    assert shorten_path("a_very_long_single_file_name.png", 12) == "…le_name.png"


@pytest.mark.parametrize("width", [80, 200])
def test_long_paths_are_shortened_and_scores_stay_whole(width: int) -> None:
    path = "data/" + "/".join(f"deep{i:02d}" for i in range(12)) + "/img.png"  # 85 characters
    rows = [[path, 1, "Ankle boot", "99.9%", "PNG gray 28x28, used as is"]]
    tables = fit_tables(
        "top",
        ["image", "#", "class", "score", "input"],
        rows,
        width=width,
        right=(1, 3),
        shorten=(0,),
    )
    text = render(tables, width)
    assert len(tables) == 1 and all(len(line) <= width for line in text.splitlines())
    assert "99.9%" in text and "Ankle boot" in text and "/img.png" in text
    assert (path in text) == (width == 200) and ("…/" in text) == (width == 80)
