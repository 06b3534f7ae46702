"""Every number a user types is checked the same way, by introspection of the command line: each
option whose type is a number, and each one parsed by a :mod:`capsctl.numbers` parser (lists
such as ``--eps 2/255,8/255``, durations, indices), refuses nan, inf, a negative value and an
absurdly large one in one line naming the option and its range, exit code 2, before any work.
A new command is covered without a new test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import typer.main
from conftest import run_cli

from capsctl.cli import app
from capsctl.numbers import NumberParser

#: Values no option accepts. There are no exemptions: every number capsctl takes is a count,
#: size, rate, radius, magnitude, duration, index or seed, none of them meaningful below 0
#: (seeds are in [0, 2**32), as the presets' train.seed), and none meaningful at 1e30.
BAD = ("nan", "inf", "-1", "1e30")


def _leaves(cmd: object, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], object]]:
    subs = getattr(cmd, "commands", None)
    if subs:
        for name, sub in subs.items():
            yield from _leaves(sub, (*path, name))
    else:
        yield path, cmd


def _numeric(param: object) -> bool:
    descriptor = param.type_descriptor  # type: ignore[attr-defined]
    parser = descriptor.parameter_info.parser
    return descriptor.annotation in (int, float) or isinstance(parser, NumberParser)


def _long(param: object) -> str:
    return max(param.opts, key=len)  # type: ignore[attr-defined]


def _numeric_options() -> list[tuple[tuple[str, ...], object, list[str]]]:
    """``(command path, option, the other required arguments)`` for every numeric option."""
    found = []
    for path, cmd in _leaves(typer.main.get_command(app)):
        params = cmd.params  # type: ignore[attr-defined]
        for p in params:
            if type(p).__name__ == "TyperOption" and not p.is_flag and _numeric(p):
                rest = []
                for q in params:
                    if q is not p and q.required:
                        rest += ["x"] if type(q).__name__ == "TyperArgument" else [_long(q), "x"]
                found.append((path, p, rest))
    return found


NUMERIC = _numeric_options()


def test_the_sweep_finds_the_numeric_options() -> None:
    names = {_long(p) for _, p, _ in NUMERIC}
    known = {"--epochs", "--lr", "--time-limit", "--batch-size", "--seed", "--top-k", "--limit",
             "--steps", "--eps", "--magnitudes", "--indices", "--seeds", "--tolerance"}  # fmt: skip
    assert known <= names, known - names
    assert len(NUMERIC) >= 30


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize(
    ("path", "param", "rest"), NUMERIC, ids=[" ".join((*p, _long(o))) for p, o, _ in NUMERIC]
)
def test_a_bad_number_is_refused_in_one_line(
    path: tuple[str, ...], param: object, rest: list[str], bad: str, capsys
) -> None:
    flag = _long(param)
    code, out, err = run_cli(capsys, [*path, f"{flag}={bad}", *rest])
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"error: {flag} {bad}: expected "), line
    within = param.type_descriptor.parameter_info.parser.within  # type: ignore[attr-defined]
    assert str(within) in line, line  # the valid range


@pytest.mark.parametrize(
    ("path", "param", "rest"), NUMERIC, ids=[" ".join((*p, _long(o))) for p, o, _ in NUMERIC]
)
def test_every_default_is_in_its_range(path: tuple[str, ...], param: object, rest: list) -> None:
    parser = param.type_descriptor.parameter_info.parser  # type: ignore[attr-defined]
    assert isinstance(parser, NumberParser), f"{' '.join(path)} {_long(param)}: no range"
    assert flag_of(parser) in param.opts  # type: ignore[attr-defined]
    if param.default is not None:  # type: ignore[attr-defined]
        parser(param.default)  # type: ignore[attr-defined]


def flag_of(parser: NumberParser) -> str:
    return parser.flag


@pytest.mark.parametrize(
    ("args", "value"),
    [
        (["--eps", "1/255, 8/255"], (1 / 255, 8 / 255)),
        (["--magnitudes", "0,15"], (0.0, 15.0)),
        (["--indices", "0,3,10-12"], (0, 3, 10, 11, 12)),
        (["--seeds", "0, 1"], (0, 1)),
        (["--time-limit", "1.5h"], 5400.0),
        (["--lr", "0.05"], 0.05),
        (["--epochs", "3"], 3),
    ],
)
def test_good_numbers_parse(args: list[str], value: object) -> None:
    flag, text = args
    (parser,) = {
        p.type_descriptor.parameter_info.parser  # type: ignore[attr-defined]
        for _, p, _ in NUMERIC
        if _long(p) == flag
    }
    assert parser(text) == value


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["robustness", "x", "--eps", "1/0"], "--eps 1/0: expected"),
        (["robustness", "x", "--eps", "1/inf"], "--eps 1/inf: expected"),
        (["robustness", "x", "--eps", ""], "--eps '': expected"),
        (["robustness", "x", "--eps", "0.5,2"], "--eps 0.5,2: expected numbers in [0, 1]"),
        (["inspect-routing", "x", "--indices", "0-99999999999"], "--indices 0-99999999999"),
        (["inspect-routing", "x", "--indices", "5-2"], "write it as 2-5"),
        (["train", "--epochs", "2.5"], "--epochs 2.5: expected an integer in [1, "),
        (["train", "--lr", "0"], "--lr 0: expected a number in (0, "),
        (["train", "--time-limit", "0m"], "--time-limit 0m: expected a duration"),
        (["suite", "run", "x", "--out", "x", "--seeds", "0,,1"], "--seeds 0,,1: expected"),
        (["robustness", "x", "--eps", "1\n2"], "--eps '1\\n2': expected"),
    ],
)
def test_odd_numbers_are_refused_in_one_line(args: list[str], needle: str, capsys) -> None:
    code, _, err = run_cli(capsys, args)
    assert code == 2
    (line,) = err.strip().splitlines()
    assert needle in line, line
