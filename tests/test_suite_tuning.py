"""Learning rates chosen on a validation split (capsctl/suites/tuning.py): the suite file's
``tune:`` block, the choice over a grid that grows past its edges, and a tiny suite tuned,
run, reported and archived end to end."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from conftest import run_cli
from test_suites import TINY_SET

from capsctl.config import load_preset
from capsctl.errors import ConfigError, UsageError
from capsctl.suites import load_suite, pair_commands, plan_pairs
from capsctl.suites.pairs import tune_relpath
from capsctl.suites.results_file import read_results
from capsctl.suites.tuning import chosen_lrs, member_tuning, tune_pairs, tuned_members

# The suites' own learning rate (their ``set``): the grid is built around it.
OWN_LR = 0.002


def _suite_file(folder: Path, tune: str, members: str, sets: list[str] | None = None) -> Path:
    text = "name: tuned\nrecipe: quickstart\nseeds: [0]\n" + textwrap.dedent(members)
    text += textwrap.dedent(tune)
    sets = [*(sets or []), f"train.lr={OWN_LR}"]
    text += "set:\n" + "".join(f"  - {json.dumps(s)}\n" for s in sets)
    path = folder / "tuned.yaml"
    path.write_text(text)
    return path


TUNE_BLOCK = """\
tune:
  val_size: 100
  epochs: 1
"""

TWO_MEMBERS = """\
members:
  - name: idpa
  - name: dynamic
    set: ["model.router={name: dynamic}"]
    tune: false
"""


def test_the_tune_block_and_its_defaults(tmp_path: Path) -> None:
    suite = load_suite(str(_suite_file(tmp_path, TUNE_BLOCK, TWO_MEMBERS)))
    assert suite.tune is not None
    assert (suite.tune.val_size, suite.tune.epochs, suite.tune.seed) == (100, 1, 0)
    assert suite.tune.factors == (0.5, 1.0, 2.0)
    assert (suite.tune.extend, suite.tune.step) == (2, 2.0)
    assert [m.name for m in tuned_members(suite)] == ["idpa"]
    with pytest.raises(UsageError, match="dynamic.*tune: false"):
        tuned_members(suite, ["dynamic"])
    # A tuning run holds out the validation split, trains the tuning epochs and never tests.
    over = suite.tune_overrides(suite.member("idpa"), 0.004)
    preset = load_preset(suite.recipe, over)
    assert (preset.data.val_size, preset.train.epochs, preset.train.lr) == (100, 1, 0.004)
    assert preset.train.final_test is False


@pytest.mark.parametrize(
    ("tune", "members", "needle"),
    [
        ("tune: 3\n", TWO_MEMBERS, "suite.tune: must be a mapping"),
        ("tune: {epochs: 1}\n", TWO_MEMBERS, "suite.tune.val_size: missing"),
        ("tune: {val_size: 10, epochs: 0}\n", TWO_MEMBERS, "suite.tune.epochs"),
        ("tune: {val_size: 10, epochs: 1, factors: [1, 1]}\n", TWO_MEMBERS, "twice"),
        ("tune: {val_size: 10, epochs: 1, factors: [-1]}\n", TWO_MEMBERS, "positive"),
        ("tune: {val_size: 10, epochs: 1, step: 1}\n", TWO_MEMBERS, "above 1"),
        ("tune: {val_size: 10, epochs: 1, grids: [1]}\n", TWO_MEMBERS, "unknown field"),
        (
            TUNE_BLOCK,
            "members:\n  - name: idpa\n    tuned: {lr: 0.003, grid: [0.001, 0.002]}\n",
            "is not in its grid",
        ),
        (TUNE_BLOCK, "members:\n  - name: idpa\n    tuned: {lr: 0.002}\n", "needs lr and grid"),
        (TUNE_BLOCK, "members:\n  - name: idpa\n    tune: maybe\n", "use true or false"),
        (
            "",
            "members:\n  - name: idpa\n    tuned: {lr: 0.002, grid: [0.002]}\n",
            "has no tune block",
        ),
    ],
)
def test_bad_tune_blocks_name_the_field(
    tmp_path: Path, tune: str, members: str, needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_suite(str(_suite_file(tmp_path, tune, members)))


def _fake_tune_run(root: Path, member: str, lr: float, val_accuracy: float) -> None:
    """A finished tuning run's folder without training: one epoch and its validation score."""
    folder = root / tune_relpath(member, lr)
    folder.mkdir(parents=True)
    history = [{"epoch": 1, "val_accuracy": val_accuracy, "images_per_s": 100.0}]
    res = {"test": None, "seconds": 5.0, "epochs_done": 1, "history": history}
    (folder / "results.json").write_text(json.dumps(res))


def test_the_grid_is_the_own_rate_times_the_factors_and_waits_for_its_runs(
    tmp_path: Path,
) -> None:
    suite = load_suite(str(_suite_file(tmp_path, TUNE_BLOCK, TWO_MEMBERS)))
    state = member_tuning(suite, suite.member("idpa"), [tmp_path / "out"])
    assert state.own_lr == OWN_LR
    assert state.todo == [0.001, 0.002, 0.004]
    assert state.chosen is None
    assert chosen_lrs(suite, [tmp_path / "out"]) == {}


def test_the_best_inside_the_grid_is_chosen_and_a_tie_goes_to_the_smaller(
    tmp_path: Path,
) -> None:
    suite = load_suite(str(_suite_file(tmp_path, TUNE_BLOCK, TWO_MEMBERS)))
    out = tmp_path / "out"
    for lr, acc in [(0.001, 0.70), (0.002, 0.80), (0.004, 0.80)]:
        _fake_tune_run(out, "idpa", lr, acc)
    state = member_tuning(suite, suite.member("idpa"), [out])
    # 0.002 and 0.004 tie: the smaller wins, and it lies inside the grid.
    assert (state.chosen, state.on_edge, state.todo) == (0.002, False, [])
    assert state.suite_entry == "tuned: {lr: 0.002, grid: [0.001, 0.002, 0.004]}"
    assert chosen_lrs(suite, [out]) == {"idpa": 0.002}


def test_a_best_on_the_edge_grows_the_grid_then_stops(tmp_path: Path) -> None:
    suite = load_suite(str(_suite_file(tmp_path, TUNE_BLOCK, TWO_MEMBERS)))
    out, idpa = tmp_path / "out", suite.member("idpa")
    for lr, acc in [(0.001, 0.60), (0.002, 0.70), (0.004, 0.80)]:
        _fake_tune_run(out, "idpa", lr, acc)
    assert member_tuning(suite, idpa, [out]).todo == [0.008]  # the upper edge, times step 2
    _fake_tune_run(out, "idpa", 0.008, 0.85)
    assert member_tuning(suite, idpa, [out]).todo == [0.016]
    _fake_tune_run(out, "idpa", 0.016, 0.90)
    # Two extensions (tune.extend) are all there is: the best is still on the edge, and says so.
    state = member_tuning(suite, idpa, [out])
    assert (state.chosen, state.on_edge, state.todo) == (0.016, True, [])
    assert state.grid == [0.001, 0.002, 0.004, 0.008, 0.016]
    # An extension that falls back inside settles it.
    _fake_tune_run(out, "idpa", 0.0005, 0.1)  # outside the path taken: ignored
    assert member_tuning(suite, idpa, [out]).grid == [0.001, 0.002, 0.004, 0.008, 0.016]


def test_an_extension_that_loses_ends_the_search_inside(tmp_path: Path) -> None:
    suite = load_suite(str(_suite_file(tmp_path, TUNE_BLOCK, TWO_MEMBERS)))
    out, idpa = tmp_path / "out", suite.member("idpa")
    for lr, acc in [(0.001, 0.90), (0.002, 0.70), (0.004, 0.60), (0.0005, 0.85)]:
        _fake_tune_run(out, "idpa", lr, acc)
    state = member_tuning(suite, idpa, [out])
    assert (state.chosen, state.on_edge) == (0.001, False)
    assert [p.lr for p in tune_pairs(suite, out)] == [0.0005, 0.001, 0.002, 0.004]


def test_an_interrupted_tuning_run_is_not_a_score(tmp_path: Path) -> None:
    suite = load_suite(str(_suite_file(tmp_path, TUNE_BLOCK, TWO_MEMBERS)))
    out = tmp_path / "out"
    for lr, acc in [(0.001, 0.70), (0.002, 0.80), (0.004, 0.60)]:
        _fake_tune_run(out, "idpa", lr, acc)
    results = out / tune_relpath("idpa", 0.002) / "results.json"
    res = json.loads(results.read_text())
    results.write_text(json.dumps(res | {"interrupted": True}))
    assert member_tuning(suite, suite.member("idpa"), [out]).todo == [0.002]


def test_a_recorded_choice_is_the_runs_learning_rate(tmp_path: Path) -> None:
    members = """\
    members:
      - name: idpa
        tuned: {lr: 0.004, grid: [0.001, 0.002, 0.004]}
      - name: dynamic
        set: ["model.router={name: dynamic}"]
        tune: false
    """
    suite = load_suite(str(_suite_file(tmp_path, TUNE_BLOCK, members)))
    pairs = {p.member.name: p for p in plan_pairs(suite, tmp_path / "out")}

    def lrs(member: str) -> list[str]:
        return [s for s in suite.overrides(pairs[member].member, 0) if s.startswith("train.lr=")]

    assert lrs("idpa") == [f"train.lr={OWN_LR}", "train.lr=0.004"]  # the choice comes last
    assert lrs("dynamic") == [f"train.lr={OWN_LR}"]
    # The choice round-trips through the suite's own dictionary.
    assert suite.to_dict()["members"][0]["tuned"] == {"lr": 0.004, "grid": [0.001, 0.002, 0.004]}


def test_tiny_suite_is_tuned_on_validation_then_run_with_the_choice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    members = """\
    members:
      - name: idpa
    """
    tune = """\
    tune:
      val_size: 64
      epochs: 1
      factors: [1, 4]
      extend: 0
    """
    path = _suite_file(tmp_path, tune, members, [*TINY_SET, "train.steps_per_epoch=3"])
    out = tmp_path / "out"
    status = ["suite", "tune", str(path), "--out", str(out), "--status"]
    code, stdout, err = run_cli(capsys, status)
    assert code == 0, err
    assert "idpa: 2 learning rate(s) still to train" in err
    assert not out.exists()  # --status trains nothing and writes nothing
    code, stdout, err = run_cli(capsys, ["suite", "tune", str(path), "--out", str(out), "--json"])
    assert code == 0, err
    doc = json.loads(stdout)
    (member,) = doc["members"]
    assert member["grid"] == [0.002, 0.008] and member["todo"] == []
    assert member["chosen"] in (0.002, 0.008)
    for run in member["runs"]:
        res = json.loads((Path(run["folder"]) / "results.json").read_text())
        assert res["test"] is None  # the test set is never touched while choosing
        assert not (Path(run["folder"]) / "tests.json").exists()
        assert res["history"][-1]["val_accuracy"] == run["val_accuracy"]
    code, stdout, err = run_cli(capsys, status)
    assert code == 0, err
    # Two points and no extension: the best is on an edge, and the line says so.
    entry = f"tuned: {{lr: {member['chosen']:.6g}, grid: [0.002, 0.008]}}"
    assert f"idpa (on the grid's edge after every extension): {entry}" in stdout
    # The final runs train at the chosen rate, on the whole training set, and are tested.
    code, _, err = run_cli(capsys, ["suite", "run", str(path), "--out", str(out)])
    assert code == 0, err
    final = out / "idpa" / "seed-0"
    assert json.loads((final / "results.json").read_text())["test"] is not None
    assert load_preset(str(final / "preset.yaml")).train.lr == member["chosen"]
    assert load_preset(str(final / "preset.yaml")).data.val_size == 0
    code, stdout, err = run_cli(capsys, ["suite", "report", str(out), "--json"])
    assert code == 0, err
    (row,) = json.loads(stdout)["rows"]
    assert (row["lr"], row["lr_chosen_on"]) == (f"{member['chosen']:.6g}", "val")
    results = tmp_path / "tuned.csv"
    code, _, err = run_cli(capsys, ["suite", "report", str(out), "--results", str(results)])
    assert code == 0, err
    (csv_row,) = read_results(results)
    assert (csv_row["lr"], csv_row["lr_chosen_on"]) == (f"{member['chosen']:.6g}", "val")
    # The ledger keeps the tuning runs beside the final ones.
    ledger = tmp_path / "ledger"
    code, said, err = run_cli(capsys, ["suite", "archive", str(out), "--to", str(ledger)])
    assert code == 0, err
    for lr in member["grid"]:
        assert (ledger / tune_relpath("idpa", lr) / "results.json").exists()
        # each tuning run named by its rate, not as a seed of the member
        assert f"idpa lr {lr:g} (tuning): added" in said
    assert said.count("idpa seed 0: added") == 1  # the final run alone


def test_printed_commands_tune_first_then_train_at_the_choice(tmp_path: Path) -> None:
    suite = load_suite(str(_suite_file(tmp_path, TUNE_BLOCK, TWO_MEMBERS)))
    out = tmp_path / "out"
    lines = pair_commands(suite, out)
    tuning = [line for line in lines if "/tune/idpa/" in line]
    assert len(tuning) == 3 and all("train.final_test=false" in line for line in tuning)
    assert all("data.val_size=100" in line and "train.epochs=1" in line for line in tuning)
    (comment,) = [line for line in lines if line.startswith("#")]
    # a comment: plain words, nothing a shell would quote
    assert comment.startswith("# idpa: its seeds train at the learning rate chosen on validation")
    assert "'" not in comment
    assert not any("idpa/seed-0" in line for line in lines)  # no final run before the choice
    assert any("dynamic/seed-0" in line for line in lines)  # an untuned member runs at once
    for lr, acc in [(0.001, 0.70), (0.002, 0.60), (0.004, 0.50), (0.0005, 0.65)]:
        _fake_tune_run(out, "idpa", lr, acc)
    (final,) = [line for line in pair_commands(suite, out) if "idpa/seed-0" in line]
    assert final.split().index("train.lr=0.001") > final.split().index(f"train.lr={OWN_LR}")


def test_suite_run_tunes_an_untuned_member_first_by_itself(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tune = """\
    tune:
      val_size: 64
      epochs: 1
      grid: [0.001, 0.004]
      extend: 0
    """
    members = "members:\n  - name: idpa\n"
    path = _suite_file(tmp_path, tune, members, [*TINY_SET, "train.steps_per_epoch=2"])
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, ["suite", "run", str(path), "--out", str(out)])
    assert code == 0, err
    for lr in (0.001, 0.004):
        res = json.loads((out / tune_relpath("idpa", lr) / "results.json").read_text())
        assert res["test"] is None and res["history"][-1]["val_accuracy"] is not None
    chosen = chosen_lrs(load_suite(str(path)), [out])["idpa"]
    final = load_preset(str(out / "idpa" / "seed-0" / "preset.yaml"))
    assert final.train.lr == chosen and final.data.val_size == 0


def _fake_diverged_run(root: Path, member: str, lr: float) -> None:
    """A tuning run's folder as the tuner leaves it when the loss became non-finite."""
    folder = root / tune_relpath(member, lr)
    folder.mkdir(parents=True)
    res = {"test": None, "seconds": 3.0, "epochs_done": 0, "history": []}
    res["diverged"] = {"epoch": 1, "step": 7, "message": "loss became nan at epoch 1, step 7"}
    (folder / "results.json").write_text(json.dumps(res))


def test_a_diverged_run_is_a_tried_grid_point_worse_than_any_score(tmp_path: Path) -> None:
    suite = load_suite(str(_suite_file(tmp_path, TUNE_BLOCK, TWO_MEMBERS)))
    out, idpa = tmp_path / "out", suite.member("idpa")
    _fake_tune_run(out, "idpa", 0.001, 0.60)
    _fake_tune_run(out, "idpa", 0.002, 0.05)  # a poor score still beats a divergence
    _fake_diverged_run(out, "idpa", 0.004)
    # the best, 0.001, lies on the lower edge: the grid grows below it, not past the divergence
    assert member_tuning(suite, idpa, [out]).todo == [0.0005]
    _fake_tune_run(out, "idpa", 0.0005, 0.50)
    state = member_tuning(suite, idpa, [out])
    assert (state.chosen, state.on_edge, state.todo) == (0.001, False, [])
    (diverged,) = [r for r in state.runs if r.diverged]
    assert (diverged.lr, diverged.finished, diverged.val_accuracy) == (0.004, True, None)


def test_suite_tune_records_a_diverging_run_and_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grid's larger rate diverges (as the CNN's 0.2 does in cifar10-fast): the command
    records it in that run's results.json, trains the rest, chooses among the scores, and the
    ledger keeps the diverged run beside the others."""
    from capsctl.errors import DivergedError
    from capsctl.suites import pair_run

    real = pair_run.train_pair

    def diverging(suite, pair, *args):  # type: ignore[no-untyped-def]
        if pair.lr is not None and pair.lr > 0.005:
            raise DivergedError("loss became nan at epoch 1, step 2; ...", epoch=1, step=2)
        return real(suite, pair, *args)

    monkeypatch.setattr(pair_run, "train_pair", diverging)
    members = """\
    members:
      - name: idpa
    """
    tune = """\
    tune:
      val_size: 64
      epochs: 1
      factors: [0.5, 1, 4]
    """
    path = _suite_file(tmp_path, tune, members, [*TINY_SET, "train.steps_per_epoch=3"])
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, ["suite", "tune", str(path), "--out", str(out), "--json"])
    assert code == 0, err
    (member,) = json.loads(stdout)["members"]
    assert member["grid"] == [0.001, 0.002, 0.008] and member["todo"] == []
    runs = {r["lr"]: r for r in member["runs"]}
    assert runs[0.008]["diverged"] and runs[0.008]["val_accuracy"] is None
    assert member["chosen"] in (0.001, 0.002)
    res = json.loads((out / tune_relpath("idpa", 0.008) / "results.json").read_text())
    assert res["diverged"]["step"] == 2 and res["test"] is None
    code, stdout, err = run_cli(capsys, ["suite", "tune", str(path), "--out", str(out), "--status"])
    assert code == 0, err
    assert "diverged" in stdout
    ledger = tmp_path / "ledger"
    code, said, err = run_cli(capsys, ["suite", "archive", str(out), "--to", str(ledger)])
    assert code == 0, err
    assert "idpa lr 0.008 (tuning): added" in said
    assert json.loads((ledger / tune_relpath("idpa", 0.008) / "results.json").read_text())[
        "diverged"
    ]
