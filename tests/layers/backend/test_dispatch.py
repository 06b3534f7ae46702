"""capsctl/layers/backend/dispatch.py: the one switch that says which implementation of a pass
runs, and why no faster one does."""

from __future__ import annotations

import threading

import pytest
import torch

from capsctl.layers import dispatch, native_status
from capsctl.layers.backend import native


def test_the_backends_fastest_first() -> None:
    assert dispatch.BACKENDS == ("native", "triton", "chunked", "dense")


def test_float32_on_a_cpu_runs_the_compiled_loops_where_they_are_built() -> None:
    choice = dispatch.choose(torch.zeros(2), torch.zeros(3))
    if native.loaded() is None:
        assert choice.backend == "chunked" and native_status() in choice.reason
    else:
        assert choice == dispatch.Choice("native")


def test_other_dtypes_run_the_chunked_torch_code_and_say_why() -> None:
    choice = dispatch.choose(torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    assert choice.backend == "chunked" and "float32 tensors on a CPU" in choice.reason


def test_use_dense_wins_and_says_why() -> None:
    with dispatch.use("chunked"), dispatch.use("dense"):
        choice = dispatch.choose(torch.zeros(2))
    assert choice.backend == "dense" and 'use("dense")' in choice.reason


def test_use_chunked_and_its_sites_end_with_the_block() -> None:
    before = dispatch.choose(torch.zeros(2))
    with dispatch.use("chunked", sites=3):
        choice = dispatch.choose(torch.zeros(2))
        assert choice == dispatch.Choice("chunked", 'inside use("chunked")', 3)
        with dispatch.use("chunked"):
            assert dispatch.choose(torch.zeros(2)).sites == 3
    assert dispatch.choose(torch.zeros(2)) == before


def test_use_refuses_what_it_cannot_pick() -> None:
    with pytest.raises(ValueError, match="'dense', 'chunked' or 'triton'"), dispatch.use("native"):
        pass
    with pytest.raises(ValueError, match="chunked backend only"), dispatch.use("dense", sites=2):
        pass


def test_a_block_holds_for_its_own_thread_only() -> None:
    # an export's use("dense") in one thread must not move another thread's training
    entered, leave = threading.Barrier(2), threading.Event()
    seen: list[str] = []

    def export() -> None:
        with dispatch.use("dense"):
            seen.append(dispatch.choose(torch.zeros(2)).backend)
            entered.wait()
            leave.wait()

    thread = threading.Thread(target=export)
    thread.start()
    entered.wait()
    try:
        assert seen == ["dense"]
        assert dispatch.choose(torch.zeros(2)).backend != "dense"
        with dispatch.use("chunked"):  # blocks in both threads, closed in any order
            assert dispatch.choose(torch.zeros(2)).reason == 'inside use("chunked")'
    finally:
        leave.set()
        thread.join()
    assert dispatch.choose(torch.zeros(2)).backend != "chunked" or native.loaded() is None


def test_the_chunked_passes_workers_keep_their_callers_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from capsctl.layers.backend.chunks import run_spans

    monkeypatch.setenv("CAPSCTL_ROUTING_THREADS", "2")
    seen: dict[int, dispatch.Choice] = {}

    def part(i: int, start: int, stop: int) -> None:
        seen[i] = dispatch.choose(torch.zeros(2))

    with dispatch.use("chunked", sites=5):
        run_spans(part, [(0, 3), (3, 6)])
    assert seen == {i: dispatch.Choice("chunked", 'inside use("chunked")', 5) for i in (0, 1)}


@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:FutureWarning")
def test_tracing_is_seen_and_tracing_runs_no_compiled_loop() -> None:
    seen: list[tuple[bool, str]] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        seen.append((dispatch.tracing(), dispatch.choose(x).backend))
        return x * 2

    assert not dispatch.tracing()
    torch.jit.trace(f, torch.zeros(2), check_trace=False)
    assert seen == [(True, "chunked")]


def test_expected_says_what_a_float32_pass_runs_and_is_not_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dispatch.reset_ran()
    assert dispatch.expected("cpu") == dispatch.choose(torch.zeros(2))
    assert dispatch.ran() == {dispatch.expected("cpu").backend: 1}  # choose's call only
    monkeypatch.setattr(native, "loaded", lambda: None)
    monkeypatch.setattr(native, "native_status", lambda: "off (a test)")
    assert dispatch.expected("cpu") == dispatch.Choice(
        "chunked", "the compiled loops are off (a test)"
    )


def test_the_training_header_says_how_the_routing_runs(
    tmp_path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from conftest import run_cli
    from tiny import tiny_args

    monkeypatch.setattr(native, "loaded", lambda: None)
    monkeypatch.setattr(native, "native_status", lambda: "off (a test)")
    args = ["train", "--preset", "quickstart", *tiny_args(1), "--epochs", "1"]
    code, _, err = run_cli(capsys, [*args, "--out", str(tmp_path / "caps")])
    assert code == 0, err
    assert "routing: torch code (the compiled loops are off (a test))" in err
    cnn = [*args, "--set", "model.arch=cnn", "--out", str(tmp_path / "cnn")]
    code, _, err = run_cli(capsys, cnn)
    assert code == 0, err
    assert "routing:" not in err  # no capsules, no routing line


def _one_pass_each() -> dict:
    """Each vote-sized pass, as a function running it forward and backward on small inputs
    (float32 on the CPU: the compiled loops where they are built, else the torch code)."""
    from capsctl.layers.passes.em_moments import vote_moments, vote_quad
    from capsctl.layers.passes.gated import gated_pass
    from capsctl.layers.passes.routed import routed_pass, routed_pass_under_autocast
    from capsctl.layers.passes.weighted import weighted_pass

    g = torch.Generator().manual_seed(0)

    def leaves(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
        return [torch.rand(*s, generator=g).requires_grad_() for s in shapes]

    x, w, p, r = leaves((5, 3, 4, 4), (5, 4, 3, 4), (3, 3, 4, 4), (5, 3, 3))
    act, wr, br = leaves((3, 5), (5, 16, 3), (5, 3))
    ra, ae, wc, qp = leaves((3, 5, 3), (3, 5), (5, 4, 12), (2, 3, 16, 3))
    shift = torch.zeros(3, 16, 3)

    def autocast() -> list[torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return [routed_pass_under_autocast(x, w, p, 0.5)[0]]

    return {
        "routed": lambda: [routed_pass(x, w, p, 0.5)[0]],
        "routed under autocast": autocast,
        "weighted": lambda: [weighted_pass(x, w, r)],
        "gated": lambda: list(gated_pass(act, x, w, wr, br)[:2]),
        "em moments": lambda: list(vote_moments(ra, ae, x, wc, shift)),
        "em quadratic form": lambda: [vote_quad(qp, x, wc, shift)],
    }


@pytest.mark.parametrize("name", list(_one_pass_each()))
def test_a_pass_asks_the_dispatch_once_for_its_forward_and_backward(name: str) -> None:
    run = _one_pass_each()[name]
    dispatch.reset_ran()
    outs = run()
    sum(o.float().sum() for o in outs).backward()
    assert sum(dispatch.ran().values()) == 1, dispatch.ran()


def test_under_autocast_the_choice_says_the_dtype_to_run_in() -> None:
    x = torch.zeros(2)
    with dispatch.use("triton"):  # the Triton kernels take 16-bit inputs
        assert dispatch.choose(x, autocast=torch.bfloat16).dtype == torch.bfloat16
    with dispatch.use("chunked"):  # the torch code runs in float32
        choice = dispatch.choose(x, autocast=torch.bfloat16)
    assert choice.backend == "chunked" and choice.dtype == torch.float32
    assert dispatch.choose(x).dtype is None  # no autocast: the inputs' own
