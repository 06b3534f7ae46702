"""Benchmark core: rows, ratios, routing overrides, errors, memory sampling, events, JSON."""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch import nn

import capsctl.bench.measure as measure
import capsctl.bench.memory as memory
from capsctl.bench import (
    BenchRow,
    RssSampler,
    add_ratios,
    current_rss_bytes,
    release_memory,
    rows_to_csv,
    rows_to_json,
    run_bench,
)
from capsctl.config import resolve_config
from capsctl.errors import ConfigError, UsageError
from capsctl.layers import native_summary
from capsctl.models.capsnet import CapsNet

MB = 1024 * 1024
TINY = {"base": "mnist-caps", "primary_types": 4, "primary_dim": 4, "layers": [], "input_size": 16}
TINY_CNN = {**TINY, "base": "mnist-cnn"}
FAST = dict(batch_size=2, iters=1, warmup=0)
Run = tuple[list[BenchRow], list[dict]]


def tiny(label: str = "tiny-caps", **fields: object) -> tuple[str, object]:
    return label, resolve_config({**TINY, **fields})


@pytest.fixture(scope="module")
def with_resnet() -> Run:
    events: list[dict] = []
    rows = run_bench(["resnet18", tiny()], batch_size=2, iters=1, warmup=1, on_event=events.append)
    return rows, events


def test_rows_have_fields_and_positive_numbers(with_resnet: Run) -> None:
    rows, _ = with_resnet
    assert [r.name for r in rows] == ["resnet18", "tiny-caps"]
    resnet, caps = rows
    assert resnet.arch == "resnet18" and caps.arch == "capsnet"
    assert resnet.params == 11_173_962
    for r in rows:
        assert r.batch_size == 2 and r.device == "cpu"
        assert r.params > 0
        assert r.train_step_s is not None and r.train_step_s > 0
        assert r.train_step_min_s is not None and 0 < r.train_step_min_s <= r.train_step_s
        assert r.infer_images_per_s is not None and r.infer_images_per_s > 0
        assert r.peak_rss_bytes is not None and r.peak_rss_bytes > 10 * MB
        assert r.peak_device_bytes is None
    assert resnet.iterations is None and resnet.routing is None
    assert caps.iterations == 2 and caps.routing == "concurrent"
    # which implementation ran the routing's passes: none for ResNet-18
    assert resnet.routing_backend is None
    assert caps.routing_backend in ("native", "chunked", "native+chunked")
    d = caps.to_dict()
    assert set(d) == {f.name for f in BenchRow.__dataclass_fields__.values()}
    assert d["name"] == "tiny-caps"
    # the machine's load as each model's measurement ended: above its CPUs, a shared machine
    for r in rows:
        assert r.cpus is not None and r.cpus >= 1 and r.load_1m is not None and r.load_1m >= 0
        assert r.shared() == (r.load_1m > r.cpus)


def test_a_shared_machine_is_said_under_the_table(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from capsctl.views.measure import print_bench

    monkeypatch.setattr(measure, "machine_load", lambda: {"load_1m": 3.5, "cpus": 2})
    rows = run_bench([tiny()], **FAST)
    assert (rows[0].load_1m, rows[0].cpus, rows[0].shared()) == (3.5, 2, True)
    assert rows_to_csv(rows).splitlines()[1].endswith(",3.5,2")
    print_bench(rows, 2, 1)
    assert "shared machine" in " ".join(capsys.readouterr().err.split())
    monkeypatch.setattr(measure, "machine_load", lambda: {"load_1m": 0.5, "cpus": 2})
    print_bench(run_bench([tiny()], **FAST), 2, 1)
    assert "shared machine" not in capsys.readouterr().err


def test_ratios_relative_to_resnet18(with_resnet: Run) -> None:
    resnet, caps = with_resnet[0]
    assert resnet.train_ratio == 1.0 and resnet.infer_ratio == 1.0
    assert caps.train_ratio == pytest.approx(caps.train_step_s / resnet.train_step_s)
    assert caps.infer_ratio == pytest.approx(resnet.infer_images_per_s / caps.infer_images_per_s)


def test_events(with_resnet: Run) -> None:
    _, events = with_resnet
    models = [e for e in events if e["event"] == "bench_model"]
    assert models == [
        {"event": "bench_model", "name": "resnet18", "step": 1, "steps": 2},
        {"event": "bench_model", "name": "tiny-caps", "step": 2, "steps": 2},
    ]
    steps = [e for e in events if e["event"] == "bench_step" and e["name"] == "tiny-caps"]
    assert [(e["phase"], e["step"], e["steps"], e["warmup"]) for e in steps] == [
        ("train", 1, 2, True),
        ("train", 2, 2, False),
        ("infer", 1, 2, True),
        ("infer", 2, 2, False),
    ]
    # model event comes before its steps
    assert events.index(models[1]) < events.index(steps[0])


def test_ratios_none_without_resnet18() -> None:
    rows = run_bench([tiny(), ("tiny-cnn", resolve_config(TINY_CNN))], **FAST)
    assert all(r.train_ratio is None and r.infer_ratio is None for r in rows)
    cnn = rows[1]
    assert cnn.arch == "cnn" and cnn.iterations is None and cnn.routing is None


def test_add_ratios_with_explicit_reference() -> None:
    def row(name: str, train: float | None, ips: float | None) -> BenchRow:
        return BenchRow(name, "capsnet", 1, 2, "cpu", None, None, train, train, ips, None, None)

    ref, other, half = row("ref", 2.0, 100.0), row("a", 4.0, 25.0), row("b", None, None)
    add_ratios([other, half], reference=ref)
    assert other.train_ratio == 2.0 and other.infer_ratio == 4.0
    assert half.train_ratio is None and half.infer_ratio is None


def test_routing_override_reaches_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []
    modes_used: list[str] = []
    original_set, original_caps = CapsNet.set_routing, CapsNet.class_capsules

    def spy_set(self: CapsNet, iterations: int | None = None, mode: str | None = None) -> None:
        original_set(self, iterations, mode)
        calls.append((iterations, mode, self.iterations, self.routing))

    def spy_poses(self: CapsNet, *args: object, **kwargs: object):  # noqa: ANN202
        modes_used.append((self.routing, self.iterations))
        return original_caps(self, *args, **kwargs)

    monkeypatch.setattr(CapsNet, "set_routing", spy_set)
    monkeypatch.setattr(CapsNet, "class_capsules", spy_poses)
    rows = run_bench(
        [tiny(), ("tiny-cnn", resolve_config(TINY_CNN))], iterations=3, routing="sequential", **FAST
    )
    assert calls == [(3, "sequential", 3, "sequential")]  # once, and only for the capsule model
    assert modes_used and set(modes_used) == {("sequential", 3)}  # every forward pass used it
    assert (rows[0].iterations, rows[0].routing) == (3, "sequential")
    assert (rows[1].iterations, rows[1].routing) == (None, None)


def test_amp_and_channels_last_reach_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``amp`` every forward pass runs in bf16 autocast, with ``channels_last`` the input
    arrives in that layout; the rows say how they were measured."""
    seen: list[tuple[bool, bool]] = []
    original = CapsNet.forward

    def spy(self: CapsNet, x: torch.Tensor, *args: object, **kwargs: object):  # noqa: ANN202
        autocast_on = torch.is_autocast_enabled("cpu")
        last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        seen.append((autocast_on, last))
        return original(self, x, *args, **kwargs)

    monkeypatch.setattr(CapsNet, "forward", spy)
    rgb = tiny(in_channels=3)
    (row,) = run_bench([rgb], amp=True, channels_last=True, **{**FAST, "batch_size": 3})
    assert seen and set(seen) == {(True, True)}
    assert row.amp and row.channels_last and not row.compiled
    seen.clear()
    (plain,) = run_bench([rgb], **{**FAST, "batch_size": 3})
    assert set(seen) == {(False, False)} and not plain.amp and not plain.channels_last


def test_compile_times_the_compiled_model(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[nn.Module] = []

    def fake_compile(model: nn.Module) -> nn.Module:
        compiled.append(model)
        return model

    monkeypatch.setattr(measure.torch, "compile", fake_compile)
    (row,) = run_bench([tiny()], compile=True, batch_size=2, iters=1, warmup=1)
    assert len(compiled) == 1 and isinstance(compiled[0], CapsNet) and row.compiled


def test_the_rows_say_which_backend_ran_the_passes() -> None:
    from capsctl.layers import dispatch

    with dispatch.use("chunked"):
        (row,) = run_bench([tiny()], **FAST)
    assert row.routing_backend == "chunked"
    assert "routing_backend" in rows_to_csv([row]).splitlines()[0].split(",")
    cells = rows_to_csv([row]).splitlines()[1].split(",")
    assert cells[-3] == "chunked"  # then the machine's load and CPUs


def test_channels_last_takes_a_model_with_5d_capsule_weights() -> None:
    """Self-routing's capsule weights are 5-d: only the 4-d convolution weights go channels_last
    (``Module.to(memory_format=...)`` refuses the whole model)."""
    import torch

    from capsctl.models import to_channels_last

    conv_layer = [{"kind": "conv", "types": 4, "pose_dim": 4, "kernel": 3, "stride": 2}]
    model = tiny("tiny-self", router={"name": "self"}, layers=conv_layer, input_size=28)
    (row,) = run_bench([model], channels_last=True, **FAST)
    assert row.channels_last and row.train_step_s is not None
    conv = torch.nn.Conv3d(2, 2, 1)  # a 5-d weight, kept as it is
    one_channel = torch.nn.Conv2d(1, 4, 3)  # [4, 1, 3, 3]: contiguous in both formats
    net = to_channels_last(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), conv, one_channel))
    assert net[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert not net[0].weight.is_contiguous() and net[1].weight.is_contiguous()
    assert net[2].weight.stride() == (9, 1, 3, 1)  # the strides torch's own conversion gives


def test_no_override_keeps_config_routing(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []
    monkeypatch.setattr(CapsNet, "set_routing", lambda self, *a, **k: calls.append(a))
    (row,) = run_bench([tiny(iterations=4)], **FAST)
    assert calls == []
    assert (row.iterations, row.routing) == (4, "concurrent")


def test_phases_can_be_skipped() -> None:
    events: list[dict] = []
    (row,) = run_bench([tiny()], train=False, on_event=events.append, **FAST)
    assert row.train_step_s is None and row.train_step_min_s is None
    assert row.infer_images_per_s is not None and row.infer_images_per_s > 0
    assert {e.get("phase") for e in events if e["event"] == "bench_step"} == {"infer"}
    (row,) = run_bench([tiny()], infer=False, **FAST)
    assert row.infer_images_per_s is None and row.train_step_s is not None


def test_model_specs_names_configs_and_mappings() -> None:
    rows = run_bench([resolve_config(TINY), TINY], train=False, **FAST)
    assert rows[0].name == "custom-capsnet"
    assert rows[1].name == "mnist-caps (custom)"


def test_unknown_model_is_config_error_before_measuring() -> None:
    events: list[dict] = []
    with pytest.raises(ConfigError, match="unknown model 'nope'"):
        run_bench([tiny(), "nope"], on_event=events.append, **FAST)
    assert events == []


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "gpu"])
def test_bad_device_is_usage_error(device: str) -> None:
    with pytest.raises(UsageError):
        run_bench([tiny()], device=device, **FAST)


@pytest.mark.skipif(torch.cuda.is_available(), reason="cuda is available here")
def test_unavailable_cuda_is_usage_error() -> None:
    with pytest.raises(UsageError, match="no CUDA device is available here; use --device cpu"):
        run_bench([tiny()], device="cuda", **FAST)
    (row,) = run_bench([tiny()], device="auto", **FAST)
    assert row.device == "cpu"


def test_unavailable_mps_is_usage_error() -> None:
    if torch.backends.mps.is_available():
        pytest.skip("mps is available here")
    with pytest.raises(UsageError, match="no MPS device is available here"):
        run_bench([tiny()], device="mps", **FAST)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(iters=0),
        dict(warmup=-1),
        dict(batch_size=0),
        dict(iterations=0),
        dict(routing="parallel"),
        dict(threads=0),
        dict(compile=True),  # compiling happens in the warm-up steps: FAST has none
    ],
)
def test_bad_arguments_are_usage_errors(kwargs: dict) -> None:
    args = {**FAST, **kwargs}
    with pytest.raises(UsageError):
        run_bench([tiny()], **args)


def test_threads_sets_torch_threads() -> None:
    before = torch.get_num_threads()
    try:
        run_bench([tiny()], threads=1, train=False, **FAST)
        assert torch.get_num_threads() == 1
        assert rows_to_json([])["threads"] == 1
    finally:
        torch.set_num_threads(before)


def test_global_rng_is_left_alone_and_runs_are_seeded(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[torch.Tensor] = []
    original = CapsNet.forward

    def spy(self: CapsNet, x: torch.Tensor, *a: object, **k: object):  # noqa: ANN202
        seen.append(x.clone())
        return original(self, x, *a, **k)

    monkeypatch.setattr(CapsNet, "forward", spy)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    run_bench([tiny()], train=False, **FAST)
    assert torch.equal(torch.get_rng_state(), state)
    run_bench([tiny()], train=False, **FAST)
    run_bench([tiny()], train=False, seed=1, **FAST)
    assert torch.equal(seen[0], seen[1]) and not torch.equal(seen[0], seen[2])


# ---------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------


def test_current_rss_is_plausible() -> None:
    rss = current_rss_bytes()
    if rss is None:
        pytest.skip("no /proc here")
    assert rss > 10 * MB


def test_sampler_sees_a_transient_200mb_allocation() -> None:
    if current_rss_bytes() is None:
        pytest.skip("no /proc here")
    release_memory()

    def allocate() -> None:
        x = torch.ones(200 * MB // 4)  # 200 MB, touched
        time.sleep(0.05)
        del x

    with RssSampler() as base:
        time.sleep(0.02)
    with RssSampler() as sampler:
        allocate()
    assert sampler.source == "statm" and sampler.samples >= 3
    assert sampler.peak_bytes >= base.peak_bytes + 150 * MB


def test_sampler_falls_back_to_ru_maxrss(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("resource")
    monkeypatch.setattr(memory, "_STATM", "/nonexistent/statm")
    with RssSampler() as sampler:
        pass
    assert sampler.source == "ru_maxrss"
    assert sampler.peak_bytes is not None and sampler.peak_bytes > 10 * MB


class _Hog(nn.Module):
    """A tiny model whose forward pass briefly holds a 300 MB tensor."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        big = torch.ones(300 * MB // 4)
        time.sleep(0.02)
        return self.inner(x) + big[:1] * 0


def test_big_allocation_shows_a_higher_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    if current_rss_bytes() is None:
        pytest.skip("no /proc here")
    real_build = measure.build_model

    def build(cfg):  # noqa: ANN001, ANN202
        model = real_build(cfg)
        return _Hog(model) if cfg.num_classes == 3 else model

    monkeypatch.setattr(measure, "build_model", build)
    small, hog = run_bench([tiny("small"), tiny("hog", num_classes=3)], **FAST)
    assert hog.peak_rss_bytes >= small.peak_rss_bytes + 200 * MB


# ---------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------


def test_rows_to_json_is_serializable(with_resnet: Run) -> None:
    rows, _ = with_resnet
    report = rows_to_json(rows, {"device": "cpu", "batch_size": 2, "iters": 1})
    text = json.dumps(report)
    back = json.loads(text)
    assert back["device"] == "cpu" and back["batch_size"] == 2 and back["iters"] == 1
    assert back["torch"] == torch.__version__
    assert back["threads"] == torch.get_num_threads()
    assert back["routing_kernels"] == native_summary()
    assert back["routing_kernels"] == "compiled loops" or back["routing_kernels"].startswith(
        "torch code ("
    )
    assert [r["name"] for r in back["rows"]] == ["resnet18", "tiny-caps"]
    assert back["rows"][0]["train_ratio"] == 1.0
    default = rows_to_json(rows)
    assert default["device"] == "cpu" and default["batch_size"] == 2


# ---------------------------------------------------------------------------------------------
# CSV (timm's benchmark.py column names)

BENCH_HEADER = (
    "model,infer_samples_per_sec,infer_step_time,infer_batch_size,infer_img_size,"
    "train_samples_per_sec,train_step_time,train_batch_size,train_img_size,param_count,"
    "arch,device,iterations,routing,train_step_time_min,train_ratio,infer_ratio,"
    "peak_rss_bytes,peak_device_bytes,params,routing_backend,load_1m,cpus"
)


def _csv(text: str) -> list[dict[str, str]]:
    import csv
    import io

    return list(csv.DictReader(io.StringIO(text)))


def test_rows_to_csv_header_and_units() -> None:
    row = BenchRow(
        name="m",
        arch="capsnet",
        params=1_234_567,
        batch_size=8,
        device="cpu",
        iterations=2,
        routing="concurrent",
        train_step_s=0.25,  # 8 images / 0.25 s = 32 images/s; 250 ms
        train_step_min_s=0.2,
        infer_images_per_s=64.0,  # 8 images / 64 images/s = 125 ms per step
        peak_rss_bytes=300 * MB,
        peak_device_bytes=None,
        train_ratio=2.5,
        infer_ratio=None,
        input_size=32,
    )
    text = rows_to_csv([row])
    assert text.splitlines()[0] == BENCH_HEADER
    (got,) = _csv(text)
    assert got == {
        "model": "m",
        "infer_samples_per_sec": "64.0",
        "infer_step_time": "125.0",
        "infer_batch_size": "8",
        "infer_img_size": "32",
        "train_samples_per_sec": "32.0",
        "train_step_time": "250.0",
        "train_batch_size": "8",
        "train_img_size": "32",
        "param_count": "1.23",
        "arch": "capsnet",
        "device": "cpu",
        "iterations": "2",
        "routing": "concurrent",
        "train_step_time_min": "200.0",
        "train_ratio": "2.5",
        "infer_ratio": "",
        "peak_rss_bytes": str(300 * MB),
        "peak_device_bytes": "",
        "params": "1234567",
        "routing_backend": "",
        "load_1m": "",
        "cpus": "",
    }


def test_rows_to_csv_of_measured_rows(with_resnet: Run) -> None:
    rows, _ = with_resnet
    resnet, caps = _csv(rows_to_csv(rows))
    assert resnet["model"] == "resnet18" and resnet["param_count"] == "11.17"
    assert resnet["infer_img_size"] == resnet["train_img_size"] == "32"
    assert caps["infer_img_size"] == "16" and caps["train_batch_size"] == "2"
    assert float(caps["train_step_time"]) == pytest.approx(1000 * rows[1].train_step_s, abs=1e-3)
    assert float(caps["infer_samples_per_sec"]) == pytest.approx(
        rows[1].infer_images_per_s, abs=0.01
    )
    assert resnet["routing"] == "" and caps["routing"] == "concurrent"


def test_rows_to_csv_leaves_a_skipped_phase_empty() -> None:
    (row,) = run_bench([tiny()], train=False, **FAST)
    (got,) = _csv(rows_to_csv([row]))
    assert got["infer_batch_size"] == "2" and got["infer_img_size"] == "16"
    for col in ("train_samples_per_sec", "train_step_time", "train_batch_size", "train_img_size"):
        assert got[col] == ""


def test_bench_cli_csv(capsys: pytest.CaptureFixture[str]) -> None:
    from capsctl.cli import main

    args = ["bench", "mnist-cnn", "-b", "2", "--iters", "1", "--warmup", "0", "--infer"]
    main([*args, "--csv"])
    out, _ = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0] == BENCH_HEADER and len(lines) == 2 and lines[1].startswith("mnist-cnn,")
    with pytest.raises(SystemExit) as info:
        main([*args, "--csv", "--json"])
    out, err = capsys.readouterr()
    assert info.value.code == 2 and "--json and --csv exclude each other" in err and out == ""


def test_one_device_resolver_for_every_command() -> None:
    """bench, train and eval share one resolver: auto never fails, cuda:N is checked."""
    from capsctl.devices import resolve_device

    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type in ("cpu", "cuda", "mps")
    with pytest.raises(UsageError, match="unknown"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="no CUDA device"):
            resolve_device("cuda:1")
