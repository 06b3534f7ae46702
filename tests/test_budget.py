"""The wall-time budget: the schedule fits the time limit and the run ends inside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import capsctl.training.budget as budget_module
from capsctl.checkpoint import read_metadata
from capsctl.errors import UsageError
from capsctl.training import LAST, fit
from capsctl.training.budget import TimeBudget
from capsctl.training.command import flag_overrides, parse_duration
from tests.test_training import tiny_preset


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    c = FakeClock()
    monkeypatch.setattr(budget_module.time, "perf_counter", c)
    return c


def test_without_a_limit_the_schedule_follows_the_steps(clock: FakeClock) -> None:
    b = TimeBudget(None, total_steps=1000, eval_images=500, started=clock.now)
    clock.now += 1e6
    assert b.progress_steps(10) == 10.0 and b.progress(500) == 0.5
    assert not b.spent()


def test_the_clock_moves_the_schedule_ahead_of_the_steps(clock: FakeClock) -> None:
    # 1000 images evaluated after the last step, measured at 100 images/s: 10 s, plus the
    # 5 s end margin, are kept out of the 115 s limit, leaving 100 s of training.
    b = TimeBudget(115.0, total_steps=1000, eval_images=1000, started=clock.now)
    b.note_eval(200, 2.0)
    assert b.reserve() == pytest.approx(15.0)
    clock.now += 25.0
    assert b.time_fraction() == pytest.approx(0.25)
    assert b.progress_steps(100) == pytest.approx(250.0)  # the clock is ahead
    assert b.progress_steps(400) == 400.0  # the steps are ahead
    assert not b.spent()
    clock.now += 75.0
    assert b.spent() and b.progress(10) == 1.0


def test_before_any_evaluation_the_reserve_assumes_three_times_the_training_speed(
    clock: FakeClock,
) -> None:
    b = TimeBudget(60.0, total_steps=10, eval_images=600, started=clock.now)
    assert b.reserve() == pytest.approx(5.0)  # nothing measured yet: the end margin only
    b.note_train(128, 30.0)  # the first step warms up: left out
    assert b.reserve() == pytest.approx(5.0)
    b.note_train(128, 2.0)  # 64 images/s training -> 192 images/s evaluating
    assert b.reserve() == pytest.approx(600 / 192 + 5.0)


def test_the_reserve_is_at_most_a_quarter_of_the_limit(clock: FakeClock) -> None:
    b = TimeBudget(40.0, total_steps=10, eval_images=10_000, started=clock.now)
    b.note_eval(10, 1.0)  # 10 images/s: 1,000 s of test, far beyond the limit
    assert b.reserve() == pytest.approx(10.0)


def test_a_resumed_run_counts_its_earlier_lives(clock: FakeClock) -> None:
    b = TimeBudget(100.0, total_steps=10, started=clock.now, before=90.0)
    clock.now += 4.0
    assert b.elapsed() == pytest.approx(94.0) and not b.spent()
    clock.now += 1.0  # 95 s: the limit less the 5 s end margin
    assert b.spent()


@pytest.mark.parametrize(
    ("text", "seconds"), [("1800", 1800.0), ("90s", 90.0), ("30m", 1800.0), ("1.5h", 5400.0)]
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "m", "30x", "-5m", "0", "inf", "nan"])
def test_bad_durations_are_usage_errors(text: str) -> None:
    with pytest.raises(UsageError, match="--time-limit"):
        parse_duration(text, "--time-limit")


def test_time_limit_flag_becomes_the_preset_field() -> None:
    assert flag_overrides(time_limit="30m") == ["train.time_limit=1800.0"]


def test_a_run_fits_its_schedule_and_its_test_into_the_time_limit(tmp_path: Path) -> None:
    """100,000 epochs of a cosine schedule given 6 seconds: training stops mid-epoch, the LR has
    decayed to about zero (the schedule followed the clock), and the run with its final test
    ends within the limit."""
    limit = 6.0
    preset = tiny_preset(
        val_size=0, epochs=100_000, time_limit=limit, schedule="cosine", warmup_epochs=0.0, lr=0.05
    )
    events: list[dict] = []
    res = fit(preset, tmp_path / "run", on_event=events.append, handle_sigint=False)
    assert res.seconds <= limit + 2.0, res.seconds  # the test estimate may be off by a little
    assert res.test is not None and res.test.count == 2000
    last = res.history[-1]  # the budget ran out inside this epoch or right at its end
    assert last["lr"] < 0.05 * 0.02, last["lr"]  # cosine at (nearly) its end
    assert any(e["event"] == "time_limit" for e in events)
    assert json.loads((tmp_path / "run" / "results.json").read_text())["test"] is not None
    meta = read_metadata(tmp_path / "run" / LAST)
    assert 0.0 < meta["elapsed"] <= limit


def test_a_resumed_run_keeps_its_spent_time(tmp_path: Path) -> None:
    preset = tiny_preset(epochs=100_000, time_limit=3.0, schedule="cosine", warmup_epochs=0.0)
    run = tmp_path / "run"
    first = fit(preset, run, handle_sigint=False)
    spent = read_metadata(run / LAST)["elapsed"]
    again = fit(preset, run, resume=run / LAST, handle_sigint=False)
    # the budget was already spent: one more step, then the final test
    assert again.epochs_done == first.epochs_done + 1
    assert again.history[-1]["time_limit"] is True
    assert read_metadata(run / LAST)["elapsed"] > spent


def test_a_budget_spent_during_validation_is_marked_in_the_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The epoch's training ends inside the limit, its validation runs past it: the run stops
    there and that epoch's metrics line says why."""
    import capsctl.training.trainer as trainer_module

    real = trainer_module.evaluate
    now = {"offset": 0.0}
    real_clock = budget_module.time.perf_counter

    def late_evaluate(*args: object, **kwargs: object) -> object:
        result = real(*args, **kwargs)
        if kwargs.get("split") == "val":
            now["offset"] += 10_000.0  # this validation took "hours"
        return result

    monkeypatch.setattr(trainer_module, "evaluate", late_evaluate)
    monkeypatch.setattr(budget_module.time, "perf_counter", lambda: real_clock() + now["offset"])
    preset = tiny_preset(epochs=5, time_limit=3600.0)
    res = fit(preset, tmp_path / "run", handle_sigint=False)
    assert res.epochs_done == 1
    assert res.history[-1]["time_limit"] is True
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["time_limit"] is True
