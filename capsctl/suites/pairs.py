"""A suite's (member, seed) pairs: planned (:func:`plan_pairs`), each one's preset and
overrides, and checked before anything trains (:func:`check_suite`: the member's preset and
model, the folder's preset and run files); where a pair stands (:func:`pair_status`), and a
matched member's time limit (:func:`matched_budget`). Nothing here trains."""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capsctl.errors import CapsctlError, UsageError
from capsctl.suites.run_files import TESTS_FILE, check_run_files, is_finished, read_json
from capsctl.suites.spec import Member, Suite, lr_text

__all__ = [
    "Pair",
    "awaiting_tuning",
    "check_folder_is_pair",
    "check_suite",
    "matched_budget",
    "missing_tests",
    "pair_overrides",
    "pair_status",
    "plan_pairs",
    "resolved_pair_preset",
    "tune_relpath",
]

#: Preset fields that may differ between a pair's folder and the suite without it being another
#: run: where the data lives, the device, and a matched member's measured time limit.
_FREE_FIELDS = (("data", "data_dir"), ("data", "download"), ("train", "device"))


@dataclass(frozen=True)
class Pair:
    """One run of a suite: a member's seed (``lr``: its chosen learning rate where it is not
    the suite file's), or with ``tuning``, a tuning run of the member at learning rate ``lr``
    (:mod:`capsctl.suites.tuning`)."""

    member: Member
    seed: int
    folder: Path
    lr: float | None = None
    tuning: bool = False

    @property
    def label(self) -> str:
        if self.tuning and self.lr is not None:
            return f"{self.member.name} lr {lr_text(self.lr)} (tuning)"
        return f"{self.member.name} seed {self.seed}"

    @property
    def relpath(self) -> Path:
        """The pair's folder inside a suite folder or ledger."""
        if self.tuning and self.lr is not None:
            return tune_relpath(self.member.name, self.lr)
        return Path(self.member.name, f"seed-{self.seed}")


def tune_relpath(member: str, lr: float) -> Path:
    """A tuning run's folder inside a suite folder or ledger: ``tune/<member>/lr-<lr>``."""
    return Path("tune", member, f"lr-{lr_text(lr)}")


def plan_pairs(
    suite: Suite,
    out: Path,
    only: Sequence[str] = (),
    seeds: Sequence[int] = (),
    lrs: Mapping[str, float] | None = None,
) -> list[Pair]:
    """The suite's pairs in running order (seed by seed, so that every member has a first seed
    before any has a second; matched members last), restricted to ``only`` and ``seeds``;
    ``lrs``: learning rates chosen by tuning runs, by member (for members whose choice the
    suite file does not record yet)."""
    members = [suite.member(n) for n in only] if only else list(suite.members)
    known = {s for m in members for s in suite.seeds_of(m)}
    for s in seeds:
        if s not in known:
            raise UsageError(
                f"--seeds {s}: not a seed of the chosen members; they have "
                f"{', '.join(str(k) for k in sorted(known))}"
            )
    chosen = lrs or {}
    pairs = [
        Pair(m, s, out / m.name / f"seed-{s}", chosen.get(m.name))
        for m in members
        for s in suite.seeds_of(m)
        if not seeds or s in seeds
    ]
    order = {m.name: i for i, m in enumerate(suite.members)}
    return sorted(
        pairs,
        key=lambda p: (
            p.member.budget == "matched",
            suite.seeds_of(p.member).index(p.seed),
            order[p.member.name],
        ),
    )


def resolved_pair_preset(suite: Suite, pair: Pair, time_limit: float | None = None) -> Any:
    """The :class:`~capsctl.config.Preset` a pair trains (with a matched member's time limit);
    an error names the member."""
    from capsctl.config import load_preset

    overrides = pair_overrides(suite, pair)
    if time_limit is not None:
        overrides.append(f"train.time_limit={time_limit:.0f}")
    try:
        return load_preset(suite.recipe, overrides)
    except CapsctlError as e:
        raise _of_member(e, suite, pair.member) from None


def pair_overrides(suite: Suite, pair: Pair) -> list[str]:
    """The ``--set`` overrides of ``pair`` (a tuning run's, or a seed's)."""
    if pair.tuning and pair.lr is not None:
        return suite.tune_overrides(pair.member, pair.lr)
    return suite.overrides(pair.member, pair.seed, pair.lr)


def _is_capsule_net(suite: Suite, member: Member) -> bool:
    """Whether ``member`` trains a capsule network (its resolved preset's model)."""
    from capsctl.config import load_preset

    preset = load_preset(suite.recipe, suite.overrides(member, suite.seeds_of(member)[0], None))
    return bool(preset.model.arch == "capsnet")


def _of_member(error: CapsctlError, suite: Suite, member: Member) -> CapsctlError:
    """``error`` as one line that names the suite's member it is about."""
    message = f"suite {suite.name}, member {member.name}: {error}"
    if isinstance(error, UsageError):
        return type(error)(message)
    return CapsctlError(message, exit_code=error.exit_code)


def check_suite(suite: Suite, pairs: Sequence[Pair]) -> None:
    """Refuse, before the first run starts, what would stop the suite at a pair's turn, maybe
    hours in: a member whose preset does not resolve (its ``set:`` against the schema, its
    model registered and built, without weights, on the meta device), a pair folder of another
    preset or a damaged run file. Errors name the member or the file."""
    import torch

    from capsctl.models import build_model_from_config

    built: set[str] = set()
    for pair in pairs:
        preset = resolved_pair_preset(suite, pair)
        if pair.member.name not in built:
            try:
                with torch.device("meta"):  # the layers' shapes: no memory, no time
                    build_model_from_config(preset.model)
            except CapsctlError as e:
                raise _of_member(e, suite, pair.member) from None
            built.add(pair.member.name)
        if not awaiting_tuning(suite, pair):  # its preset is not known before its tuning
            check_folder_is_pair(suite, pair)
        check_run_files(pair.folder)


def awaiting_tuning(suite: Suite, pair: Pair) -> bool:
    """Whether ``pair`` is a run of a member whose learning rate is still to be chosen (the
    suite tunes it, its file records no choice, and no tuning run has made one)."""
    return (
        not pair.tuning
        and pair.lr is None
        and suite.tunes(pair.member)
        and pair.member.tuned is None
    )


def _comparable(preset_dict: dict[str, Any], matched: bool) -> dict[str, Any]:
    out = json.loads(json.dumps(preset_dict, default=str))
    for section, key in _FREE_FIELDS:
        out.get(section, {}).pop(key, None)
    if matched:
        out.get("train", {}).pop("time_limit", None)
    out.pop("description", None)
    out.pop("restored_from", None)  # a record's note on where it was restored from
    return out


def _stored_preset(folder: Path) -> dict[str, Any] | None:
    """The folder's preset with the defaults of fields added since it was written filled in
    (so that a new field does not make every earlier run another preset)."""
    from capsctl.config import preset_from_dict, preset_to_dict
    from capsctl.config.yaml_io import read_preset_file

    path = folder / "preset.yaml"
    if not path.exists():
        return None
    raw = read_preset_file(path)  # a damaged one is a one-line error naming it
    try:
        return preset_to_dict(preset_from_dict(raw))
    except CapsctlError:
        return raw  # not a valid preset today: compared as written, and so refused


def check_folder_is_pair(suite: Suite, pair: Pair) -> None:
    """Refuse a pair folder that holds a run of another preset (a changed suite or recipe)."""
    from capsctl.config import preset_to_dict

    stored = _stored_preset(pair.folder)
    if stored is None:
        return
    want = preset_to_dict(resolved_pair_preset(suite, pair))
    matched = pair.member.budget == "matched"
    if _comparable(stored, matched) != _comparable(want, matched):
        diff = _first_difference(_comparable(stored, matched), _comparable(want, matched))
        raise CapsctlError(
            f"{pair.folder}: holds a run of another preset than suite {suite.name}'s "
            f"{pair.label} ({diff}); move that folder away or choose another --out"
        )


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))
    return f"{path}: {_short(a)} in the folder, {_short(b)} in the suite"


def _short(value: Any) -> str:
    """``value``'s repr cut to 40 characters (an error message stays one short line)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def pair_status(suite: Suite, pair: Pair) -> str:
    """``done``, ``scored``, ``partial`` or ``new`` (see the module docstring)."""
    f = pair.folder
    if (f / "results.json").exists():
        return "done" if missing_tests(suite, f) == [] else "scored"
    if (f / "last.safetensors").exists():
        return "partial"
    return "new"


def missing_tests(suite: Suite, folder: Path) -> list[str]:
    """The suite's test files the run in ``folder`` is not scored on (``tests.json``)."""
    have = read_json(folder / TESTS_FILE).get("tests", {})
    return [t for t in suite.tests if t not in have]


def matched_budget(suite: Suite, out: Path) -> float | None:
    """The median wall time (s) of the finished runs of the suite's capsule members (its
    ``epochs`` members whose model is a capsule network) in ``out``; None while none has
    finished. The baselines trained at the members' epochs (a CNN, ResNet-18) do not count:
    the matched member is stopped at the capsule networks' time."""
    times = []
    for m in suite.members:
        if m.budget != "epochs" or not _is_capsule_net(suite, m):
            continue
        for s in suite.seeds_of(m):
            res = read_json(out / m.name / f"seed-{s}" / "results.json")
            if isinstance(res.get("seconds"), (int, float)) and is_finished(res):
                times.append(float(res["seconds"]))
    return statistics.median(times) if times else None
