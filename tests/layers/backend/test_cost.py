"""Fused or dense on a CUDA device (capsctl/layers/backend/cost.py, dispatch.py): the cost model
against figures worked out by hand, the choice it makes and where a pass takes it. No GPU is
needed: the choice is decided from devices and dtypes, which the tests give as values."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from capsctl.errors import UsageError
from capsctl.layers.backend import cost, dispatch
from capsctl.layers.backend.cost import VoteShape

CUDA = torch.device("cuda")
# 16-wide and 36-wide vectors, 4x4 matrices: the bundled models' widest conv layers and class
# layer, at batch 128
BUNDLED = [
    VoteShape(j=288, b=128 * 49, m=32, a=1, c=16, x=16),
    VoteShape(j=288, b=128 * 64, m=32, a=1, c=36, x=36),
    VoteShape(j=512, b=128, m=10, a=4, c=4, x=4),
]
# far wider poses than any bundled model's, at many sites: each vote a long product, which the
# fused pass builds three times and the dense one once (bf16 only: float32's fused products
# at a third of tf32's rate still beat cuBLAS's float32)
WIDE = VoteShape(j=1, b=4096, m=1, a=1, c=4096, x=4096)


def test_the_cost_model_worked_out_by_hand() -> None:
    shape = VoteShape.of((2, 3, 1, 16), (2, 16, 4, 8))  # x[J, B, a, x], w[J, x, m, c]
    assert (shape.j, shape.b, shape.m, shape.a, shape.c, shape.x) == (2, 3, 4, 1, 8, 16)
    assert shape.entries == 2 * 3 * 4 * 1 * 8 == 192
    bf16_rate = 989e12 * 0.55  # H100 dense bf16 tensor cores at 55%
    bandwidth = 3.35e12 * 0.8  # HBM3 at 80%
    inputs = 2 * (2 * 3 * 1 * 16 + 2 * 16 * 4 * 8) * 2  # x and w, forward and backward, bf16
    # fused: (2x + 4) + 3 (2x) + 5 = 137 FLOPs a vote entry; reading the inputs takes longer
    fused = max(137 * 192 / bf16_rate, inputs / bandwidth) * 1e6
    assert cost.fused_us(shape, 2) == pytest.approx(fused) == pytest.approx(4480 / bandwidth * 1e6)
    # dense: 6x FLOPs a vote entry, plus the votes written once and read seven times
    dense = (6 * 16 * 192 / bf16_rate + (8 * 192 * 2 + inputs) / bandwidth) * 1e6
    assert cost.dense_us(shape, 2) == pytest.approx(dense)
    assert cost.dense_bytes(shape, 2) == 2 * 192 * 2
    # float32: the fused products are three tf32 ones, cuBLAS runs float32 (67 TFLOP/s)
    tf32x3 = 494e12 * 0.55 / 3
    fused32 = max(137 * 192 / tf32x3, 2 * inputs / bandwidth) * 1e6
    assert cost.fused_us(shape, 4) == pytest.approx(fused32)
    dense32 = (6 * 16 * 192 / 67e12 + (8 * 192 * 4 + 2 * inputs) / bandwidth) * 1e6
    assert cost.dense_us(shape, 4) == pytest.approx(dense32)


@pytest.mark.parametrize("itemsize", [2, 4])
def test_the_bundled_shapes_run_fused_and_far_wider_poses_dense(itemsize: int) -> None:
    for shape in BUNDLED:
        backend, reason = cost.cuda_path(shape, itemsize)
        assert backend == "triton" and "µs fused" in reason, (shape, reason)
    backend, reason = cost.cuda_path(WIDE, 2, budget=1 << 30)
    assert backend == "dense" and "cheaper" in reason and "64.0 MiB kept" in reason
    assert cost.cuda_path(WIDE, 4, budget=1 << 30)[0] == "triton"
    # the same shape when its votes do not fit: fused, saying why
    backend, reason = cost.cuda_path(WIDE, 2, budget=cost.dense_bytes(WIDE, 2) - 1)
    assert backend == "triton" and "budget" in reason


def test_the_budget_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cost.BUDGET_ENV, raising=False)
    assert cost.dense_budget() == cost.DENSE_BUDGET_BYTES == 1 << 30
    assert cost.cuda_path(WIDE, 2)[0] == "dense"  # 64 MiB of votes and gradient
    monkeypatch.setenv(cost.BUDGET_ENV, "0.5")
    assert cost.dense_budget() == 1 << 19
    assert cost.cuda_path(WIDE, 2)[0] == "triton"
    monkeypatch.setenv(cost.BUDGET_ENV, "512")
    assert cost.dense_budget() == 512 << 20
    for bad in ("0", "-1", "lots"):
        monkeypatch.setenv(cost.BUDGET_ENV, bad)
        with pytest.raises(UsageError, match=cost.BUDGET_ENV):
            cost.dense_budget()


def _on_cuda(dtype: torch.dtype) -> list[SimpleNamespace]:
    """Stand-ins for a pass's three inputs on a CUDA device (choose reads device and dtype)."""
    return [SimpleNamespace(device=CUDA, dtype=dtype) for _ in range(3)]


@pytest.fixture
def kernels_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton kernels as if they ran on the CUDA device."""
    monkeypatch.setattr(dispatch, "triton_status", lambda device: "")
    monkeypatch.delenv(cost.BUDGET_ENV, raising=False)


def test_a_cuda_pass_takes_the_cost_models_choice(kernels_ready: None) -> None:
    dense = dispatch.choose(*_on_cuda(torch.bfloat16), votes=WIDE)
    assert dense.backend == "dense" and dense.modelled and "µs dense" in dense.reason
    fused = dispatch.choose(*_on_cuda(torch.bfloat16), votes=BUNDLED[0])
    assert fused.backend == "triton" and fused.modelled
    # without its vote sizes a pass runs the fused kernels, as before
    assert dispatch.choose(*_on_cuda(torch.float32)) == dispatch.Choice("triton")
    # under bf16 autocast the modelled dense pass runs in bf16 too
    low = dispatch.choose(*_on_cuda(torch.float32), autocast=torch.bfloat16, votes=WIDE)
    assert (low.backend, low.dtype, low.modelled) == ("dense", torch.bfloat16, True)


def test_use_blocks_and_torch_compile_overrule_the_cost_model(
    kernels_ready: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    bf16 = _on_cuda(torch.bfloat16)
    assert dispatch.choose(*bf16, votes=WIDE).backend == "dense"
    with dispatch.use("triton"):
        assert dispatch.choose(*bf16, votes=WIDE).backend == "triton"
    with dispatch.use("chunked"):
        assert dispatch.choose(*bf16, votes=WIDE).backend == "chunked"
    # torch.compile keeps the fused custom ops, whatever the model says
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    choice = dispatch.choose(*bf16, votes=WIDE)
    assert choice.backend == "triton" and not choice.modelled


def test_the_training_header_says_the_cost_model_decides_on_cuda(kernels_ready: None) -> None:
    choice = dispatch.expected("cuda")
    assert choice.backend == "triton"
    assert "cost model" in choice.reason and "1 GiB" in choice.reason
    assert dispatch.expected("cpu").reason == ""
