"""Tables that fit the terminal: numbers are never cut, text wraps, wide tables fold.

:func:`fit_tables` lays out every column itself (rich would cut any column, numbers too, once
a table is wider than the terminal):

1. every column gets its natural width (its widest cell or header);
2. too wide: text columns shrink (down to :data:`TEXT_MIN` cells, or their longest word) and
   wrap at word boundaries; columns named in ``shorten`` (paths) are cut from the left
   instead, ``…/deep/folder/img.png``;
3. still too wide: number columns shrink to their widest number or their header's longest
   word (their headers wrap at word boundaries);
4. still too wide: the table folds: the columns after the first ``key`` ones are split into
   blocks that fit at their natural widths, each a table of its own that repeats the key
   columns.

A number column (``right``) is never narrower than its widest number, so every number shows
whole, and no column is narrower than its longest word (up to :data:`WORD_MAX` cells), so
words show whole too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.cells import cell_len
from rich.table import Table
from rich.text import Text

__all__ = ["TEXT_MIN", "WORD_MAX", "fit_tables", "shorten_path"]

#: The narrowest a text column is made before the table folds.
TEXT_MIN = 10
#: A word this long or shorter is never broken across lines; a longer one (a hash, a path in a
#: text column) may be, rather than fold the table for it.
WORD_MAX = 24
_EDGE = 1  # the table's left border
_PER_COLUMN = 3  # one space of padding on each side and the border on the right

Cell = str | Text


def shorten_path(text: str, width: int) -> str:
    """``text`` cut from the left to ``width`` cells with an ellipsis, at a ``/`` where one is
    close: ``…/deep/folder/img.png``; unchanged when it fits."""
    if cell_len(text) <= width:
        return text
    if width <= 1:
        return "…"[:width]
    tail = text
    while cell_len(tail) > width - 1:
        tail = tail[1:]
    cut = tail.find("/")
    if 0 < cut < len(tail) - 1 and cell_len(tail) - cut >= width // 2:
        tail = tail[cut:]
    return "…" + tail


def _plain(cell: Cell) -> str:
    return cell.plain if isinstance(cell, Text) else cell


def _cell_width(cell: Cell) -> int:
    return max((cell_len(line) for line in _plain(cell).splitlines()), default=0)


def _longest_word(texts: Sequence[str]) -> int:
    """The widest word (up to :data:`WORD_MAX` cells) of ``texts``: the narrowest a column
    showing them may become without breaking a word."""
    widest = max((cell_len(w) for t in texts for w in t.split()), default=0)
    return min(widest, WORD_MAX)


@dataclass
class _Column:
    header: str
    number: bool  # right-aligned, never cut
    shorten: bool  # cut from the left instead of wrapped
    natural: int  # the widest cell or header
    least: int  # the narrowest it may become


def _columns(
    columns: Sequence[str],
    rows: Sequence[Sequence[Cell]],
    right: Sequence[int],
    shorten: Sequence[int],
) -> list[_Column]:
    result = []
    for i, header in enumerate(columns):
        cells = max((_cell_width(r[i]) for r in rows), default=0)
        natural = max(cells, cell_len(header))
        number = i in right
        if number:
            least = max(cells, _longest_word([header]), 1)
        elif i in shorten:
            least = min(natural, TEXT_MIN)
        else:
            words = _longest_word([header, *(_plain(r[i]) for r in rows)])
            least = max(min(natural, TEXT_MIN), words)
        result.append(_Column(header, number, i in shorten, natural, least))
    return result


def _shrink(widths: list[int], least: list[int], budget: int, which: list[bool]) -> None:
    """Narrow the widest of the ``which`` columns, one cell at a time, until ``budget``."""
    while sum(widths) > budget:
        open_ = [j for j, w in enumerate(widths) if which[j] and w > least[j]]
        if not open_:
            return
        widest = max(open_, key=lambda j: widths[j])
        widths[widest] -= 1


def _layout(cols: Sequence[_Column], width: int) -> list[int] | None:
    """The width of each column so that the table fits ``width``; None if it cannot."""
    budget = width - _EDGE - _PER_COLUMN * len(cols)
    widths = [c.natural for c in cols]
    least = [c.least for c in cols]
    _shrink(widths, least, budget, [not c.number for c in cols])
    _shrink(widths, least, budget, [c.number for c in cols])
    return widths if sum(widths) <= budget else None


def _natural_fits(cols: Sequence[_Column], width: int) -> bool:
    return sum(c.natural for c in cols) + _EDGE + _PER_COLUMN * len(cols) <= width


def _blocks(cols: Sequence[_Column], key: int, width: int) -> list[list[int]]:
    """Column indices of each table: all, when they fit (text shrunk); else the ``key``
    columns and as many others as fit at their natural width (at least one)."""
    if _layout(cols, width) is not None or len(cols) <= key:
        return [list(range(len(cols)))]
    blocks: list[list[int]] = []
    block: list[int] = []
    for i in range(key, len(cols)):
        trial = [cols[j] for j in (*range(key), *block, i)]
        if block and not _natural_fits(trial, width):
            blocks.append([*range(key), *block])
            block = []
        block.append(i)
    blocks.append([*range(key), *block])
    return blocks


def _fit_cell(cell: Cell, column: _Column, width: int) -> Cell:
    if not column.shorten or _cell_width(cell) <= width:
        return cell
    if isinstance(cell, Text):
        return Text(shorten_path(cell.plain, width), style=cell.style)
    return shorten_path(cell, width)


def fit_tables(
    title: str | None,
    columns: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    width: int,
    right: Sequence[int] = (),
    key: int = 1,
    shorten: Sequence[int] = (),
    section_ends: Sequence[int] = (),
) -> list[Table]:
    """``rows`` under ``columns`` as tables no wider than ``width`` (see the module docstring).

    ``right``: number columns (right-aligned, never cut). ``key``: how many leading columns
    every folded table repeats. ``shorten``: text columns cut from the left (paths).
    ``section_ends``: rows followed by a rule. Cells are shown verbatim (a ``Text`` keeps its
    style); anything else is turned into a string.
    """
    cells: list[list[Cell]] = [[v if isinstance(v, Text) else str(v) for v in row] for row in rows]
    cols = _columns(columns, cells, right, shorten)
    ends = set(section_ends)
    blocks = _blocks(cols, key, width)
    tables = []
    for n, block in enumerate(blocks):
        chosen = [cols[i] for i in block]
        widths = _layout(chosen, width) or [c.least for c in chosen]
        name = title if n == 0 or title is None else f"{title} (continued)"
        t = Table(title=Text(name) if name else None, title_justify="left", header_style="bold")
        for c, w in zip(chosen, widths, strict=True):
            t.add_column(
                Text(c.header), justify="right" if c.number else "left", width=w, overflow="fold"
            )
        for r, row in enumerate(cells):
            t.add_row(
                *[_fit_cell(row[i], c, w) for i, c, w in zip(block, chosen, widths, strict=True)],
                end_section=r in ends and r < len(cells) - 1,
            )
        tables.append(t)
    return tables
