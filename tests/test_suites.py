"""Suites (capsctl/suites/): the file format, running and resuming, aggregation, results files
and the printed commands."""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import fake_finished_run, run_cli

from capsctl.config.model_refs import build_model
from capsctl.errors import CapsctlError, ConfigError
from capsctl.suites import list_suites, load_suite, pair_commands, plan_pairs, report_suite
from capsctl.suites.report import aggregate
from capsctl.suites.results_file import RESULT_COLUMNS, read_results, write_results
from capsctl.suites.runner import epochs_trained, resolved_pair_preset

# A tiny capsule net on the embedded Fashion-MNIST subset: a few seconds per run.
TINY_SET = [
    "model.primary_types=4",
    "model.layers=[{kind: conv, types: 4, pose_dim: 16, kernel: 3, stride: 2}]",
    "train.steps_per_epoch=6",
    "train.batch_size=16",
    "train.device=cpu",
    "train.epochs=3",
    "data.val_size=0",
    "log.curves=false",
]


def tiny_suite(folder: Path, steps: int = 6) -> Path:
    sets = [
        s if not s.startswith("train.steps") else f"train.steps_per_epoch={steps}" for s in TINY_SET
    ]
    text = textwrap.dedent(
        """\
        name: tiny
        description: two tiny members
        recipe: quickstart
        seeds: [0, 1]
        members:
          - name: idpa
          - name: dynamic
            set: ["model.router={name: dynamic}"]
            seeds: [0]
        """
    )
    text += "set:\n" + "".join(f"  - {json.dumps(s)}\n" for s in sets)
    path = folder / "tiny.yaml"
    path.write_text(text)
    return path


# -- the file format ---------------------------------------------------------------------------


def test_bundled_suite_loads_with_its_members() -> None:
    suite = load_suite("cifar10-fast")
    names = ["idpa", "dynamic", "em", "self", "cnn", "resnet18", "resnet18-matched"]
    assert [m.name for m in suite.members] == names
    assert suite.seeds == (0, 1, 2)
    # ResNet-18 at the members' epochs and seeds, tuned like them; its matched-time row apart
    assert suite.seeds_of(suite.member("resnet18")) == (0, 1, 2)
    assert suite.member("resnet18").budget == "epochs"
    assert suite.seeds_of(suite.member("resnet18-matched")) == (0, 1)
    assert suite.member("resnet18-matched").budget == "matched"
    assert [m.name for m in suite.members if suite.tunes(m)] == names[:-1]
    assert suite.tune is not None
    assert (suite.tune.val_size, suite.tune.epochs, suite.tune.factors) == (5000, 4, (0.5, 1, 2))
    assert suite.tests == ("test-lossless-1k", "test-jpeg")


def test_the_cifar10_fast_suite_pins_its_recipe() -> None:
    # The frozen copy of cifar10-caps-fast (2026-12-06): its settings typed here, so that an
    # edit to the pinned recipe, which would move the comparison, fails.
    suite = load_suite("cifar10-fast")
    assert suite.recipe == "cifar10-caps-fast-pinned"
    p = resolved_pair_preset(suite, plan_pairs(suite, Path("unused"))[0])
    assert (p.model.backbone, p.model.router["name"]) == ("fast", "idpa")
    t = p.train
    assert (t.epochs, t.time_limit, t.batch_size, t.optimizer, t.lr) == (8, None, 256, "sgd", 0.2)
    assert (t.momentum, t.nesterov, t.weight_decay) == (0.9, True, 0.0005)
    assert (t.schedule, t.label_smoothing, t.amp) == ("onecycle", 0.2, False)
    assert (p.data.dataset, p.data.val_size) == ("cifar10", 0)
    assert (p.data.augment.crop_padding, p.data.augment.hflip) == (2, True)
    assert p.data.augment.test_flip is True


def test_the_multimnist_suite_tunes_on_its_grid_for_ten_epochs() -> None:
    suite = load_suite("multimnist")
    assert suite.tune is not None
    assert suite.tune.grid == (0.001, 0.002, 0.004, 0.008) and suite.tune.epochs == 3
    p = resolved_pair_preset(suite, plan_pairs(suite, Path("unused"))[0])
    assert p.train.epochs == 10 and suite.seeds == (0, 1, 2)


@pytest.mark.parametrize("name", [n for n, _ in list_suites()])
def test_every_member_of_a_bundled_suite_builds(name: str) -> None:
    # A member's overrides must name registered models and known fields: a typo here only
    # surfaces when the suite reaches that member, maybe hours into a run.
    suite = load_suite(name)
    for pair in plan_pairs(suite, Path("unused")):
        preset = resolved_pair_preset(suite, pair)
        model = build_model(preset.model)
        assert sum(p.numel() for p in model.parameters()) > 0, (name, pair.member.name)


@pytest.mark.parametrize("name", [n for n, _ in list_suites()])
def test_every_bundled_suite_pins_its_precision(name: str) -> None:
    # train.amp: auto would train a suite's runs in bf16 on one machine and float32 on another,
    # and a suite resumed elsewhere would mix the two: every bundled suite names its precision
    suite = load_suite(name)
    for pair in plan_pairs(suite, Path("unused")):
        assert resolved_pair_preset(suite, pair).train.amp is False, (name, pair.member.name)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "empty"),
        ("recipe: quickstart\nseeds: [0]\nmembers: []\n", "suite.members"),
        ("recipe: quickstart\nseeds: [0, 0]\nmembers: [a]\n", "suite.seeds"),
        ("recipe: quickstart\nseeds: [0]\nmembers: [{name: a, colour: red}]\n", "colour"),
        ("recipe: quickstart\nseeds: [0]\nmembers: [{name: ../a}]\n", "name"),
        ("recipe: quickstart\nseeds: [0]\nmembers: [{name: a, budget: matched}]\n", "budget"),
    ],
)
def test_bad_suite_files_name_the_field(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        load_suite(path)


def test_plan_runs_every_member_first_seed_before_any_second(tmp_path: Path) -> None:
    suite = load_suite("cifar10-fast")
    pairs = plan_pairs(suite, tmp_path)
    labels = [p.label for p in pairs]
    assert labels[:5] == [f"{m} seed 0" for m in ("idpa", "dynamic", "em", "self", "cnn")]
    # matched members last
    assert labels[-2:] == ["resnet18-matched seed 0", "resnet18-matched seed 1"]
    assert len(pairs) == 6 * 3 + 2
    only = plan_pairs(suite, tmp_path, only=["em"], seeds=[2])
    assert [(p.member.name, p.seed, p.folder) for p in only] == [("em", 2, tmp_path / "em/seed-2")]
    with pytest.raises(CapsctlError, match="--only nope"):
        plan_pairs(suite, tmp_path, only=["nope"])


# -- aggregation and results files -------------------------------------------------------------


def test_aggregation_against_typed_numbers() -> None:
    runs = [
        {"tests": {"a": {"accuracy": 0.90, "count": 1000}, "b": {"accuracy": 0.80, "count": 50}}},
        {"tests": {"a": {"accuracy": 0.92, "count": 1000}}},
        {"tests": {"a": {"accuracy": 0.94, "count": 1000}, "b": {"accuracy": 0.84, "count": 50}}},
    ]
    stats = aggregate(runs, ["a", "b"])
    a, b = stats["a"], stats["b"]
    assert a.mean == pytest.approx(0.92)
    assert a.std == pytest.approx(0.02)  # sample std (ddof 1) of 0.90, 0.92, 0.94
    assert a.se == pytest.approx(0.02 / math.sqrt(3))
    assert a.test_se == pytest.approx(math.sqrt(0.92 * 0.08 / 1000))
    assert len(a.values) == 3
    assert b.mean == pytest.approx(0.82)  # the run without b is left out of b only
    assert b.std == pytest.approx(0.028284271247)
    single = aggregate([runs[1]], ["a"])["a"]
    assert single.mean == pytest.approx(0.92) and single.std is None and single.se is None


def test_epochs_count_the_part_of_an_epoch_a_time_limit_cut_short() -> None:
    """A matched member stopped by its time limit 27 steps of 256 images into its second epoch
    of 195 steps trained 1 + 6,912 / 49,920 epochs, not 2; older records without ``images``
    give it as rate x time."""
    whole = {"epoch": 1, "images": 49_920, "images_per_s": 31.6, "epoch_seconds": 1579.7}
    cut = {"epoch": 2, "images": 6_912, "images_per_s": 36.7, "epoch_seconds": 188.3}
    res = {"epochs_done": 2, "history": [whole, cut | {"time_limit": True}]}
    assert epochs_trained(res) == pytest.approx(1.138462, abs=1e-6)
    old = {"epochs_done": 2, "history": [
        {"epoch": 1, "images_per_s": 32.0, "epoch_seconds": 1560.0},
        {"epoch": 2, "images_per_s": 36.0, "epoch_seconds": 192.0, "time_limit": True},
    ]}  # fmt: skip
    assert epochs_trained(old) == pytest.approx(1 + 6912 / 49920, abs=1e-6)
    # a whole last epoch (the limit ran out in validation) and an uncut run count whole
    full = {"epochs_done": 2, "history": [whole, whole | {"epoch": 2, "time_limit": True}]}
    assert epochs_trained(full) == 2.0
    assert epochs_trained({"epochs_done": 8, "history": [whole] * 8}) == 8.0
    # one cut epoch and nothing to measure it by: its count as recorded
    assert epochs_trained({"epochs_done": 1, "history": [cut | {"time_limit": True}]}) == 1.0


def test_report_and_results_file_round_trip(tmp_path: Path) -> None:
    suite_file = tmp_path / "s.yaml"
    suite_file.write_text(
        "name: s\nrecipe: quickstart\nseeds: [0, 1]\ntests: [t1]\nmembers:\n"
        "  - name: caps\n    published: {top1: '0.9', source: somewhere}\n"
        "  - name: cnn\n    set: [model=mnist-cnn]\n"
    )
    suite = load_suite(suite_file)
    runs = tmp_path / "runs"
    fake_finished_run(runs / "caps/seed-0", 10.0, {"t1": (0.75, 200)}, checkpoints=False)
    fake_finished_run(runs / "caps/seed-1", 30.0, {"t1": (0.85, 200)}, checkpoints=False)
    fake_finished_run(runs / "cnn/seed-1", 50.0, {"t1": (0.60, 200)}, checkpoints=False)
    report = report_suite(suite, runs, score=False)
    caps, cnn = report.rows
    assert caps.seeds_done == [0, 1] and cnn.seeds_done == [1]
    assert caps.tests["t1"].mean == pytest.approx(0.80)
    assert caps.tests["t1"].std == pytest.approx(math.sqrt(0.005))
    assert caps.wall_s == pytest.approx(20.0) and caps.train_images_per_s == pytest.approx(200.0)
    assert caps.wall_s_total == pytest.approx(40.0) and cnn.wall_s_total == pytest.approx(50.0)
    assert report.wall_s_total == pytest.approx(90.0) and report.runs == 3
    assert report.to_dict()["wall_s_total"] == pytest.approx(90.0)
    assert caps.params and caps.params > 0 and caps.gflops and caps.gflops > 0
    assert caps.published == {"top1": "0.9", "source": "somewhere", "setting": ""}

    path = tmp_path / "results.csv"
    write_results(report, path)
    header = path.read_text().splitlines()[0]
    assert header == (
        "suite,member,model,test_set,test_images,metric,top1_mean,top1_std,top1_se,test_se,seeds,"
        "seeds_run,epochs,wall_s,train_images_per_s,params,gflops,budget,lr,lr_chosen_on,cpu,cores,"
        "shared_runs,"
        "device,torch,commit,note"
    )
    assert tuple(header.split(",")) == RESULT_COLUMNS
    rows = read_results(path)
    assert [(r["member"], r["test_set"]) for r in rows] == [("caps", "t1"), ("cnn", "t1")]
    assert rows[0]["top1_mean"] == pytest.approx(0.80)
    assert rows[0]["top1_std"] == pytest.approx(math.sqrt(0.005))
    assert rows[0]["seeds"] == "0 1" and rows[0]["seeds_run"] == 2
    assert rows[0]["params"] == caps.params
    assert rows[1]["top1_std"] is None  # one seed: no spread
    with pytest.raises(CapsctlError, match="--overwrite"):
        write_results(report, path)
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not a capsctl results file"):
        read_results(bad)


def _one_member_suite(tmp_path: Path, walls: tuple[float, float]) -> tuple[Path, Path]:
    """A suite file of one member, caps, and its two finished runs (seeds 0 and 1, 75% and 85%
    on t1, ``walls`` seconds each, no checkpoints)."""
    suite_file = tmp_path / "s.yaml"
    suite_file.write_text(
        "name: s\nrecipe: quickstart\nseeds: [0, 1]\ntests: [t1]\nmembers:\n  - name: caps\n"
    )
    runs = tmp_path / "runs"
    for seed, (wall, acc) in enumerate(zip(walls, (0.75, 0.85), strict=True)):
        fake_finished_run(runs / f"caps/seed-{seed}", wall, {"t1": (acc, 200)}, checkpoints=False)
    return suite_file, runs


def test_report_sums_the_runs_machine_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    suite_file, runs = _one_member_suite(tmp_path, (5400.0, 1800.0))
    args = ["suite", "report", str(runs), "--suite", str(suite_file), "--no-score"]
    code, _, err = run_cli(capsys, args)
    assert code == 0, err
    assert "machine time: 2.0 h over 2 runs" in err
    from capsctl.views.common import fmt_duration

    assert [fmt_duration(s) for s in (35.0, 2400.0, 27_720.0)] == ["35 s", "40 min", "7.7 h"]
    code, out, err = run_cli(capsys, [*args, "--json"])
    assert json.loads(out)["wall_s_total"] == pytest.approx(7200.0)


def test_report_refuses_a_folder_without_its_suite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(capsys, ["suite", "report", str(tmp_path)])
    assert code == 2
    assert "suite.yaml" in err and "--suite" in err


# -- running, interrupting, resuming -----------------------------------------------------------


def _accuracies(folder: Path) -> dict[str, float]:
    out = {}
    for res in sorted(folder.glob("*/seed-*/results.json")):
        out[str(res.parent.relative_to(folder))] = json.loads(res.read_text())["test"]["accuracy"]
    return out


@pytest.mark.slow
def test_tiny_suite_killed_mid_run_resumes_and_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    suite = tiny_suite(tmp_path, steps=12)
    whole, broken = tmp_path / "whole", tmp_path / "broken"

    code, _, err = run_cli(capsys, ["suite", "run", str(suite), "--out", str(whole)])
    assert code == 0, err
    expected = _accuracies(whole)
    assert sorted(expected) == ["dynamic/seed-0", "idpa/seed-0", "idpa/seed-1"]

    # kill -9 a suite in its second pair, once that pair has a checkpoint (and has named the
    # commit that started it)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "capsctl", "suite", "run", str(suite), "--out", str(broken)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    second = broken / "dynamic/seed-0/last.safetensors"
    named = second.with_name("provenance.json")
    deadline = time.monotonic() + 240
    while not named.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert second.exists(), "the suite ended before its second pair had a checkpoint"
    assert not (broken / "dynamic/seed-0/results.json").exists()
    first_done = broken / "idpa/seed-0/results.json"
    stamp = first_done.stat().st_mtime_ns

    events: list[dict[str, object]] = []
    from capsctl.suites import run_suite

    run_suite(load_suite(suite), broken, on_event=events.append)
    statuses = {(e["member"], e["seed"]): e["status"] for e in events if e["event"] == "suite_pair"}
    assert statuses == {("idpa", 0): "done", ("dynamic", 0): "partial", ("idpa", 1): "new"}
    assert first_done.stat().st_mtime_ns == stamp  # the finished pair was skipped
    assert _accuracies(broken) == expected  # the resumed run ends as the uninterrupted one

    code, out, err = run_cli(capsys, ["suite", "report", str(broken), "--json"])
    assert code == 0, err
    doc = json.loads(out)
    rows = {r["member"]: r for r in doc["rows"]}
    assert rows["idpa"]["seeds_done"] == [0, 1]
    idpa = rows["idpa"]["tests"]["test"]
    accs = [expected["idpa/seed-0"], expected["idpa/seed-1"]]
    assert idpa["top1_mean"] == pytest.approx(sum(accs) / 2)
    trained = json.loads((broken / "dynamic/seed-0/provenance.json").read_text())["trained_by"]
    # the killed process named its commit with its first checkpoint; the resumed one added its
    assert [t["resumed"] for t in trained] == [False, True]


@pytest.mark.slow
def test_printed_command_reruns_one_pair_identically(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    suite_path = tiny_suite(tmp_path)
    suite = load_suite(suite_path)
    code, _, err = run_cli(
        capsys,
        ["suite", "run", str(suite_path), "--out", str(tmp_path / "a"), "--only", "dynamic"],
    )
    assert code == 0, err
    code, out, err = run_cli(
        capsys,
        ["suite", "run", str(suite_path), "--out", str(tmp_path / "b"), "--print-commands"],
    )
    assert code == 0, err
    lines = out.splitlines()
    assert lines == pair_commands(suite, tmp_path / "b")
    assert len(lines) == 3
    line = next(line for line in lines if "/dynamic/seed-0" in line)
    words = shlex.split(line)
    assert words[:2] == ["capsctl", "train"]
    code, _, err = run_cli(capsys, words[1:])
    assert code == 0, err
    a, b = tmp_path / "a/dynamic/seed-0", tmp_path / "b/dynamic/seed-0"
    assert (a / "preset.yaml").read_text() == (b / "preset.yaml").read_text()
    from safetensors.torch import load_file

    wa, wb = load_file(a / "best.safetensors"), load_file(b / "best.safetensors")
    assert wa.keys() == wb.keys()
    assert all(bool((wa[k] == wb[k]).all()) for k in wa)
    assert _accuracies(tmp_path / "a") == _accuracies(tmp_path / "b")


def test_a_folder_of_another_preset_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    suite_path = tiny_suite(tmp_path)
    folder = tmp_path / "out/idpa/seed-0"
    folder.mkdir(parents=True)
    (folder / "preset.yaml").write_text("name: other\nmodel: mnist-caps\n")
    code, _, err = run_cli(
        capsys, ["suite", "run", str(suite_path), "--out", str(tmp_path / "out")]
    )
    assert code == 1
    assert str(folder) in err and "another preset" in err and "choose another --out" in err


def test_report_adds_robustness_measured_once_per_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import capsctl.robustness as robustness
    from capsctl.suites.robust import RobustSettings

    suite_file, runs = _one_member_suite(tmp_path, (10.0, 30.0))
    for seed in (0, 1):  # weights to measure (the measurement itself is faked)
        (runs / f"caps/seed-{seed}/best.safetensors").write_bytes(b"")
    calls: list[tuple[str, int | None]] = []
    values = {"seed-0": (0.30, 0.10, 0.60), "seed-1": (0.40, 0.20, 0.70)}

    def summary(path: Path, *, limit: int | None, **kw: object) -> dict[str, object]:
        calls.append((Path(path).parent.name, limit))
        fgsm, pgd, corr = values[Path(path).parent.name]
        return {"count": limit, "fgsm_8_255_accuracy": fgsm, "pgd_8_255_accuracy": pgd,
                "mean_corruption_accuracy": corr}  # fmt: skip

    monkeypatch.setattr(robustness, "robustness_summary", summary)
    suite = load_suite(suite_file)
    settings = RobustSettings(limit=50, corruption_limit=50)
    row = report_suite(suite, runs, score=False, robustness=settings).rows[0]
    assert row.robustness is not None
    assert row.robustness["fgsm_8_255_accuracy"].mean == pytest.approx(0.35)
    assert row.robustness["pgd_8_255_accuracy"].std == pytest.approx(math.sqrt(0.005))
    assert row.robustness["mean_corruption_accuracy"].mean == pytest.approx(0.65)
    assert sorted(calls) == [("seed-0", 50), ("seed-1", 50)]
    report_suite(suite, runs, score=False, robustness=settings)
    assert len(calls) == 2  # cached in each run's robustness.json
    report_suite(suite, runs, score=False, robustness=RobustSettings(limit=20))
    assert len(calls) == 4  # other settings are measured anew
    assert report_suite(suite, runs, score=False).rows[0].robustness is None


def test_a_run_records_the_commit_it_started_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkout may move on while a run trains: its provenance names the commit of the code
    that started it, not the one checked out when it ended."""
    from capsctl.suites import pair_run, runner

    checkout = {"commit": "started-here"}
    monkeypatch.setattr(pair_run, "provenance", lambda: dict(checkout))

    def moves_on(e: dict) -> None:  # a commit lands while the run trains
        if e["event"] == "step":
            checkout["commit"] = "checked-out-later"

    suite = load_suite(tiny_suite(tmp_path))
    runner.run_suite(
        suite, tmp_path / "out", only=["dynamic"], handle_sigint=False, on_event=moves_on
    )
    doc = json.loads((tmp_path / "out/dynamic/seed-0/provenance.json").read_text())
    assert [t["commit"] for t in doc["trained_by"]] == ["started-here"]


def test_report_pictures_with_error_bars_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    from capsctl.suites import plot

    suite_file = tmp_path / "s.yaml"
    suite_file.write_text(
        "name: s\nrecipe: quickstart\nseeds: [0, 1]\ntests: [t1]\nmembers:\n  - name: caps\n"
        "  - name: cnn\n    set: [model=mnist-cnn]\n    budget: matched\n"
    )
    runs = tmp_path / "runs"
    fake_finished_run(runs / "caps/seed-0", 10.0, {"t1": (0.75, 200)}, checkpoints=False)
    fake_finished_run(runs / "caps/seed-1", 30.0, {"t1": (0.85, 200)}, checkpoints=False)
    fake_finished_run(runs / "cnn/seed-0", 50.0, {"t1": (0.60, 200)}, checkpoints=False)
    pics = tmp_path / "pics"
    args = ["suite", "report", str(runs), "--suite", str(suite_file), "--no-score",
            "--png", str(pics), "--json"]  # fmt: skip
    code, out, err = run_cli(capsys, args)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["png"] == [
        str(pics / "s-accuracy-vs-params.png"),
        str(pics / "s-accuracy-vs-gflops.png"),
    ]
    assert all(Path(p).read_bytes().startswith(b"\x89PNG") for p in doc["png"])
    caps, cnn = plot.points(doc, "params")
    assert caps.label == "caps" and caps.top1 == pytest.approx(80.0)
    assert caps.std == pytest.approx(100 * math.sqrt(0.005)) and caps.x == doc["rows"][0]["params"]
    assert cnn.label == f"cnn ({doc['rows'][1]['epochs']:.1f} epochs, matched time)"
    assert cnn.std == 0.0  # one seed: no bar

    def no_work(*a: object, **k: object) -> None:
        raise AssertionError("scored before refusing the pictures")

    monkeypatch.setattr("capsctl.suites.report_suite", no_work)
    code, _, err = run_cli(capsys, args)
    assert code == 2 and "already exists" in err and "--overwrite" in err
    (tmp_path / "file").write_text("")
    code, _, err = run_cli(capsys, [*args[:-3], "--png", str(tmp_path / "file"), "--json"])
    assert code == 2 and "not a folder" in err


def test_plot_labels_spread_apart_only_where_they_would_touch() -> None:
    from capsctl.suites.plot import label_offsets, spread

    assert spread([0.0, 50.0, 100.0], 10.0) == [0.0, 50.0, 100.0]  # already apart: unmoved
    # Two labels 4 apart, gap 10: both move 3 away from their middle (least squares).
    assert spread([100.0, 104.0], 10.0) == pytest.approx([97.0, 107.0])
    # Order kept, and the input order need not be sorted.
    assert spread([104.0, 100.0, 102.0], 10.0) == pytest.approx([112.0, 92.0, 102.0])
    # The cifar10-fast picture's column: cnn 90.23, dynamic 89.67, idpa 89.40 (in points).
    ys = [90.23 * 4, 89.67 * 4, 89.40 * 4, 87.03 * 4]
    moved = spread(ys, 10.0)
    assert all(abs(a - b) >= 10.0 - 1e-9 for i, a in enumerate(moved) for b in moved[:i])
    assert sorted(range(4), key=lambda i: moved[i]) == sorted(range(4), key=lambda i: ys[i])
    # Farther apart horizontally than the left label is wide: they cannot touch, nothing moves.
    assert label_offsets([(0.0, 100.0), (50.0, 101.0)], [40.0, 40.0], 10.0) == [0.0, 0.0]
    assert label_offsets([(50.0, 100.0), (0.0, 101.0)], [90.0, 40.0], 10.0) == [0.0, 0.0]
    # The left label (60 wide) reaches over the right point: spread; a third point far right
    # at the same height stays.
    dys = label_offsets([(0.0, 100.0), (50.0, 101.0), (500.0, 100.0)], [60.0] * 3, 10.0)
    assert dys == pytest.approx([-4.5, 4.5, 0.0])


def test_report_counts_the_runs_that_shared_the_machine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    suite_file, runs = _one_member_suite(tmp_path, (100.0, 100.0))
    args = ["suite", "report", str(runs), "--suite", str(suite_file), "--no-score", "--json"]
    code, out, err = run_cli(capsys, args)
    assert code == 0, err
    assert json.loads(out)["rows"][0]["shared_runs"] is None  # no epoch recorded a load
    # seed 0 alone on its 2 CPUs (load 2.4), seed 1 beside another process in one epoch (3.0)
    for seed, loads in [(0, (2.4, 1.9)), (1, (2.0, 3.0))]:
        path = runs / f"caps/seed-{seed}/results.json"
        res = json.loads(path.read_text())
        for h, load in zip(res["history"], loads, strict=True):
            h |= {"load_1m": load, "cpus": 2}
        path.write_text(json.dumps(res))
    code, out, err = run_cli(capsys, args)
    assert code == 0, err
    assert json.loads(out)["rows"][0]["shared_runs"] == 1
    code, _, err = run_cli(capsys, args[:-1])
    assert code == 0, err
    assert "shared the machine" in err and "caps 1" in err
    results = tmp_path / "r.csv"
    code, _, err = run_cli(capsys, [*args[:-1], "--results", str(results)])
    assert code == 0, err
    assert read_results(results)[0]["shared_runs"] == 1


def test_the_matched_time_is_the_median_of_the_capsule_members_runs_alone(tmp_path: Path) -> None:
    """``resnet18-matched`` stops at the capsule networks' median wall time: the CNN and
    ResNet-18, trained at the members' epochs too, do not move it."""
    from capsctl.suites.pairs import matched_budget

    suite = load_suite("cifar10-fast")
    out = tmp_path / "suite"
    for member, seconds in (("idpa", 100.0), ("dynamic", 200.0), ("em", 300.0)):
        fake_finished_run(out / member / "seed-0", seconds, {})
    fake_finished_run(out / "cnn" / "seed-0", 10.0, {})
    fake_finished_run(out / "cnn" / "seed-1", 11.0, {})
    fake_finished_run(out / "resnet18" / "seed-0", 9000.0, {})
    assert matched_budget(suite, out) == 200.0
