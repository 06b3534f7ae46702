"""``capsctl suite report``: a suite's finished runs aggregated per member, and the results files.

Per member and test file: top-1 mean over seeds, the sample standard deviation (``ddof=1``; 0
with one seed is reported as None), the standard error of the mean over seeds (``std /
sqrt(k)``) and the test set's own sampling error (``sqrt(p (1 - p) / N)`` for ``N`` test images,
the spread one run's accuracy has from the finite test set alone). Plus parameters, GFLOPs per
image, epochs, wall time, training images/s, the published figure where the suite names one,
and what trained the runs (commit, CPU, cores, torch).

The results files written from a report are :mod:`capsctl.suites.results_file`'s.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from capsctl.suites.claims import Difference, judge, paragraph
from capsctl.suites.pairs import Pair, resolved_pair_preset
from capsctl.suites.run_files import TESTS_FILE, epochs_trained, read_json
from capsctl.suites.spec import Member, Suite, lr_text

__all__ = [
    "MemberRow",
    "SuiteReport",
    "TestStat",
    "aggregate",
    "report_suite",
]


@dataclass
class TestStat:
    """Top-1 over seeds on one test file (fractions in [0, 1])."""

    test: str
    values: list[float]
    images: int | None = None
    metric: str | None = None  # what the accuracy is: top-1, or the multi-label data's metric

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.values) if self.values else None

    @property
    def std(self) -> float | None:
        return statistics.stdev(self.values) if len(self.values) >= 2 else None

    @property
    def se(self) -> float | None:
        """Standard error of the mean over seeds."""
        s = self.std
        return s / math.sqrt(len(self.values)) if s is not None else None

    @property
    def test_se(self) -> float | None:
        """One run's sampling error from the test set's size."""
        p = self.mean
        if p is None or not self.images:
            return None
        return math.sqrt(p * (1.0 - p) / self.images)

    def to_dict(self) -> dict[str, Any]:
        return {
            "test": self.test,
            "images": self.images,
            "metric": self.metric,
            "values": self.values,
            "top1_mean": self.mean,
            "top1_std": self.std,
            "top1_se": self.se,
            "test_se": self.test_se,
            "seeds": len(self.values),
        }


@dataclass
class MemberRow:
    member: str
    model: str
    seeds_planned: list[int]
    seeds_done: list[int]
    tests: dict[str, TestStat]
    params: int | None = None
    gflops: float | None = None
    epochs: float | None = None
    wall_s: float | None = None  # mean over the finished runs
    wall_s_total: float | None = None  # their sum: the member's machine time
    train_images_per_s: float | None = None
    budget: str = "epochs"
    lr: str | None = None  # the runs' learning rates (one, unless they differ)
    lr_chosen_on: str | None = None  # val: chosen on a validation split; recipe: as given
    shared_runs: int | None = None  # runs that shared the machine (None: no run recorded load)
    published: dict[str, str] | None = None
    note: str = ""
    machine: dict[str, Any] = field(default_factory=dict)
    robustness: dict[str, TestStat] | None = None  # summary key -> over seeds

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tests"] = {k: v.to_dict() for k, v in self.tests.items()}
        d["robustness"] = (
            None
            if self.robustness is None
            else {k: v.to_dict() for k, v in self.robustness.items()}
        )
        return d


@dataclass
class SuiteReport:
    suite: str
    folder: str
    tests: list[str]
    rows: list[MemberRow]
    description: str = ""
    #: What the report could not include (a pair left out of a test file, and why).
    notes: list[str] = field(default_factory=list)
    #: The suite's claims judged on these rows (capsctl/suites/claims.py).
    claims: list[Difference] = field(default_factory=list)
    #: Each tuned member's tuning runs and choice (capsctl/suites/tuning.py), validation only.
    tuning: list[dict[str, Any]] = field(default_factory=list)

    @property
    def wall_s_total(self) -> float | None:
        """The machine time of every finished run together (the sum of their wall times)."""
        totals = [r.wall_s_total for r in self.rows if r.wall_s_total is not None]
        return sum(totals) if totals else None

    @property
    def runs(self) -> int:
        return sum(len(r.seeds_done) for r in self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "suite": self.suite,
            "folder": self.folder,
            "description": self.description,
            "tests": self.tests,
            "rows": [r.to_dict() for r in self.rows],
            "runs": self.runs,
            "wall_s_total": self.wall_s_total,
            "notes": self.notes,
            "claims": [d.to_dict() for d in self.claims],
            "claims_text": paragraph(self.claims),
            "tuning": self.tuning,
        }


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def aggregate(runs: Sequence[dict[str, Any]], tests: Sequence[str]) -> dict[str, TestStat]:
    """Per test file, the accuracies of ``runs`` (each ``{"tests": {name: {"accuracy",
    "count"}}}``) as :class:`TestStat`; a run lacking a test is left out of that test only."""
    out: dict[str, TestStat] = {}
    for test in tests:
        values, images, metric = [], None, None
        for run in runs:
            t = (run.get("tests") or {}).get(test)
            if t is None or t.get("accuracy") is None:
                continue
            values.append(float(t["accuracy"]))
            images = int(t["count"]) if t.get("count") is not None else images
            metric = t.get("metric") or metric
        out[test] = TestStat(test, values, images, metric)
    return out


def _static(suite: Suite, member: Member, folder: Path) -> tuple[str, int | None, float | None]:
    """The member's model name, parameters and GFLOPs per image (from its preset)."""
    from capsctl.compare.flops import count_flops
    from capsctl.models import build_model_from_config, parameter_counts

    preset = resolved_pair_preset(suite, Pair(member, suite.seeds_of(member)[0], folder))
    cfg = preset.model
    name = _model_name(cfg)
    model = build_model_from_config(cfg)
    params = int(parameter_counts(model)["total"])
    gflops = count_flops(model, [cfg.in_channels, cfg.input_size, cfg.input_size])
    return name, params, gflops


def _model_name(cfg: Any) -> str:
    if cfg.arch != "capsnet":
        return f"{cfg.arch} ({cfg.backbone} backbone)" if cfg.arch == "cnn" else cfg.arch
    router = cfg.router.get("name")
    return f"capsnet {cfg.backbone}, {router}"


@dataclass
class _MemberRuns:
    """One member's finished runs as :func:`report_suite` gathers them, seed by seed."""

    robust: dict[str, TestStat]
    runs: list[dict[str, Any]] = field(default_factory=list)  # each {"tests": {name: ...}}
    seeds: list[int] = field(default_factory=list)
    lrs: list[float | None] = field(default_factory=list)
    walls: list[float] = field(default_factory=list)
    epochs: list[float] = field(default_factory=list)
    speeds: list[float] = field(default_factory=list)  # each run's mean images/s
    shared: list[bool | None] = field(default_factory=list)
    machines: list[dict[str, Any]] = field(default_factory=list)

    def add(self, seed: int, folder: Path, res: dict[str, Any], tests: dict[str, Any]) -> None:
        """A finished run: its ``results.json`` (``res``) and test scores (``tests``)."""
        self.runs.append(tests)
        self.seeds.append(seed)
        self.lrs.append(_run_lr(folder))
        self.walls.append(float(res.get("seconds", 0.0)))
        self.epochs.append(epochs_trained(res))
        hist = [h.get("images_per_s") for h in res.get("history", [])]
        hist = [float(h) for h in hist if isinstance(h, (int, float))]
        if hist:
            self.speeds.append(statistics.fmean(hist))
        self.shared.append(shared_machine(res.get("history") or []))
        self.machines += read_json(folder / "provenance.json").get("trained_by") or []

    def add_robustness(self, summary: dict[str, Any]) -> None:
        for key, stat in self.robust.items():
            if summary.get(key) is not None:
                stat.values.append(float(summary[key]))
                stat.images = summary.get("count")


def report_suite(
    suite: Suite,
    out: Path | Sequence[Path],
    *,
    score: bool = True,
    data_dir: str | None = None,
    on_event: Any = None,
    robustness: Any = None,
) -> SuiteReport:
    """Aggregate the finished runs under ``out``: a run folder of ``capsctl suite run`` or a
    ledger (:mod:`capsctl.suites.ledger`), or several, whose pairs are merged (a pair finished
    with different results in two of them is a CapsctlError). ``score``: first score the test
    files a finished run lacks, as ``capsctl suite run`` does after each run (a run without a
    checkpoint is left out of those test files, with a note); ``robustness``: a
    :class:`~capsctl.suites.robust.RobustSettings` adds FGSM, PGD and corruption columns,
    measured once per run and cached in its folder."""
    from capsctl.suites.ledger import pick_pair_folder, robustness_or_note, score_or_note
    from capsctl.suites.robust import ROBUST_METRICS

    roots = [Path(out)] if isinstance(out, (str, Path)) else [Path(o) for o in out]
    tests = list(suite.tests) or ["test"]
    tuning = tuning_states(suite, roots)
    chosen = {t["member"]: t["chosen"] for t in tuning}
    rows, notes = [], []
    for member in suite.members:
        got = _MemberRuns(robust={k: TestStat(k, []) for k in ROBUST_METRICS})
        for seed in suite.seeds_of(member):
            folder = pick_pair_folder(suite, member, seed, roots)
            if folder is None:
                continue
            label = f"{member.name} seed {seed} ({folder})"
            res = read_json(folder / "results.json")
            if suite.tests:
                score_or_note(
                    suite, folder, label, score, notes, data_dir=data_dir, on_event=on_event
                )
                got.add(seed, folder, res, read_json(folder / TESTS_FILE))
            else:
                got.add(seed, folder, res, {"tests": {"test": res["test"]}})
            if robustness is not None:
                summary = robustness_or_note(folder, label, robustness, notes, data_dir, on_event)
                got.add_robustness(summary)
        name, params, gflops = _static(suite, member, roots[0] / member.name)
        rows.append(
            MemberRow(
                member=member.name,
                model=name,
                seeds_planned=list(suite.seeds_of(member)),
                seeds_done=got.seeds,
                tests=aggregate(got.runs, tests),
                params=params,
                gflops=gflops,
                epochs=_mean(got.epochs),
                wall_s=_mean(got.walls),
                wall_s_total=sum(got.walls) if got.walls else None,
                train_images_per_s=_mean(got.speeds),
                budget=member.budget,
                lr=" ".join(sorted({lr_text(x) for x in got.lrs if x is not None})) or None,
                lr_chosen_on=_chosen_on(suite, member, got.lrs, chosen),
                shared_runs=_count_shared(got.shared),
                published=None if member.published is None else asdict(member.published),
                note=member.note,
                machine=_machine(got.machines),
                robustness=got.robust if robustness is not None else None,
            )
        )
    claims = judge_claims(suite, rows, tests)
    return SuiteReport(
        suite.name, _joined(roots), tests, rows, suite.description, notes, claims, tuning
    )


#: A run shared the machine when, as one of its epochs ended, the load average over the last
#: minute was at least this much above its CPU count: another busy process ran beside it.
SHARED_LOAD_MARGIN = 1.0


def shared_machine(history: Sequence[Mapping[str, Any]]) -> bool | None:
    """Whether a run shared its machine, from the load average its epochs recorded
    (``load_1m``, ``cpus``: capsctl/training/trainer.py); None when no epoch recorded one."""
    loads = [
        (float(h["load_1m"]), int(h["cpus"]))
        for h in history
        if isinstance(h.get("load_1m"), (int, float)) and isinstance(h.get("cpus"), int)
    ]
    if not loads:
        return None
    return any(load >= cpus + SHARED_LOAD_MARGIN for load, cpus in loads)


def _count_shared(shared: Sequence[bool | None]) -> int | None:
    """How many runs shared the machine; None when no run recorded its load."""
    return None if all(x is None for x in shared) else sum(bool(x) for x in shared)


def tuning_states(suite: Suite, roots: Sequence[Path]) -> list[dict[str, Any]]:
    """Each tuned member's tuning as found in ``roots`` (a member whose choice the suite file
    records shows that choice, with whatever tuning runs the folders hold)."""
    from capsctl.suites.tuning import member_tuning

    if suite.tune is None:
        return []
    out = []
    for m in suite.members:
        if not suite.tunes(m):
            continue
        state = member_tuning(suite, m, roots).to_dict()
        if m.tuned is not None:
            state["chosen"], state["recorded"] = m.tuned.lr, True
            state["todo"] = []
        out.append(state)
    return out


def _run_lr(folder: Path) -> float | None:
    """The learning rate the run in ``folder`` trained with (its ``preset.yaml``)."""
    from capsctl.config.yaml_io import read_preset_file

    path = folder / "preset.yaml"
    if not path.exists():
        return None
    lr = (read_preset_file(path).get("train") or {}).get("lr")
    return float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None


def _chosen_on(
    suite: Suite, member: Member, lrs: Sequence[float | None], chosen: dict[str, Any]
) -> str | None:
    """``val`` when every run of the member trained at the learning rate chosen on the
    validation split, ``recipe`` when the suite does not tune it, None when its runs are of
    another learning rate than the choice (or the choice is still to be made)."""
    if not lrs:
        return None
    if not suite.tunes(member):
        return "recipe"
    pick = chosen.get(member.name)
    if pick is None or any(x is None or lr_text(x) != lr_text(pick) for x in lrs):
        return None
    return "val"


def _joined(roots: Sequence[Path]) -> str:
    return " + ".join(str(r) for r in roots)


def judge_claims(suite: Suite, rows: Sequence[MemberRow], tests: Sequence[str]) -> list[Difference]:
    """Each claim of the suite on the members' accuracies over seeds (its test file, else the
    first of ``tests``)."""
    by_name = {r.member: r for r in rows}
    out = []
    for claim in suite.claims:
        test = claim.test or tests[0]
        a, b = (by_name[m].tests.get(test) for m in (claim.a, claim.b))
        out.append(judge(claim, test, a.values if a else [], b.values if b else []))
    return out


def _machine(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What trained a member's runs: each field's values joined (usually one each)."""
    out: dict[str, Any] = {}
    for key in ("cpu", "cores", "device", "torch_version", "commit"):
        values = sorted({str(r.get(key)) for r in records if r.get(key) is not None})
        out[key] = " + ".join(values) if values else None
    return out
