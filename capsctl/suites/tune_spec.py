"""A suite's ``tune:`` block and a member's ``tuned:`` choice (capsctl/suites/tuning.py
trains and reads the runs): the dataclasses, their parsers, and how a learning rate is
written."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from capsctl.errors import ConfigError
from capsctl.suites.fields import check_keys, shown

__all__ = ["Tune", "Tuned", "lr_text", "parse_tune", "parse_tuned", "tune_dict"]

_TUNE_KEYS = ("val_size", "epochs", "seed", "factors", "grid", "extend", "step")


@dataclass(frozen=True)
class Tune:
    """A suite's ``tune:`` block: each tuned member trains one run of ``epochs`` epochs (seed
    ``seed``) on the training set less ``val_size`` held-out images, for each learning rate of
    its grid, and keeps the one with the best final validation accuracy. The grid is ``grid``
    when given, else the member's own learning rate times each of ``factors``; while the best
    lies on an edge, the grid grows past it by ``step`` (at most ``extend`` times)."""

    val_size: int
    epochs: int
    seed: int = 0
    factors: tuple[float, ...] = (0.5, 1.0, 2.0)
    grid: tuple[float, ...] = ()
    extend: int = 2
    step: float = 2.0


@dataclass(frozen=True)
class Tuned:
    """A member's learning rate as chosen on the validation split, and the grid it was chosen
    from (written into the suite file from ``capsctl suite tune``)."""

    lr: float
    grid: tuple[float, ...]


def lr_text(lr: float) -> str:
    """A learning rate as written in overrides and folder names (6 significant digits)."""
    return f"{lr:.6g}"


def tune_dict(t: Tune) -> dict[str, Any]:
    d = asdict(t)
    d["factors"], d["grid"] = list(t.factors), list(t.grid)
    return d


def _number(value: Any, where: str, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ConfigError(f"{where}: {shown(value)} is not a number")
    if positive and not 0 < value < float("inf"):
        raise ConfigError(f"{where}: {shown(value)} must be a positive number")
    return float(value)


def _numbers(value: Any, where: str) -> tuple[float, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise ConfigError(f"{where}: must be a list of positive numbers")
    out = tuple(_number(v, f"{where}[{i}]") for i, v in enumerate(value))
    if len(set(out)) != len(out):
        raise ConfigError(f"{where}: lists a value twice")
    return tuple(sorted(out))


def _count(value: Any, where: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{where}: {shown(value)}; use a whole number >= {least}")
    return value


def parse_tuned(value: Any, where: str) -> Tuned | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or "lr" not in value or "grid" not in value:
        raise ConfigError(f"{where}: needs lr and grid (capsctl suite tune prints them)")
    check_keys(value, ("lr", "grid"), where)
    lr, grid = _number(value["lr"], f"{where}.lr"), _numbers(value["grid"], f"{where}.grid")
    if lr not in grid:
        raise ConfigError(f"{where}.lr: {lr_text(lr)} is not in its grid {list(grid)}")
    return Tuned(lr, grid)


def parse_tune(value: Any) -> Tune | None:
    """The suite's ``tune:`` block; ConfigError naming the field."""
    if value is None:
        return None
    where = "suite.tune"
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: must be a mapping (val_size, epochs, factors or grid)")
    check_keys(value, _TUNE_KEYS, where)
    for key in ("val_size", "epochs"):
        if key not in value:
            raise ConfigError(f"{where}.{key}: missing; see capsctl suite tune --help")
    factors = _numbers(value.get("factors", [0.5, 1, 2]), f"{where}.factors")
    grid = _numbers(value.get("grid", []), f"{where}.grid")
    if not (grid or factors):
        raise ConfigError(f"{where}: give factors or a grid of learning rates")
    step = _number(value.get("step", 2.0), f"{where}.step")
    if step <= 1:
        raise ConfigError(f"{where}.step: {shown(step)} must be above 1")
    return Tune(
        val_size=_count(value["val_size"], f"{where}.val_size", 1),
        epochs=_count(value["epochs"], f"{where}.epochs", 1),
        seed=_count(value.get("seed", 0), f"{where}.seed", 0),
        factors=factors,
        grid=grid,
        extend=_count(value.get("extend", 2), f"{where}.extend", 0),
        step=step,
    )
