"""The Triton passes behind capsctl/layers/backend/dispatch.py: where they run, and whole
training steps of every routing algorithm through them (Triton's interpreter on the CPU)
against the torch code."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: the kernels run on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton cannot import (it ships with torch's CUDA wheels)")

from routing_steps import assert_same_step, routing_model, training_step  # noqa: E402

from capsctl.layers.backend import dispatch  # noqa: E402

# small versions of the four routing algorithms' CIFAR-10 models: two conv capsule layers (one
# strided, so windows overlap and sites are uneven) and the class layer
SMALL = {
    "primary_types": 4,
    "layers": [
        {"kind": "conv", "types": 4, "pose_dim": 16, "kernel": 3, "stride": 2},
        {"kind": "conv", "types": 3, "pose_dim": 16, "kernel": 3, "stride": 1},
    ],
    "input_size": 16,
}
# the fused ops each routing algorithm's training step must call, as module.op: each EM
# M-step takes its assignments through the fused E-step and moments (the first, uniform ones
# without the statistics), and the conv layers' window copies take their gradients through
# the overlap kernel (EM's E-step its normalizers and window sums too)
OPS = {
    "idpa": ("ops.triton_routed", "overlap_ops.triton_overlap_reduce"),
    "dynamic": ("ops.triton_routed", "overlap_ops.triton_overlap_reduce"),
    "em": (
        "estep_moments_ops.triton_em_estep_stats",
        "estep_moments_ops.triton_em_estep_moments",
        "estep_moments_ops.triton_em_estep_rowdot",
        "estep_moments_ops.triton_em_estep_grads",
        "overlap_ops.triton_overlap_lse",
        "overlap_ops.triton_overlap_reduce",
    ),
    "self": ("ops.triton_weighted", "overlap_ops.triton_overlap_reduce"),
}


def test_the_triton_backend_is_chosen_inside_use_triton_and_tallied() -> None:
    x = torch.zeros(2, 3)
    assert dispatch.choose(x).backend != "triton"  # never on a CPU by itself
    dispatch.reset_ran()
    with dispatch.use("triton"):
        assert dispatch.choose(x) == dispatch.Choice("triton")
        assert dispatch.choose(x.long()).backend != "triton"  # integer tensors: not the kernels
        with dispatch.use("chunked"):  # the torch code wins, as for the compiled loops
            assert dispatch.choose(x).backend == "chunked"
    assert dispatch.ran()["triton"] == 1 and dispatch.ran()["chunked"] >= 1
    dispatch.reset_ran()
    assert dispatch.ran() == {}


def test_the_environment_turns_the_triton_kernels_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dispatch.TRITON_ENV, "0")
    with dispatch.use("triton"):
        choice = dispatch.choose(torch.zeros(2))
    assert choice.backend != "triton"
    assert "CAPSCTL_TRITON=0" in dispatch.triton_status("cpu")


def test_kernels_that_fail_their_self_test_leave_the_torch_code_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from capsctl.layers.backend.triton import ops

    monkeypatch.setattr(dispatch, "_TRITON_CHECKED", {})
    assert dispatch.triton_status("cpu") == ""  # the kernels pass on the interpreter
    real = ops.triton_routed

    def wrong(*args, **kwargs):  # type: ignore[no-untyped-def]
        s, r = real(*args, **kwargs)
        return s * 1.01, r  # a kernel that sums 1% too much

    monkeypatch.setattr(ops, "triton_routed", wrong)
    monkeypatch.setattr(dispatch, "_TRITON_CHECKED", {})
    with caplog.at_level("WARNING"), dispatch.use("triton"):
        choice = dispatch.choose(torch.zeros(2))
        assert dispatch.choose(torch.zeros(2)) == choice  # tested once per device
    assert choice.backend != "triton"
    why = dispatch.triton_status("cpu")
    assert "failed their self-test on cpu" in why and "routed output 0 differs" in why
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "the routing runs as torch code there" in warnings[0]

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("no kernel for this architecture")

    monkeypatch.setattr(ops, "triton_routed", broken)
    monkeypatch.setattr(dispatch, "_TRITON_CHECKED", {})
    assert "RuntimeError: no kernel for this architecture" in dispatch.triton_status("cpu")


@pytest.mark.parametrize("router", ["idpa", "dynamic", "em", "self"])
def test_a_training_step_through_the_triton_passes_equals_the_torch_code(
    router: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    calls: dict[str, int] = {}
    for name in OPS[router]:
        where, op_name = name.split(".")
        module = importlib.import_module(f"capsctl.layers.backend.triton.{where}")
        op = getattr(module, op_name)

        def counted(*args, _op=op, _name=name, **kwargs):  # type: ignore[no-untyped-def]
            calls[_name] = calls.get(_name, 0) + 1
            return _op(*args, **kwargs)

        monkeypatch.setattr(module, op_name, counted)
    model = routing_model(router, **SMALL)
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    dispatch.reset_ran()
    with dispatch.use("triton"):
        fused = training_step(model, x)
    assert dispatch.ran().get("triton", 0) > 0, dispatch.ran()
    assert sorted(calls) == sorted(OPS[router]), calls  # the fused kernels ran
    with dispatch.use("chunked"):
        slow = training_step(model, x)
    # a gradient that is zero but for rounding (1e-8 here) is compared on the scale of the
    # largest one: the kernels sum over their blocks and spans in another order than the torch
    # code
    assert_same_step(fused, slow, floor=1e-3)


def test_importing_capsctl_imports_neither_triton_nor_dynamo() -> None:
    """Triton takes ``TRITON_INTERPRET`` when it is first imported, and torch._dynamo imports it
    (and costs a second at start-up): the package and its command line leave both unimported
    until a pass or ``--compile`` needs them (a decorator at import once did)."""
    import subprocess
    import sys

    code = (
        "import sys, capsctl, capsctl.layers, capsctl.cli, capsctl.training\n"
        "print(sorted(m for m in ('triton', 'torch._dynamo') if m in sys.modules))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]"
