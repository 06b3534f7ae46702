"""Terminal basics: the two consoles, number formats, tables, ``--json`` and error lines.

Only the CLI and the views import this package. ``NO_COLOR`` is honoured by rich itself.

Both consoles print strings verbatim (``markup=False``): paths, class names and messages may
hold brackets (``runs/exp[final]/best.safetensors``) and must show as typed. Styling is done
with :class:`rich.text.Text` (:func:`styled`), never with markup in a string. Neither console
writes a control character it was given as text (an escape sequence in a name read from a
file): they are dropped.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderableType
from rich.segment import Segment
from rich.status import Status
from rich.text import Text

from capsctl.views.tables import fit_tables


def _width(stream: object) -> int | None:
    """Terminal width for a TTY (rich decides); a wide page when output is piped or captured."""
    if os.environ.get("COLUMNS"):
        return None
    isatty = getattr(stream, "isatty", None)
    return None if callable(isatty) and isatty() else 160


#: Characters a terminal obeys rather than shows (C0 but tab and newline, DEL, C1): an escape
#: sequence in a name read from a file could retitle the window, clear the screen or hide text.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


class _PlainConsole(Console):
    """A console that never writes a control character it was given as text (they are dropped:
    they take no cell, so tables keep their layout); its own styles and cursor moves stay."""

    def render(
        self, renderable: RenderableType, options: ConsoleOptions | None = None
    ) -> Iterable[Segment]:
        for segment in super().render(renderable, options):
            if segment.control is None and _CONTROL.search(segment.text):
                segment = Segment(_CONTROL.sub("", segment.text), segment.style)
            yield segment


out = _PlainConsole(highlight=False, markup=False, width=_width(sys.stdout))
err = _PlainConsole(stderr=True, highlight=False, markup=False, width=_width(sys.stderr))


def styled(*parts: str | tuple[str, str]) -> Text:
    """Text from plain strings and ``(text, style)`` pairs; no markup is read from any part."""
    return Text.assemble(*parts)


def spinner(message: str) -> Status:
    """A spinner on stderr showing ``message`` verbatim (a context manager)."""
    return err.status(Text(message), spinner="dots")


def _finite(doc: Any) -> Any:
    """``doc`` with every NaN or infinite float (JSON has neither) as None."""
    if isinstance(doc, float) and not math.isfinite(doc):
        return None
    if isinstance(doc, dict):
        return {k: _finite(v) for k, v in doc.items()}
    if isinstance(doc, list | tuple):
        return [_finite(v) for v in doc]
    return doc


def print_json(doc: Any) -> None:
    """One JSON document on stdout and nothing else (rich would wrap long lines); a NaN or
    infinite number is written as null."""
    text = json.dumps(_finite(doc), indent=2, default=str, allow_nan=False)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def print_plain(text: str) -> None:
    """Text made to be read by programs (CSV, command lines) on stdout as it is, less any
    control character a terminal would obey (tab and newline stay)."""
    sys.stdout.write(_CONTROL.sub("", text))
    sys.stdout.flush()


def error(message: str) -> None:
    """The one-line error: ``error: <message>``, the message verbatim."""
    err.print(styled(("error:", "bold red"), " ", message), soft_wrap=True)


def note(message: str | Text) -> None:
    """A line on stderr (a string is shown verbatim)."""
    err.print(message, soft_wrap=True)


def footnote(message: str) -> None:
    """A note under a table on stderr, shown verbatim and wrapped at word boundaries to the
    terminal's width."""
    err.print(Text(message))


def warning_line(message: str, label: str = "warning:") -> Text:
    """``warning: <message>`` (or another yellow label), the message verbatim."""
    return styled((label, "yellow"), " ", message)


def fmt_int(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def fmt_pct(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def fmt_duration(seconds: float) -> str:
    """A long span, as a person reads it: ``7.7 h``, ``40 min``, ``35 s``."""
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s"


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def table(
    title: str | None,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    right: Sequence[int] = (),
    *,
    key: int = 1,
    shorten: Sequence[int] = (),
    section_ends: Sequence[int] = (),
) -> RenderableType:
    """A table that fits the terminal (:func:`capsctl.views.tables.fit_tables`): the columns in
    ``right`` are numbers and never cut, text wraps (``shorten``: paths, cut from the left),
    and a table too wide even then folds into several, each repeating the first ``key``
    columns. Cells are shown verbatim."""
    tables = fit_tables(
        title,
        columns,
        rows,
        width=out.width,
        right=right,
        key=key,
        shorten=shorten,
        section_ends=section_ends,
    )
    return tables[0] if len(tables) == 1 else Group(*tables)
