"""The ahead-of-time report of the Triton kernels (capsctl/layers/backend/triton/aot*.py,
scripts/gpu_aot.py): launches captured on fake tensors, the cost model against figures worked
out by hand, and one variant per routing algorithm compiled for sm_90a, no GPU needed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton cannot import (it ships with torch's CUDA wheels)")

from capsctl.config import build_model  # noqa: E402
from capsctl.layers import gpu_aot  # noqa: E402
from capsctl.layers.backend import dispatch  # noqa: E402
from capsctl.layers.backend.triton.aot_ops import recording  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_aot as script  # noqa: E402

# each routing algorithm's small model, smaller still: 2 primary types of 2x2 poses (dynamic
# routing: vectors of 4) on a 4x4 grid, one conv capsule layer, 2 classes
TINY = {
    "primary_types": 2,
    "primary_dim": 4,
    "layers": [{"kind": "conv", "types": 2, "pose_dim": 4, "kernel": 3, "stride": 1}],
    "input_size": 8,
    "num_classes": 2,
}
PRESETS = {
    "idpa": "cifar10-caps-simple",
    "dynamic": "cifar10-dynamic-simple",
    "em": "cifar10-em-simple",
    "self": "cifar10-self-simple",
}
# the variant each algorithm compiles in CI: (pass, direction)
PICK = {
    "idpa": ("routed", "forward"),
    "dynamic": ("routed", "backward"),
    "em": ("em_estep_moments", "backward"),
    "self": ("weighted", "forward"),
}
FIELDS = ("registers", "spill_bytes", "stack_bytes", "shared_bytes", "acq_rel_atomics", "mma")


def _weighted_launch(offset: int = 0) -> gpu_aot.Launch:
    """The launch of the weighted pass ``S = sum_J R V`` of ``x[8, 4, 4, 4]``, ``w[8, 4, 2,
    4]``, ``r[8, 4, 2]`` (x starting ``offset`` elements into its storage)."""
    from capsctl.layers.backend.triton.ops import triton_weighted

    x = torch.randn(8 * 4 * 4 * 4 + offset)[offset:].view(8, 4, 4, 4)
    w, r = torch.randn(8, 4, 2, 4), torch.rand(8, 4, 2)
    with gpu_aot.capturing() as launches:
        triton_weighted(x, w, r)
    assert len(launches) == 1
    return launches[0]


def test_the_cost_model_of_a_weighted_forward_worked_out_by_hand() -> None:
    launch = _weighted_launch()
    assert launch.kernel == "pass_forward"
    assert gpu_aot.describe(launch) == {"pass": "weighted", "direction": "forward"}
    # x 8*4*4*4 = 512 floats, w 8*4*2*4 = 256, r 8*4*2 = 64, S 4*2*4*4 = 128 (float32 sums;
    # the unread P argument is S again and counts once): 960 floats, 3840 bytes
    # votes V = J B m a c = 8*4*2*4*4 = 1024 entries, each 2x = 8 FLOPs to build, 2 to weigh
    # and sum: 10240 FLOPs
    cost = gpu_aot.launch_cost(launch)
    assert cost == {"bytes": 3840, "flops": 10240, "dtype": "float32"}
    # no MMA: 67 TFLOP/s; memory bound at 0.8 * 3.35 TB/s = 2.68e12 B/s; plus 5 us of launch
    us = gpu_aot.modelled_us(cost["bytes"], cost["flops"], 67e12)
    assert us == pytest.approx(3840 / 2.68e12 * 1e6 + 5.0)
    # 2.68 GB and 67 GFLOP: 1000 us of memory against 1000 us of float32, 0.247 us of bf16
    # tensor cores at 55% of 989 TFLOP/s (tf32: 494)
    assert gpu_aot.modelled_us(2.68e9, 67e9, 67e12) == pytest.approx(1005.0)
    assert gpu_aot.modelled_us(0, 67e9, 989e12 * 0.55) == pytest.approx(67e9 / 543.95e12 * 1e6 + 5)
    from capsctl.layers.backend.triton.aot_cost import flop_rate

    assert flop_rate("float32", False) == (67e12, "fp32")
    assert flop_rate("float32", True) == (pytest.approx(494e12 * 0.55), "tf32")
    assert flop_rate("bfloat16", True) == (pytest.approx(989e12 * 0.55), "bf16")


def _gate_launches() -> list[gpu_aot.Launch]:
    """The launches of self-routing's gate, forward and backward, for ``x[8, 4, 16]``,
    ``wr[8, 16, 2]``, ``br[8, 2]``, ``act[4, 8]``."""
    from capsctl.layers.backend.triton.gate_ops import triton_gate

    x, wr = torch.randn(8, 4, 16, requires_grad=True), torch.randn(8, 16, 2, requires_grad=True)
    br, act = torch.randn(8, 2, requires_grad=True), torch.rand(4, 8, requires_grad=True)
    with gpu_aot.capturing() as launches:
        triton_gate(x, wr, br, act)[1].sum().backward()
    return launches


def test_the_cost_model_of_the_gate_worked_out_by_hand() -> None:
    forward, backward = _gate_launches()
    assert gpu_aot.describe(forward) == {"pass": "gate", "direction": "forward"}
    assert gpu_aot.describe(backward) == {"pass": "gate", "direction": "backward"}
    # forward: x 8*4*16 = 512 floats, wr 8*16*2 = 256, br 16, act 32, coef and mass 64 each:
    # 944 floats, 3776 bytes; per coefficient entry (8*4*2 = 64) the logits 2*16 = 32 FLOPs,
    # the softmax and the mass 5: 2368 FLOPs
    assert gpu_aot.launch_cost(forward) == {"bytes": 3776, "flops": 2368, "dtype": "float32"}
    # backward: wr 256, coef 64, act 32, G 64, dL 64, dX 512, d act 32: 1024 floats, 4096
    # bytes; per entry d act 2, the softmax's backward 5, dX 32: 2496 FLOPs
    assert gpu_aot.launch_cost(backward) == {"bytes": 4096, "flops": 2496, "dtype": "float32"}


def _squash_launches() -> list[gpu_aot.Launch]:
    """The launches of dynamic routing's squash, forward and backward, of ``s[10, 16]``."""
    from capsctl.layers.backend.triton.squash_ops import triton_squash

    s = torch.randn(10, 16, requires_grad=True)
    with gpu_aot.capturing() as launches:
        triton_squash(s).sum().backward()
    return launches


def test_the_cost_model_of_the_squash_worked_out_by_hand() -> None:
    forward, backward = _squash_launches()
    assert gpu_aot.describe(forward) == {"pass": "squash", "direction": "forward"}
    assert gpu_aot.describe(backward) == {"pass": "squash", "direction": "backward"}
    # forward: s and v, 160 floats each: 1280 bytes; 3 FLOPs an entry: 480
    assert gpu_aot.launch_cost(forward) == {"bytes": 1280, "flops": 480, "dtype": "float32"}
    # backward: s, G and ds: 1920 bytes; 6 FLOPs an entry: 960
    assert gpu_aot.launch_cost(backward) == {"bytes": 1920, "flops": 960, "dtype": "float32"}


def _e_step_launches() -> list[gpu_aot.Launch]:
    """The launches of EM's E-step on a conv layer, forward and backward: 2 images of 2 types
    on a 4x4 grid, 3x3 windows (8 sites of 18 children), 4 parent types."""
    from capsctl.layers.routers.em.windows import WindowGrid, triton_e_step

    grid = WindowGrid.of(torch.zeros(2, 4, 4, 2), 3, 1)
    quad = torch.rand(8, 18, 4, requires_grad=True)  # [B, J, m]
    c = torch.randn(8, 1, 4, requires_grad=True)
    with gpu_aot.capturing() as launches:
        triton_e_step(quad, c, grid).sum().backward()
    return launches


def test_the_cost_model_of_the_e_step_worked_out_by_hand() -> None:
    launches = _e_step_launches()
    assert [x.kernel for x in launches] == [
        "estep_forward", "overlap_reduce", "overlap_reduce", "estep_forward", "estep_rowdot",
        "overlap_reduce", "estep_backward",
    ]  # fmt: skip
    stats, top, total, apply, rowdot, _, backward = launches
    assert gpu_aot.describe(stats) == {"pass": "e_step", "direction": "forward"}
    assert gpu_aot.describe(backward) == {"pass": "e_step", "direction": "backward"}
    # 8 * 18 = 144 rows of 4: quad 576 floats, c 32; the statistics' max and sum 144 each
    # (the unwritten R is quad again): 896 floats, 3584 bytes; 4 FLOPs an entry: 2304
    assert gpu_aot.launch_cost(stats) == {"bytes": 3584, "flops": 2304, "dtype": "float32"}
    # the assignments: quad, c, top, total and R: 576 + 32 + 288 + 576 = 1472 floats
    assert gpu_aot.launch_cost(apply) == {"bytes": 5888, "flops": 2304, "dtype": "float32"}
    # sum R G: R, G 576 each, t 144: 1296 floats; 2 FLOPs an entry
    assert gpu_aot.launch_cost(rowdot) == {"bytes": 5184, "flops": 1152, "dtype": "float32"}
    # backward: R, G, t, d quad, dc (8 x 4): 576 * 3 + 144 + 32 = 1904 floats; 5 an entry
    assert gpu_aot.launch_cost(backward) == {"bytes": 7616, "flops": 2880, "dtype": "float32"}
    # each child's max over its windows (overlap.py), one kernel: [B, J] in and out, 144
    # floats each, 1152 bytes; 2 * 4 * 4 * 2 = 64 children, 9 offsets gathered: 576 FLOPs (an
    # upper bound: edge children fall in fewer windows)
    assert gpu_aot.launch_cost(top) == {"bytes": 1152, "flops": 576, "dtype": "float32"}
    assert [dict(x.constexprs)["MAX"] for x in (top, total)] == [True, False]
    assert gpu_aot.describe(top) == {"pass": "overlap", "direction": "forward"}


def test_the_cost_model_of_the_fused_e_step_and_moments_worked_out_by_hand() -> None:
    """EM's E-step fused into the next moments (em_estep.py) on an FC layer: 5 children, 3
    sites, 3 parent types of 4x4 poses; V = 5 * 3 * 3 * 16 = 720 vote entries."""
    from capsctl.layers.routers.em.windows import triton_e_then_moments

    q, p, shift = (torch.rand(3, 3, 4, 4, requires_grad=True) for _ in range(3))
    c, act = torch.rand(3, 3, requires_grad=True), torch.rand(3, 5, requires_grad=True)
    x, w = torch.rand(5, 3, 4, 4, requires_grad=True), torch.rand(5, 4, 3, 4, requires_grad=True)
    with gpu_aot.capturing() as launches:
        s, mass = triton_e_then_moments(q, p, c, act, x, w, shift.detach(), None)
        (s.sum() + mass.sum()).backward()
    kernels = [launch.kernel for launch in launches]
    assert kernels == [
        "em_estep_stats", "em_estep_moments", "em_estep_rowdot", "em_estep_parent_grad",
        "em_estep_input_grad", "em_estep_weight_grad",
    ]  # fmt: skip
    stats, moments = launches[:2]
    assert gpu_aot.describe(stats) == {"pass": "em_estep_moments", "direction": "forward"}
    assert gpu_aot.describe(launches[3]) == {"pass": "em_estep_moments", "direction": "backward"}
    # x, w 240 floats each; shift, q, p 144 each; c 9; zmax and esum [B, J] 15 each: 951 floats;
    # (2X + 5) FLOPs a vote entry
    assert gpu_aot.launch_cost(stats) == {"bytes": 3804, "flops": 13 * 720, "dtype": "float32"}
    # x, w, shift, q, p, c as above (921), lse and act 15 each, S1 and S2 of one span 144 each,
    # mass 9: 1248 floats; (2X + 9) a vote entry
    assert gpu_aot.launch_cost(moments) == {"bytes": 4992, "flops": 17 * 720, "dtype": "float32"}


def _m_step_launches() -> list[gpu_aot.Launch]:
    """The launches of EM's M-step rest, forward and backward: 3 sites, 4 parent types of 16
    pose entries."""
    from capsctl.layers.backend.triton.mstep_ops import triton_m_step

    s = torch.rand(2, 3, 16, 4, requires_grad=True)  # [2, B, d, m]
    mass = torch.rand(3, 4, 1, requires_grad=True)
    beta_u, beta_a = torch.zeros(4, requires_grad=True), torch.zeros(4, requires_grad=True)
    with gpu_aot.capturing() as launches:
        mu, act, qp, c = triton_m_step(
            s, mass, torch.zeros(3, 16, 4), beta_u, beta_a, 0.5, 1e-7, 5e-4
        )
        (mu.sum() + act.sum() + qp.sum() + c.sum()).backward()
    return launches


def test_the_cost_model_of_the_m_step_worked_out_by_hand() -> None:
    forward, backward = _m_step_launches()
    assert gpu_aot.describe(forward) == {"pass": "m_step", "direction": "forward"}
    # forward: S 2*3*16*4 = 384 floats, mass 12, shift 192, betas 8, mu 192, act 12, qp 384,
    # c 12: 1196 floats, 4784 bytes; 20 FLOPs a parent pose entry (3*4*16 = 192): 3840
    assert gpu_aot.launch_cost(forward) == {"bytes": 4784, "flops": 3840, "dtype": "float32"}
    # backward: the inputs (596 floats), the outputs' gradients (600), dS 384, dM 12 and the
    # programs' beta sums (1 program: 2*4): 1600 floats, 6400 bytes; 60 FLOPs an entry
    assert gpu_aot.launch_cost(backward) == {"bytes": 6400, "flops": 11520, "dtype": "float32"}


@pytest.mark.slow
def test_the_gate_squash_and_em_step_kernels_keep_the_budgets_on_sm_90a(tmp_path: Path) -> None:
    launches = _gate_launches() + _squash_launches() + _e_step_launches() + _m_step_launches()
    with gpu_aot.Compiler(tmp_path, timeout=120) as compiler:
        for launch in launches:
            out = compiler.compile(launch.spec(), 90)
            assert gpu_aot.broken_budgets(out, launch.kernel) == [], (launch.kernel, out)
            assert (out["mma"] > 0) == launch.kernel.startswith("gate_"), (launch.kernel, out)


def test_the_operators_of_a_step_are_costed_as_worked_out_by_hand() -> None:
    # a linear layer of 16 -> 4 without bias on a batch of 8, one step in float32
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 4, bias=False))
    ops: list = []
    assert gpu_aot.capture_step(net, (8, 1, 4, 4), 4, ops=ops) == []
    products = [o for o in ops if o.product]
    # forward x[8, 16] @ w^T[16, 4]: 2*8*16*4 = 1024 FLOPs, reading 128 + 64 floats and writing
    # 32: 896 bytes; backward dW = dY^T x (32 + 128 in, 64 out) and no dX (the input needs no
    # gradient): 1024 FLOPs, 896 bytes
    assert [(o.flops, o.bytes, o.dtype) for o in products] == [
        (1024, 896, "float32"), (1024, 896, "float32")
    ]  # fmt: skip
    # views move no data and are not operators of the step; the loss's operators are
    assert not [o for o in ops if o.op in ("view", "t", "expand", "empty")]
    # nor do the views ATen leaves untagged, as reshape's of a fresh result
    a, b = torch.randn(4, 6), torch.randn(6, 2)
    with recording() as seen:
        torch.ops.aten._unsafe_view(a @ b, [8])
    assert [o.op for o in seen] == ["mm"]
    # a fill shaped after another tensor writes its output and reads nothing: 8 floats
    with recording() as seen:
        big = torch.empty(1000)
        big.new_zeros(8), torch.zeros_like(b)
    assert [(o.op, o.bytes) for o in seen] == [("new_zeros", 32), ("zeros_like", 48)]
    assert {"_log_softmax", "nll_loss_forward"} <= {o.op for o in ops}
    # each modelled as a kernel: its bytes or FLOPs at the H100's rates, plus a launch
    assert gpu_aot.op_us(products[0]) == pytest.approx(896 / 2.68e12 * 1e6 + 5.0)


def test_the_modelled_steps_add_the_kernels_to_the_other_operators() -> None:
    steps = [
        {"model": "m", "router": "idpa", "schedule": None, "precision": "bf16",
         "modelled_us": 40.0, "other_us": 260.0, "launches": 4, "modelled_launches": 4},
        {"model": "m", "router": "idpa", "schedule": None, "precision": "float32",
         "modelled_us": 50.0, "other_us": 500.0, "launches": 4, "modelled_launches": 3},
    ]  # fmt: skip
    (row,) = gpu_aot.step_table(steps, {"modelled_us": 200.0})
    assert row["step_us"] == 300.0 and row["vs_baseline"] == 1.5 and row["complete"]


def test_a_launch_keeps_what_triton_specializes_on() -> None:
    launch = _weighted_launch()
    sig = dict(launch.signature)
    assert sig["x_ptr"] == "*fp32" and sig["scale"] == "fp32" and sig["XD"] == "constexpr"
    assert dict(launch.constexprs)["ACC"] == "tl.fp32"
    assert "x_ptr" in launch.divisible and "B" not in launch.divisible  # B = 4
    assert "M" not in launch.divisible and sig["J"] == "i32"  # J = 8, M = 2
    # the padded tile (plan.py): x's width 4 to float32's MMA K of 8, and m*c = 2*4 to 16;
    # int32 offsets; the launch options the variant is compiled with
    consts = dict(launch.constexprs)
    assert (consts["KP"], consts["MP"], consts["CP"], consts["I64"]) == (8, 2, 8, False)
    assert sig["BB"] == "constexpr" and dict(launch.options) == {"num_warps": 4, "num_stages": 2}
    shifted = _weighted_launch(offset=1)  # x 4 bytes into its storage: not 16-byte aligned
    assert "x_ptr" not in shifted.divisible and shifted.key != launch.key
    assert _weighted_launch().key == launch.key


def test_ptx_counts_find_atomics_mmas_int64_offsets_and_vector_loads() -> None:
    from capsctl.layers.backend.triton.aot_compile import ptx_counts

    ptx = "\n".join(
        [
            "\t@%p1 atom.global.gpu.acq_rel.add.f32 %r1, [ %rd1 + 0 ], %r2;",
            "\tred.global.gpu.relaxed.add.f32 [ %rd2 + 0 ], %r3;",
            "\t@!%p2 red.global.gpu.acq_rel.add.v4.f32 [ %rd3 + 0 ], {%r4, %r5, %r6, %r7};",
            "\tmma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%f1}, {%r1}, {%r2}, {%f2};",
            "\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f3}, %rd4, %rd5;",
            "\tmul.lo.s64 %rd6, %rd7, 16;",
            "\tmad.lo.s64 %rd8, %rd9, %rd10, %rd11;",
            "\tmul.wide.s32 %rd12, %r8, 4;",  # an int32 offset widened: not counted
            "\tld.global.b32 %r9, [ %rd1 + 0 ];",
            "\tld.global.L1::evict_last.v4.b32 { %r10, %r11, %r12, %r13 }, [ %rd2 + 0 ];",
        ]
    )
    counts = ptx_counts(ptx)
    assert counts["atomics"] == 3 and counts["acq_rel_atomics"] == 2 and counts["mma"] == 2
    assert counts["int64_offsets"] == 2
    assert counts["global_loads"] == 2 and counts["vector_loads"] == 1


def test_architectures_are_named_as_triton_names_them() -> None:
    assert [gpu_aot.arch_number(a) for a in ("sm_80", "sm_90", "sm_90a", "100")] == [
        80,
        90,
        90,
        100,
    ]
    assert [gpu_aot.arch_name(n) for n in (80, 90, 100)] == ["sm_80", "sm_90a", "sm_100a"]
    with pytest.raises(ValueError):
        gpu_aot.arch_number("gfx942")


def _tiny_captures() -> list[tuple[dict, list]]:
    out = []
    for router, preset in PRESETS.items():
        torch.manual_seed(0)
        net = build_model({"base": preset, **TINY}).train()
        launches = gpu_aot.capture_step(net, (2, 3, 8, 8), 2)
        out.append(({"model": preset, "router": router, "schedule": None,
                     "precision": "float32"}, launches))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """One variant per routing algorithm compiled for sm_90a: the report's rows."""
    variants = gpu_aot.group_variants(_tiny_captures())
    rows = []
    with gpu_aot.Compiler(tmp_path_factory.mktemp("triton-cache"), timeout=120) as compiler:
        for router, (name, direction) in PICK.items():
            v = next(
                v
                for v in variants
                if router in v.contexts("router")
                and gpu_aot.describe(v.launch) == {"pass": name, "direction": direction}
            )
            rows.append(gpu_aot.variant_row(v, 90, compiler.compile(v.spec(), 90)))
    return rows


@pytest.mark.slow
def test_one_variant_per_router_compiles_for_sm_90a_with_a_well_formed_row(
    compiled: list[dict],
) -> None:
    assert [r["router"] for r in compiled] == list(PICK)
    for row in compiled:
        assert "error" not in row and not row.get("timed_out"), row
        assert row["arch"] == row["ptx_target"] == "sm_90a"
        assert (row["pass"], row["direction"]) == PICK[row["router"]]
        assert row["model"] == PRESETS[row["router"]] and row["schedule"] is None
        assert row["dtype"] == "float32" and row["precisions"] == ["float32"]
        assert 0 < row["registers"] <= 255
        assert all(isinstance(row[k], int) and row[k] >= 0 for k in FIELDS), row
        assert row["atomics"] >= row["acq_rel_atomics"]
        # EM's E-step kernels take twice their plan's warps (estep_moments_ops.py)
        assert row["num_warps"] == (8 if row["router"] == "em" else 4)
        assert 0 < row["compile_s"] < 120 and row["modelled_us"] >= 5.0
        assert row["flop_rate"] == ("tf32" if row["mma"] else "fp32")
        assert isinstance(row["broken"], list) and row["shapes"][0]["bytes"] > 0
    summary = gpu_aot.budget_summary(compiled)
    assert summary["arch"] == "sm_90a" and summary["checked"] == len(PICK)
    assert set(summary["limits"]) == set(gpu_aot.BUDGETS) - {"arch"}
    json.dumps(summary), json.dumps(compiled)


@pytest.mark.slow
def test_every_variant_keeps_the_budgets_on_sm_90a(compiled: list[dict]) -> None:
    assert [r["broken"] for r in compiled] == [[]] * len(compiled)


def _dynamic_routed_step() -> list[gpu_aot.Launch]:
    """The launches of one routed pass, forward and backward, at dynamic routing's widest
    shape: 32 parents of 16-wide poses from 16-wide child poses (cifar10-dynamic's conv layer;
    the constexprs are those of its 288 children at 6,272 sites)."""
    from capsctl.layers.backend.triton.ops import triton_routed

    x = torch.randn(16, 16, 1, 16, requires_grad=True)  # [J, B, a, x]
    w = torch.randn(16, 16, 32, 16, requires_grad=True)  # [J, x, m, c]
    p = torch.randn(16, 32, 1, 16, requires_grad=True)  # [B, m, a, c]
    with gpu_aot.capturing() as launches:
        s, _ = triton_routed(x, w, p, 0.25)
        s.sum().backward()
    return launches


@pytest.mark.slow
def test_the_routed_kernels_keep_the_budgets_at_dynamic_routings_widest_poses(
    tmp_path: Path,
) -> None:
    # the backward of this shape used 255 registers and spilled while dX was a product in the
    # first backward kernel, beside the votes; a kernel of its own keeps each within budget
    launches = _dynamic_routed_step()
    assert [v.kernel for v in launches] == [
        "pass_forward", "pass_backward", "pass_input_grad", "pass_weight_grad"
    ]  # fmt: skip
    with gpu_aot.Compiler(tmp_path, timeout=120) as compiler:
        for launch in launches:
            out = compiler.compile(launch.spec(), 90)
            assert gpu_aot.broken_budgets(out) == [], (launch.kernel, out)


def _em_estep_launches(m: int) -> list[gpu_aot.Launch]:
    """Float32 launches of EM's fused E-step and moments, forward and backward, at ``m``
    parents of 6x6 poses from 6x6 child poses (few children and sites)."""
    from capsctl.layers.backend.triton.estep_moments_ops import (
        triton_em_estep_grads,
        triton_em_estep_moments,
        triton_em_estep_rowdot,
    )

    j, bsz = 4, 2
    parent = [torch.rand(bsz, m, 6, 6) for _ in range(3)]  # q, p, shift: [B, m, a, c]
    c, lse, act = torch.rand(bsz, m), torch.rand(bsz, j), torch.rand(bsz, j)
    x, w = torch.rand(j, bsz, 6, 6), torch.rand(j, 6, m, 6)  # [J, B, a, x], [J, x, m, c]
    q, p, shift = parent
    with gpu_aot.capturing() as launches:
        triton_em_estep_moments(q, p, c, lse, act, x, w, shift, [0, 0])
        g = (q, p, c)  # gS1, gS2 [B, m, a, c], gmass [B, m]
        triton_em_estep_rowdot(q, p, c, lse, act, x, w, shift, *g, [0, 0])
        triton_em_estep_grads(q, p, c, lse, act, x, w, shift, *g, lse, [True] * 3, [0, 0])
    return launches


def _cifar100_widest_launches() -> list[gpu_aot.Launch]:
    """Float32 launches at the CIFAR-100 models' widest shapes (the constexprs of the real
    ones; few sites): dynamic routing's routed pass over 32 parents of 36-wide vectors,
    self-routing's weighted pass over 32 parents of 6x6 poses, and EM's M-step of 100 classes
    of 6x6 poses, each forward and backward."""
    from capsctl.layers.backend.triton.mstep_ops import triton_m_step
    from capsctl.layers.backend.triton.ops import triton_routed, triton_weighted

    def leaf(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, requires_grad=True)

    with gpu_aot.capturing() as launches:
        s, _ = triton_routed(leaf(4, 16, 1, 36), leaf(4, 36, 32, 36), leaf(16, 32, 1, 36), 1 / 6)
        s.sum().backward()  # [J, B, a, x], [J, x, m, c], [B, m, a, c]
        triton_weighted(leaf(4, 2, 6, 6), leaf(4, 6, 32, 6), leaf(4, 2, 32)).sum().backward()
        mu, act, _, _ = triton_m_step(
            leaf(2, 2, 36, 100),
            leaf(2, 100, 1),
            torch.rand(2, 36, 100),
            leaf(100),
            leaf(100),
            0.01,
            1e-7,
            5e-4,
        )  # [2, B, d, m], [B, m, 1], [B, d, m], [m], [m]
        (mu.sum() + act.sum()).backward()
    return launches + _em_estep_launches(100)


@pytest.mark.slow
def test_the_kernels_keep_the_budgets_at_the_cifar100_models_widest_shapes(
    tmp_path: Path,
) -> None:
    # on sm_90a, before: the routed forward and backward spilled up to 54 KB a thread and took
    # up to 78 s to compile (one program held a child's weights for all 32 parents), the
    # weighted input gradient held 246 registers, the M-step 255 and spilled, EM's E-step
    # kernels at 100 classes spilled up to 272 bytes
    launches = _cifar100_widest_launches()
    kernels = [v.kernel for v in launches]
    # the routed pass of 36-wide vectors is weighted launches on blocks of parents
    assert kernels[:2] == ["pass_backward", "pass_forward"], kernels
    votes = [v for v in launches if v.kernel in ("pass_forward", "pass_backward")]
    assert not any(v.value("ROUTED") for v in votes)
    # R = softmax_m(A) is taken inside the forward's weighted sum, dA inside the backward's dP
    sums = [v.value("COEF") for v in votes if v.kernel == "pass_forward"]
    assert sums[:2] == [1, 2], sums
    assert {"pass_input_grad", "m_step_forward", "m_step_backward"} <= set(kernels)
    with gpu_aot.Compiler(tmp_path, timeout=120) as compiler:
        for launch in {v.key: v for v in launches}.values():
            out = compiler.compile(launch.spec(), 90)
            assert gpu_aot.broken_budgets(out, launch.kernel) == [], (launch.kernel, out)


def test_a_variant_past_the_timeout_is_reported_as_timed_out(tmp_path: Path) -> None:
    spec = _weighted_launch().spec()
    with gpu_aot.Compiler(tmp_path, timeout=0.01) as compiler:
        out = compiler.compile(spec, 90)
    assert out["timed_out"] is True and out["compile_s"] < 5
    row = {"timed_out": True, "compile_s": out["compile_s"]}
    assert gpu_aot.broken_budgets(row) == ["compile_s"]


@pytest.mark.parametrize("router", ["idpa", "self"])
def test_under_bf16_autocast_the_votes_reach_the_kernels_in_bf16(router: str) -> None:
    # the routed pass (IDPA) and self-routing's weighted pass build their votes from bf16 poses
    # and weights, with float32 sums; self-routing's logits and mass stay float32
    torch.manual_seed(0)
    net = build_model({"base": PRESETS[router], **TINY}).train()
    launches = gpu_aot.capture_step(net, (2, 3, 8, 8), 2, amp=True)
    votes = [v for v in launches if v.kernel in ("pass_forward", "pass_backward")]
    assert votes and {dict(v.signature)["x_ptr"] for v in votes} == {"*bf16"}
    assert {dict(v.constexprs)["ACC"] for v in votes} == {"tl.fp32"}
    if router == "self":
        forward = next(v for v in votes if v.kernel == "pass_forward")
        assert dict(forward.signature)["r_ptr"] == "*fp32"  # the mass


def test_the_modelled_step_is_a_steady_one_without_the_first_steps_proof() -> None:
    """A fused pass proves its backward once at new shapes (dispatch.run_fused), in a training's
    first step only: the captured step is the steady one, each launch and operator once, and
    the proof's record of shapes is left as it was."""
    torch.manual_seed(0)
    net = build_model({"base": PRESETS["dynamic"], **TINY}).train()
    before = set(dispatch._FUSED_PROVEN)
    ops: list = []
    launches = gpu_aot.capture_step(net, (2, 3, 8, 8), 2, ops=ops)
    assert before == dispatch._FUSED_PROVEN
    forward = [v for v in launches if v.kernel == "pass_forward"]
    # dynamic routing's T=3: two routed passes a layer, each launched once forward
    torch.manual_seed(0)
    layers = len(build_model({"base": PRESETS["dynamic"], **TINY}).capsules)
    assert len(forward) == 2 * layers


def test_the_script_captures_and_writes_its_report(tmp_path: Path, capsys) -> None:
    out = tmp_path / "aot.json"
    argv = ["--models", "cifar10-caps-fast", "--batch", "4", "--capture-only", "--out", str(out)]
    assert script.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["complete"] and doc["models"] == ["cifar10-caps-fast"]
    # the routed forward, its backward's three kernels (dA and dP; dX; dW), each in float32 and
    # in bf16 (under autocast the routed pass takes bf16 into the kernels)
    assert doc["distinct_variants"] == 8 and doc["variants"] == []
    assert {s["precision"] for s in doc["steps"]} == {"float32", "bf16"}
    # the modelled bf16 steps beside ResNet-18's, incomplete where nothing was compiled
    assert doc["baseline"]["model"] == "resnet18" and doc["baseline"]["modelled_us"] > 5.0
    rows = doc["modelled_steps"]
    assert [(r["schedule"], r["complete"]) for r in rows] == [
        ("concurrent", False), ("sequential", False)
    ]  # fmt: skip
    assert all(r["step_us"] == pytest.approx(r["routing_us"] + r["other_us"]) for r in rows)
    assert doc["triton"] and doc["scope"] == "all" and "budgets" in doc
    assert "budgets on sm_90a" in capsys.readouterr().out
