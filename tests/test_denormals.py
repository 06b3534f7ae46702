"""Subnormal floats flushed to zero while training and benchmarking on a CPU, and only then
(capsctl.devices.flush_denormals): the scope, its reach into the routing loops' worker threads,
and the two callers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from capsctl.bench import run_bench
from capsctl.config import resolve_config
from capsctl.devices import denormals_flushed, flush_denormals
from capsctl.layers import chunks
from capsctl.training import fit
from tests.test_training import tiny_preset

SUBNORMAL = 1e-39  # float32's smallest normal number is 1.18e-38
SUBNORMAL_F32 = float(torch.tensor([SUBNORMAL]).item())  # as float32 holds it

if not torch.set_flush_denormal(False):
    pytest.skip("this CPU has no flush-to-zero mode", allow_module_level=True)


@pytest.fixture(autouse=True)
def normal_mode() -> Iterator[None]:
    torch.set_flush_denormal(False)
    yield
    torch.set_flush_denormal(False)


def product_of_a_subnormal() -> float:
    return float((torch.tensor([SUBNORMAL]) * 1.0).item())


def test_the_state_is_read_from_arithmetic() -> None:
    assert not denormals_flushed() and product_of_a_subnormal() > 0.0
    torch.set_flush_denormal(True)
    assert denormals_flushed() and product_of_a_subnormal() == 0.0


def test_flushed_inside_the_scope_and_restored_after() -> None:
    with flush_denormals(torch.device("cpu")):
        assert product_of_a_subnormal() == 0.0
    assert product_of_a_subnormal() > 0.0


def test_a_mode_set_before_the_scope_is_kept_after_it() -> None:
    torch.set_flush_denormal(True)
    with flush_denormals(torch.device("cpu")):
        assert product_of_a_subnormal() == 0.0
    assert product_of_a_subnormal() == 0.0


def test_restored_when_the_block_raises() -> None:
    with pytest.raises(KeyError), flush_denormals(torch.device("cpu")):
        raise KeyError("x")
    assert product_of_a_subnormal() > 0.0


def test_other_devices_leave_the_cpu_alone() -> None:
    with flush_denormals(torch.device("meta")):
        assert product_of_a_subnormal() > 0.0


def spans_see() -> list[float]:
    seen = [-1.0, -1.0]

    def part(i: int, start: int, stop: int) -> None:
        seen[i] = product_of_a_subnormal()

    chunks.run_spans(part, [(0, 1), (1, 2)])
    return seen


def fresh_workers() -> None:
    pool = chunks._POOL["pool"]
    if pool is not None:
        pool.shutdown()
    chunks._reset_pool()


def test_worker_threads_follow_the_callers_mode_both_ways() -> None:
    fresh_workers()  # started outside any scope
    assert spans_see() == [SUBNORMAL_F32] * 2
    with flush_denormals(torch.device("cpu")):
        assert spans_see() == [0.0, 0.0]
    fresh_workers()  # started inside a scope, they must not keep it after
    with flush_denormals(torch.device("cpu")):
        assert spans_see() == [0.0, 0.0]
    assert spans_see() == [SUBNORMAL_F32] * 2


def test_training_steps_run_with_subnormals_flushed(tmp_path: Path) -> None:
    seen: list[tuple[str, bool]] = []
    fit(
        tiny_preset(val_size=0, epochs=1, steps_per_epoch=2),
        tmp_path / "run",
        on_event=lambda e: seen.append((e["event"], denormals_flushed())),
        handle_sigint=False,
    )
    during = [flushed for event, flushed in seen if event in ("epoch_start", "epoch_end")]
    assert during == [True, True]
    assert not denormals_flushed()


def test_bench_measures_with_subnormals_flushed() -> None:
    seen: list[bool] = []
    tiny = {"base": "mnist-caps", "primary_types": 4, "primary_dim": 4, "layers": []}
    run_bench(
        [("tiny", resolve_config({**tiny, "input_size": 16}))],
        batch_size=2,
        iters=1,
        warmup=0,
        on_event=lambda e: seen.append(denormals_flushed()),
    )
    assert seen and all(seen)
    assert not denormals_flushed()
