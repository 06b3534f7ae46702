"""Help text reads as written: brackets in an option's help (``capsctl[plot]``) are shown
literally, not eaten as rich markup. Found by walking the Typer app, so a new option is
covered without a new test."""

from __future__ import annotations

import re

import click
import pytest
import typer.main
from typer.testing import CliRunner

from capsctl.cli import app


def _commands(group: click.Command, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if hasattr(group, "commands"):  # a group (typer may bring its own click classes)
        subs = group.commands.items()  # type: ignore[attr-defined]
        return [p for name, sub in subs for p in _commands(sub, (*path, name))]
    return [path]


def _params() -> list[tuple[tuple[str, ...], click.Parameter]]:
    """Every parameter of every command, with the command's path."""
    root = typer.main.get_command(app)
    out = []
    for path in _commands(root):
        cmd: click.Command = root
        for name in path:
            cmd = cmd.commands[name]  # type: ignore[attr-defined]
        out += [(path, param) for param in cmd.params]
    return out


def _bracketed_helps() -> list[tuple[tuple[str, ...], str]]:
    out = []
    for path, param in _params():
        text = getattr(param, "help", None) or ""
        for word in re.findall(r"\S*\[[^\]\s]+\]\S*", text):
            out.append((path, word.replace("\\[", "[")))
    return out


BRACKETED = _bracketed_helps()


def test_some_help_has_brackets() -> None:
    assert any("capsctl[plot]" in w for _, w in BRACKETED)


@pytest.mark.parametrize("path,word", BRACKETED, ids=lambda v: str(v))
def test_brackets_in_help_are_shown_literally(path: tuple[str, ...], word: str) -> None:
    res = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert res.exit_code == 0
    shown = re.sub(r"[\s│]+", " ", res.output)
    literal = word.strip("().,;:")
    assert literal in shown, (path, literal)


@pytest.mark.parametrize(
    "path",
    [
        ("train",),
        ("eval",),
        ("predict",),
        ("compare",),
        ("inspect-routing",),
        ("robustness",),
        ("suite", "run"),
        ("suite", "report"),
    ],
    ids=" ".join,
)
def test_the_main_commands_show_an_example(path: tuple[str, ...]) -> None:
    res = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert res.exit_code == 0
    assert f"Example: capsctl {' '.join(path)} " in res.output


def _device_options() -> list[tuple[tuple[str, ...], object, str]]:
    return [
        (path, p.default, getattr(p, "help", "") or "")
        for path, p in _params()
        if p.name == "device"
    ]


def test_every_device_option_defaults_to_auto_or_says_why_not() -> None:
    """``--device`` is ``auto`` by default, or its help says what the default is and why."""
    found = _device_options()
    assert len(found) >= 5
    for path, default, text in found:
        if default != "auto":
            assert "by default" in text, (path, default, text)
