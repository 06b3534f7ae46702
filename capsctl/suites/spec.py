"""Suites as data: a YAML file of members, one recipe and a list of seeds.

A suite file (bundled ones live in ``presets/suites/``)::

    name: cifar10-fast
    description: ...
    recipe: cifar10-caps-fast          # the preset every member starts from
    set: [train.time_limit=null, train.epochs=8]   # the recipe's changes, for every member
    seeds: [0, 1, 2]
    tests: [test-lossless-1k, test-jpeg]           # test files every finished run is scored on
    members:
      - name: idpa
      - name: dynamic
        set: ["model.router={name: dynamic}"]
      - name: resnet18
        set: [model=resnet18]
        seeds: [0, 1]
        budget: matched                # time limit: the other members' median wall time
        published: {top1: 0.95, source: "..."}
    tune:                              # each member's lr chosen on a validation split
      val_size: 5000                   # training images held out for it
      epochs: 4                        # each tuning run's epochs
      factors: [0.5, 1, 2]             # the grid: the member's own lr times these

Each (member, seed) pair is one ``capsctl train`` run: the recipe preset with the suite's
``set``, then the member's ``set``, then its chosen learning rate (``train.lr``), then
``train.seed``. Nothing here trains or prints.

With a ``tune:`` block, each ``epochs`` member (unless ``tune: false``) has its learning rate
chosen on a validation split before its runs (:mod:`capsctl.suites.tuning`); the choice is kept
in the suite file as the member's ``tuned: {lr, grid}`` once made, so that the runs are
reproducible without tuning again.

Names (a member's, and the suite's) name folders and are printed in shell commands: letters,
digits, ``.``, ``_`` and ``-`` only. No text of a suite holds a control character (an escape
sequence would drive the terminal) and none but a description or a note a line break (its line
breaks become spaces): such a file is refused, naming the field and the member.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from capsctl.errors import ConfigError, UsageError
from capsctl.suites.claims import Claim, parse_claims
from capsctl.suites.fields import check_keys, shown
from capsctl.suites.tune_spec import Tune, Tuned, lr_text, parse_tune, parse_tuned, tune_dict

__all__ = [
    "CONTROL_CHARS",
    "Member",
    "Published",
    "Suite",
    "Tune",
    "Tuned",
    "list_suites",
    "load_suite",
    "lr_text",
    "suite_dirs",
]

Budget = Literal["epochs", "matched"]
_SUFFIXES = (".yaml", ".yml")
#: A member's (and a suite's) name: it names folders and files, and is printed in commands.
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
#: Characters no text of a suite holds: line breaks and what a terminal would obey (C0, C1).
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_MAX_SEED = 2**32 - 1  # as the presets' train.seed


@dataclass(frozen=True)
class Published:
    """A published figure shown next to a member: top-1 accuracy (a number or a range such as
    ``"0.9154-0.9214"``), where it comes from, and how its setting differs."""

    top1: str
    source: str
    setting: str = ""


@dataclass(frozen=True)
class Member:
    """One model of a suite: its name, its changes to the recipe, its seeds (default: the
    suite's), its budget (``epochs``: the recipe's epochs; ``matched``: also stopped at the
    median wall time of the suite's ``epochs`` members, for models too slow to train the same
    epochs here) and an optional published figure."""

    name: str
    set: tuple[str, ...] = ()
    seeds: tuple[int, ...] | None = None
    budget: Budget = "epochs"
    published: Published | None = None
    note: str = ""
    tune: bool = True  # false: keep the recipe's learning rate even when the suite tunes
    tuned: Tuned | None = None


@dataclass(frozen=True)
class Suite:
    name: str
    recipe: str
    members: tuple[Member, ...]
    seeds: tuple[int, ...]
    set: tuple[str, ...] = ()
    tests: tuple[str, ...] = ()
    description: str = ""
    source: str = ""
    results: str = ""  # the results file of the package this suite's measured rows go to
    claims: tuple[Claim, ...] = ()  # differences the report judges (capsctl/suites/claims.py)
    tune: Tune | None = None

    def tunes(self, member: Member) -> bool:
        """Whether ``member``'s learning rate is chosen on validation (a ``tune:`` block, an
        ``epochs`` member, not ``tune: false``)."""
        return self.tune is not None and member.tune and member.budget == "epochs"

    def member(self, name: str) -> Member:
        for m in self.members:
            if m.name == name:
                return m
        raise UsageError(
            f"--only {name}: not a member of suite {self.name}; choose from "
            f"{', '.join(m.name for m in self.members)}"
        )

    def seeds_of(self, member: Member) -> tuple[int, ...]:
        return member.seeds if member.seeds is not None else self.seeds

    def overrides(self, member: Member, seed: int, lr: float | None = None) -> list[str]:
        """The ``--set`` overrides of one pair, applied to :attr:`recipe` in this order; ``lr``:
        the member's chosen learning rate (default: its ``tuned`` one, if any)."""
        if lr is None and member.tuned is not None and self.tunes(member):
            lr = member.tuned.lr
        chosen = [] if lr is None else [f"train.lr={lr_text(lr)}"]
        return [*self.set, *member.set, *chosen, f"train.seed={seed}"]

    def tune_overrides(self, member: Member, lr: float) -> list[str]:
        """The ``--set`` overrides of the tuning run of ``member`` at ``lr``: the validation
        split, the tuning epochs and seed, and no final test (the test set is never touched)."""
        if self.tune is None:
            raise UsageError(f"suite {self.name}: has no tune block")
        t = self.tune
        return [
            *self.set,
            *member.set,
            f"data.val_size={t.val_size}",
            f"train.epochs={t.epochs}",
            f"train.lr={lr_text(lr)}",
            f"train.seed={t.seed}",
            "train.final_test=false",
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "recipe": self.recipe,
            "set": list(self.set),
            "seeds": list(self.seeds),
            "tests": list(self.tests),
            "results": self.results,
            "claims": [asdict(c) for c in self.claims],
            "tune": None if self.tune is None else tune_dict(self.tune),
            "members": [
                {
                    "name": m.name,
                    "set": list(m.set),
                    "seeds": list(self.seeds_of(m)),
                    "budget": m.budget,
                    "note": m.note,
                    "tune": m.tune,
                    "tuned": None
                    if m.tuned is None
                    else {"lr": m.tuned.lr, "grid": list(m.tuned.grid)},
                    "published": None
                    if m.published is None
                    else {
                        "top1": m.published.top1,
                        "source": m.published.source,
                        "setting": m.published.setting,
                    },
                }
                for m in self.members
            ],
        }


def suite_dirs() -> list[Path]:
    """Folders searched for suite files: ``suites/`` inside each preset folder."""
    from capsctl.config.presets import preset_dirs

    return [d / "suites" for d in preset_dirs() if (d / "suites").is_dir()]


def list_suites() -> list[tuple[str, str]]:
    """``(name, description)`` of every bundled suite."""
    out: dict[str, str] = {}
    for folder in suite_dirs():
        for f in sorted(folder.iterdir()):
            if f.suffix in _SUFFIXES and f.stem not in out:
                try:
                    out[f.stem] = load_suite(f).description
                except ConfigError as e:
                    out[f.stem] = f"(unreadable: {e})"
    return sorted(out.items())


def _find(name_or_path: str | os.PathLike[str]) -> Path:
    path = Path(name_or_path)
    if path.suffix in _SUFFIXES or path.exists():
        if not path.is_file():
            raise UsageError(f"suite {name_or_path}: no such file")
        return path
    for folder in suite_dirs():
        for suffix in _SUFFIXES:
            if (folder / f"{name_or_path}{suffix}").is_file():
                return folder / f"{name_or_path}{suffix}"
    known = ", ".join(n for n, _ in list_suites()) or "none"
    raise UsageError(f"suite {name_or_path}: unknown; use a suite file or one of: {known}")


def load_suite(name_or_path: str | os.PathLike[str]) -> Suite:
    """A bundled suite by name, or a suite YAML file; ConfigError naming the field if invalid."""
    from capsctl.config.yaml_io import parse_yaml

    path = _find(name_or_path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"suite {path}: not a UTF-8 text file; pass a suite YAML file") from None
    except OSError as e:
        raise UsageError(f"suite {path}: cannot be read ({e.strerror})") from None
    raw = parse_yaml(text, str(path)) if text.strip() else None
    if raw is None:
        raise ConfigError(f"suite {path}: the file is empty; see capsctl suite list")
    return suite_from_dict(raw, str(path), default_name=path.stem)


def _line(value: str, where: str) -> str:
    """``value`` when it is one line of text; ConfigError naming ``where`` otherwise (a line
    break would end a printed command, an escape sequence would drive the terminal)."""
    if CONTROL_CHARS.search(value):
        raise ConfigError(
            f"{where}: {shown(value)} holds a line break or control character; write it as one "
            "line of plain text"
        )
    return value


def _prose(value: Any, where: str) -> str:
    """Free text (a description, a note): its whitespace runs, line breaks included, as one
    space; other control characters are refused."""
    return _line(" ".join(str(value).split()), where)


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise ConfigError(f"{where}: must be a list of strings")
    if not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: must be a list of strings")
    return tuple(_line(v, f"{where}[{i}]") for i, v in enumerate(value))


def _seeds(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str) or not value:
        raise ConfigError(f"{where}: must be a non-empty list of integers")
    if not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _MAX_SEED for v in value
    ):
        raise ConfigError(f"{where}: must be a non-empty list of integers from 0 to {_MAX_SEED}")
    if len(set(value)) != len(value):
        raise ConfigError(f"{where}: a seed is listed twice")
    return tuple(value)


_MEMBER_KEYS = ("name", "set", "seeds", "budget", "published", "note", "tune", "tuned")
_SUITE_KEYS = (
    "name",
    "description",
    "recipe",
    "set",
    "seeds",
    "tests",
    "members",
    "results",
    "claims",
    "tune",
)


def _plain_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not _PLAIN_NAME.fullmatch(name):
        raise ConfigError(
            f"{where}: {shown(name)} is not a plain name; use letters, digits, '.', '_' and '-', "
            "not starting with '.' (it names folders and is printed in commands)"
        )
    return name


def _member(data: Any, index: int) -> Member:
    where = f"suite.members[{index}]"
    if isinstance(data, str):
        data = {"name": data}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: must be a mapping with a name")
    name = _plain_name(data.get("name"), f"{where}.name")
    where = f"{where} ({name})"  # every later error names the member
    check_keys(data, _MEMBER_KEYS, where)
    budget = data.get("budget", "epochs")
    if budget not in ("epochs", "matched"):
        raise ConfigError(f"{where}.budget: {budget!r}; use epochs or matched")
    pub = data.get("published")
    published = None
    if pub is not None:
        if not isinstance(pub, Mapping) or "top1" not in pub or "source" not in pub:
            raise ConfigError(f"{where}.published: needs top1 and source")
        check_keys(pub, ("top1", "source", "setting"), f"{where}.published")
        fields = ("top1", "source", "setting")
        published = Published(
            **{k: _prose(pub.get(k, ""), f"{where}.published.{k}") for k in fields}
        )
    seeds = data.get("seeds")
    tune = data.get("tune", True)
    if not isinstance(tune, bool):
        raise ConfigError(f"{where}.tune: {shown(tune)}; use true or false")
    return Member(
        name=name,
        set=_strings(data.get("set"), f"{where}.set"),
        seeds=None if seeds is None else _seeds(seeds, f"{where}.seeds"),
        budget=budget,
        published=published,
        note=_prose(data.get("note", ""), f"{where}.note"),
        tune=tune,
        tuned=parse_tuned(data.get("tuned"), f"{where}.tuned"),
    )


def suite_from_dict(raw: Any, source: str, default_name: str = "") -> Suite:
    """A :class:`Suite` from a parsed mapping; ConfigError naming the bad field."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"suite {source}: must be a mapping (name, recipe, seeds, members)")
    check_keys(raw, _SUITE_KEYS, "suite")
    recipe = raw.get("recipe")
    if not isinstance(recipe, str) or not recipe:
        raise ConfigError("suite.recipe: must name a preset (see capsctl presets)")
    _line(recipe, "suite.recipe")
    members_raw = raw.get("members")
    if not isinstance(members_raw, Sequence) or isinstance(members_raw, str) or not members_raw:
        raise ConfigError("suite.members: must be a non-empty list")
    members = tuple(_member(m, i) for i, m in enumerate(members_raw))
    names = [m.name for m in members]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ConfigError(f"suite.members: {dup!r} is listed twice")
    if all(m.budget == "matched" for m in members):
        raise ConfigError("suite.members: a matched budget needs at least one epochs member")
    tune = parse_tune(raw.get("tune"))
    stray = next((m for m in members if m.tuned is not None and tune is None), None)
    if stray is not None:
        raise ConfigError(
            f"suite.members ({stray.name}).tuned: the suite has no tune block to have chosen it"
        )
    name = raw.get("name")
    return Suite(
        name=default_name if name is None else _plain_name(name, "suite.name"),
        recipe=recipe,
        members=members,
        seeds=_seeds(raw.get("seeds"), "suite.seeds"),
        set=_strings(raw.get("set"), "suite.set"),
        tests=_strings(raw.get("tests"), "suite.tests"),
        description=_prose(raw.get("description", ""), "suite.description"),
        source=source,
        results=_line(str(raw.get("results", "")), "suite.results"),
        claims=tuple(parse_claims(raw.get("claims"), names, "suite")),
        tune=tune,
    )
