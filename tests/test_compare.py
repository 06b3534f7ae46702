"""Model comparison: targets, parameters, FLOPs, accuracy sources, references, ratios, output."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import capsctl.bench as bench
import capsctl.evaluation as evaluation
from capsctl.checkpoint import model_tensors, save_checkpoint
from capsctl.compare import (
    PUBLISHED,
    CompareReport,
    CompareRow,
    compare,
    count_flops,
    published_result,
    reference_accuracy,
    reference_ratios,
    resolve_target,
)
from capsctl.config import DataConfig, Preset, build_model, preset_to_dict, resolve_config
from capsctl.data import DATASETS
from capsctl.errors import CheckpointError, UsageError
from capsctl.models import parameter_counts
from capsctl.registry import get_config

TINY = {
    "base": "mnist-caps",
    "primary_types": 4,
    "layers": [{"kind": "conv", "types": 4, "pose_dim": 16, "kernel": 3, "stride": 2}],
}
CLASSES = [f"class-{i}" for i in range(10)]


def tiny_preset() -> Preset:
    return Preset(
        name="tiny",
        model=resolve_config(TINY),
        data=DataConfig(
            dataset="fashion-mnist-quickstart", normalization="fashion-mnist", val_size=200
        ),
    )


def write_checkpoint(path: Path, *, with_test: bool = True) -> Path:
    preset = tiny_preset()
    torch.manual_seed(0)
    model = build_model(preset.model)
    meta: dict = {
        "preset": preset_to_dict(preset),
        "metrics": {"epoch": 1, "val_accuracy": 0.5},
        "epoch": 1,
        "classes": CLASSES,
        "kind": "best",
    }
    if with_test:
        meta["test"] = {"accuracy": 0.61, "count": 2000, "top5": 0.9}
        meta["test_name"] = "fashion-mnist-quickstart"
    save_checkpoint(path, model_tensors(model), meta)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "best.safetensors")


@pytest.fixture(scope="module")
def report() -> tuple[CompareReport, list[dict]]:
    events: list[dict] = []
    rep = compare(["caps", "cifar10-caps-simple", "resnet18"], on_event=events.append)
    return rep, events


def row(rep: CompareReport, name: str) -> CompareRow:
    return next(r for r in rep.rows if r.name == name)


# --------------------------------------------------------------------------------------------
# Targets


def test_resolve_registered_model_alias_and_preset() -> None:
    name, source, cfg, path = resolve_target("cifar10-caps-simple")
    assert (name, source, path) == ("cifar10-caps-simple", "model", None)
    assert cfg == get_config("cifar10-caps-simple")

    name, source, cfg, path = resolve_target("caps")
    assert (name, source, path) == ("cifar10-caps", "model", None)
    assert cfg == get_config("cifar10-caps")

    name, source, cfg, _ = resolve_target("resnet18")
    assert (name, source, cfg.arch, cfg.num_classes) == ("resnet18", "model", "resnet18", 10)

    name, source, cfg, path = resolve_target("cifar100-resnet18")
    assert (name, source, path) == ("cifar100-resnet18", "preset", None)
    assert cfg.arch == "resnet18" and cfg.num_classes == 100

    name, source, cfg, _ = resolve_target("quickstart")
    assert (name, source) == ("quickstart", "preset")
    assert cfg == get_config("mnist-caps")


def test_resolve_yaml_path(tmp_path: Path) -> None:
    file = tmp_path / "my-caps.yaml"
    file.write_text("model: {base: mnist-caps, iterations: 1}\n", encoding="utf-8")
    name, source, cfg, path = resolve_target(str(file))
    assert (name, source, path) == ("my-caps", "preset", None)
    assert cfg.iterations == 1 and cfg.arch == "capsnet" and cfg.input_size == 28


def test_existing_file_wins_over_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_checkpoint(tmp_path / "caps")
    monkeypatch.chdir(tmp_path)
    name, source, cfg, path = resolve_target("caps")
    assert (name, source, path) == ("caps", "checkpoint", Path("caps"))
    assert cfg.primary_types == 4


def test_resolve_checkpoint(checkpoint: Path) -> None:
    name, source, cfg, path = resolve_target(str(checkpoint))
    assert (name, source, path) == (str(checkpoint), "checkpoint", checkpoint)
    assert cfg == resolve_config(TINY)


def test_model_folder_is_compared_like_its_checkpoint(checkpoint: Path, tmp_path: Path) -> None:
    from capsctl.export import export_checkpoint

    folder = export_checkpoint(checkpoint, "hf", tmp_path / "tiny-caps").path
    name, source, cfg, path = resolve_target(str(folder))
    assert (name, source, path) == (str(folder), "checkpoint", folder)
    assert cfg == resolve_config(TINY)
    from_folder, from_file = compare([str(folder), str(checkpoint)]).rows
    assert from_folder.accuracy == pytest.approx(0.61)
    assert from_folder.accuracy_source == from_file.accuracy_source
    assert dataclasses.replace(from_folder, name=from_file.name) == from_file


def test_a_run_folder_is_compared_as_eval_reads_it(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``capsctl compare caps runs/try/`` (issue 37, L4): a ``capsctl train`` run folder stands
    for its best.safetensors, as for eval, predict and the other commands."""
    import shutil

    from conftest import run_cli

    from capsctl.checkpoint import resolve_checkpoint

    run = tmp_path / "runs" / "try"
    run.mkdir(parents=True)
    for name in ("best.safetensors", "last.safetensors"):
        shutil.copy(checkpoint, run / name)
    assert resolve_checkpoint(run) == run / "best.safetensors"
    name, source, cfg, path = resolve_target(f"{run}/")
    assert (name, source, path) == (f"{run}/", "checkpoint", run / "best.safetensors")
    assert cfg == resolve_config(TINY)
    code, out, err = run_cli(capsys, ["compare", "caps", f"{run}/", "--json"])
    assert code == 0, err
    assert json.loads(out)["models"][1]["accuracy"] == pytest.approx(0.61)
    (run / "best.safetensors").unlink()  # stopped before its first validation
    code, _, err = run_cli(capsys, ["compare", str(run)])
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "best.safetensors" in err and str(run / "last.safetensors") in err


def test_unknown_target_lists_what_is_accepted(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as info:
        resolve_target("no-such-model")
    message = str(info.value)
    assert "\n" not in message and len(message) <= 200  # says where the names are, not all
    for word in ("no-such-model", "capsctl models", "capsctl presets", "caps", ".safetensors"):
        assert word in message
    with pytest.raises(UsageError, match="does not exist"):
        resolve_target(str(tmp_path / "missing.safetensors"))
    with pytest.raises(UsageError):
        compare([])


def test_a_file_that_is_not_a_checkpoint_is_a_checkpoint_error(tmp_path: Path) -> None:
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError):
        compare([str(junk)])


# --------------------------------------------------------------------------------------------
# FLOPs


def test_flops_of_a_conv_and_a_linear_layer_match_hand_computation() -> None:
    conv = nn.Conv2d(3, 8, 3, stride=1, padding=0, bias=False)
    # output 8x8: 2 * Cin * Cout * k * k * Hout * Wout
    assert count_flops(conv, (3, 10, 10)) == pytest.approx(2 * 3 * 8 * 3 * 3 * 8 * 8 / 1e9)
    strided = nn.Sequential(nn.Conv2d(1, 4, 5, stride=2, padding=2), nn.ReLU(), nn.Flatten())
    net = nn.Sequential(strided, nn.Linear(4 * 7 * 7, 10))
    expected = 2 * 1 * 4 * 5 * 5 * 7 * 7 + 2 * 4 * 7 * 7 * 10
    net.train()
    assert count_flops(net, [1, 14, 14]) == pytest.approx(expected / 1e9)
    assert net.training  # mode restored
    with pytest.raises(UsageError):
        count_flops(conv, (10, 10))


def test_capsule_flops_do_not_depend_on_what_ran_before() -> None:
    """The first count in a process loaded the compiled loops inside the counter, whose
    self-test's matrix products were counted too (0.0843 GFLOPs for cifar10-caps-fast instead
    of 0.0812); the count runs the torch code, the same in every call."""
    import subprocess
    import sys

    code = (
        "from capsctl.config import build_model\n"
        "from capsctl.compare.flops import count_flops\n"
        "m = build_model({'base': 'mnist-caps', 'primary_types': 4, 'layers': [],"
        " 'input_size': 16})\n"
        "print(count_flops(m, (1, 16, 16)), count_flops(m, (1, 16, 16)))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    first, second = (float(v) for v in res.stdout.split())
    assert first == pytest.approx(second, rel=1e-12)


def test_resnet18_flops_and_capsule_all_passes(report: tuple[CompareReport, list[dict]]) -> None:
    rep, _ = report
    resnet = row(rep, "resnet18")
    assert resnet.gflops == pytest.approx(1.11, rel=0.02)
    assert resnet.gflops_all_passes is None
    for name in ("cifar10-caps", "cifar10-caps-simple"):
        caps = row(rep, name)
        assert caps.gflops_all_passes is not None
        # T=2 concurrent: our forward skips routed passes that cannot reach the output
        assert caps.gflops_all_passes > caps.gflops > 0
    # same capsule head on both backbones: the same capsule FLOPs
    big, small = row(rep, "cifar10-caps"), row(rep, "cifar10-caps-simple")
    assert big.gflops_all_passes - big.gflops == pytest.approx(
        small.gflops_all_passes - small.gflops, rel=1e-6
    )
    assert "FlopCounterMode" in rep.flops_note and "elementwise" in rep.flops_note


# --------------------------------------------------------------------------------------------
# Rows, references, ratios, output


def test_params_match_parameter_counts_and_known_counts(
    report: tuple[CompareReport, list[dict]],
) -> None:
    rep, events = report
    assert [r.name for r in rep.rows] == ["cifar10-caps", "cifar10-caps-simple", "resnet18"]
    caps = row(rep, "cifar10-caps")
    assert caps.params == {"total": 1_828_817, "backbone": 1_340_224, "capsules": 488_593}
    assert row(rep, "resnet18").params["total"] == 11_173_962
    assert row(rep, "cifar10-caps-simple").params == parameter_counts(
        build_model("cifar10-caps-simple")
    )
    assert (caps.source, caps.arch, caps.num_classes, caps.input) == (
        "model",
        "capsnet",
        10,
        [3, 32, 32],
    )
    assert (caps.routing, caps.iterations) == ("concurrent", 2)
    resnet = row(rep, "resnet18")
    assert resnet.routing is None and resnet.iterations is None
    assert caps.accuracy is None and caps.accuracy_source is None
    assert caps.train_step_s is None and caps.peak_memory_bytes is None
    assert [e for e in events if e["event"] == "compare_model"] == [
        {"event": "compare_model", "name": n, "step": i, "steps": 3}
        for i, n in enumerate(["cifar10-caps", "cifar10-caps-simple", "resnet18"], start=1)
    ]


def test_every_published_figure_carries_its_source() -> None:
    assert len(PUBLISHED) >= 5
    for fig in PUBLISHED:
        assert "Tsai et al. 2020" in fig.source and "arXiv 2002.04764" in fig.source
        assert ("README" in fig.source) or ("paper" in fig.source)
        assert fig.table.strip() and fig.setting.strip()
        assert fig.source in fig.citation and fig.table in fig.citation
        assert fig.setting in fig.citation and "\n" not in fig.citation
        cfg = get_config(fig.model)
        if fig.iterations is not None:
            cfg = cfg.replace(iterations=fig.iterations)
            assert f"T={fig.iterations}" in fig.citation
        # the dataset is a known one and fits the model
        info = DATASETS[fig.dataset]
        assert (info.num_classes, info.channels, info.image_size) == (
            cfg.num_classes,
            cfg.in_channels,
            cfg.input_size,
        )
        # the published configuration gets exactly this figure, with its citation
        assert published_result(cfg) is fig
        assert published_result(cfg, fig.dataset) is fig
        assert reference_accuracy(cfg, fig.dataset) == (fig.accuracy, fig.citation)


def test_published_rows_in_the_report(report: tuple[CompareReport, list[dict]]) -> None:
    rep, _ = report
    for name in ("cifar10-caps", "resnet18"):
        r = row(rep, name)
        fig = published_result(get_config(name))
        assert fig is not None
        assert (r.reference_accuracy, r.reference_source) == (fig.accuracy, fig.citation)
    simple = row(rep, "cifar10-caps-simple")
    assert simple.reference_accuracy is None and simple.reference_source is None


def test_mismatched_configurations_get_no_published_figure() -> None:
    caps10, caps100 = get_config("cifar10-caps"), get_config("cifar100-caps")
    mismatched = {
        "T=3": caps10.replace(iterations=3),
        "cifar100 T=3": caps100.replace(iterations=3),
        "simple backbone": get_config("cifar10-caps-simple"),
        "simple backbone, cifar100": get_config("cifar100-caps-simple"),
        "T=1 simple backbone": get_config("cifar10-caps-simple").replace(iterations=1),
        "sequential routing": caps10.replace(routing="sequential"),
        "per-class head": caps10.replace(head="per_class"),
        "no agreement scale": caps10.replace(agreement_scale=False),
        "no layer norm": caps10.replace(layer_norm=False),
        "64x64 input": caps10.replace(input_size=64),
        "one channel": caps10.replace(in_channels=1),
        "100 classes": caps10.replace(num_classes=100),
        "fewer primary types": caps10.replace(primary_types=16),
        "dynamic routing": get_config("cifar10-dynamic"),
        "EM routing": get_config("cifar10-em"),
        "CNN": get_config("cifar10-cnn"),
        "resnet18, 100 classes": get_config("resnet18", num_classes=100),
        "resnet18, one channel": get_config("resnet18").replace(in_channels=1),
        "resnet18, 64x64": get_config("resnet18").replace(input_size=64),
        "tiny": resolve_config(TINY),
    }
    for what, cfg in mismatched.items():
        assert published_result(cfg) is None, what
        assert reference_accuracy(cfg) == (None, None), what
    # the right configuration on another dataset or test file gets none either
    for cfg in (caps10, get_config("resnet18")):
        for dataset in ("cifar100", "mnist", "cifar10[test-jpeg]", "imagefolder:/data/x"):
            assert published_result(cfg, dataset) is None, dataset
    assert published_result(caps100, "cifar10") is None
    # dropout is not part of the match (documented); T is
    assert published_result(caps10.replace(dropout=0.1)) is published_result(caps10)
    assert published_result(caps10.replace(iterations=1)) is not published_result(caps10)


def test_presets_and_checkpoints_match_on_their_dataset(tmp_path: Path) -> None:
    plain = tmp_path / "c10.yaml"
    plain.write_text("model: {base: cifar10-caps}\ndata: {dataset: cifar10}\n", encoding="utf-8")
    jpeg = tmp_path / "c10-jpeg.yaml"
    jpeg.write_text(
        "model: {base: cifar10-caps}\ndata: {dataset: cifar10, test_file: test-jpeg}\n",
        encoding="utf-8",
    )
    preset = Preset(
        name="own",
        model=get_config("cifar10-caps"),
        data=DataConfig(dataset="imagefolder:/data/own", normalization="cifar10", val_size=10),
    )
    torch.manual_seed(0)
    ckpt = tmp_path / "own.safetensors"
    meta = {"preset": preset_to_dict(preset), "classes": CLASSES, "kind": "best"}
    save_checkpoint(ckpt, model_tensors(build_model(preset.model)), meta)
    rep = compare([str(plain), str(jpeg), str(ckpt)])
    assert rep.rows[0].reference_accuracy is not None and rep.rows[0].reference_source
    for r in rep.rows[1:]:
        assert r.reference_accuracy is None and r.reference_source is None, r.name


def test_ratios_to_resnet18(report: tuple[CompareReport, list[dict]]) -> None:
    rep, _ = report
    assert rep.reference == "resnet18"
    assert [r.name for r in rep.ratios] == ["cifar10-caps", "cifar10-caps-simple"]
    caps, resnet = row(rep, "cifar10-caps"), row(rep, "resnet18")
    ratios = rep.ratios[0]
    assert ratios.reference == "resnet18"
    assert ratios.params == pytest.approx(1_828_817 / 11_173_962)  # about 6.1x fewer
    assert not ratios.params_about_equal
    assert ratios.gflops == pytest.approx(caps.gflops / resnet.gflops)
    assert caps.gflops_all_passes is not None
    assert ratios.gflops_all_passes == pytest.approx(caps.gflops_all_passes / resnet.gflops)
    assert ratios.train_step is None and ratios.inference is None  # no --speed


def _row(name: str, params: int, gflops: float, **speed: float | None) -> CompareRow:
    return CompareRow(
        name=name,
        source="model",
        arch="capsnet",
        num_classes=10,
        input=[3, 32, 32],
        params={"total": params, "backbone": params, "capsules": 0},
        gflops=gflops,
        routing=None,
        iterations=None,
        accuracy=None,
        accuracy_source=None,
        reference_accuracy=None,
        reference_source=None,
        **speed,
    )


def test_reference_ratios_directions_and_edge_cases() -> None:
    ref = _row("ref", 1000, 2.0, train_step_s=0.1, infer_images_per_s=400.0)
    fast = _row("a", 1004, 1.0, gflops_all_passes=1.5, train_step_s=0.3, infer_images_per_s=800.0)
    r = reference_ratios(fast, ref)
    assert (r.name, r.reference) == ("a", "ref")
    assert r.params == pytest.approx(1.004) and r.params_about_equal  # within 0.5 %
    assert r.gflops == pytest.approx(0.5) and r.gflops_all_passes == pytest.approx(0.75)
    assert r.train_step == pytest.approx(3.0)  # 0.3 s / 0.1 s: slower
    assert r.inference == pytest.approx(0.5)  # 400 / 800 images/s: twice as fast
    assert not reference_ratios(_row("b", 1006, 1.0), ref).params_about_equal
    assert reference_ratios(_row("c", 996, 1.0), ref).params_about_equal  # 1000 < 1.005 * 996
    same_passes = reference_ratios(_row("d", 10, 1.0, gflops_all_passes=1.0), ref)
    assert same_passes.gflops_all_passes is None
    assert same_passes.train_step is None and same_passes.inference is None  # not measured
    no_flops = reference_ratios(_row("e", 10, 1.0), _row("ref", 10, 0.0))
    assert no_flops.gflops is None and no_flops.gflops_all_passes is None


def test_no_reference_no_ratios(checkpoint: Path) -> None:
    rep = compare([str(checkpoint)])
    assert rep.reference is None and rep.ratios == []


def test_to_dict_and_csv(report: tuple[CompareReport, list[dict]]) -> None:
    rep, _ = report
    data = json.loads(json.dumps(rep.to_dict()))
    assert set(data) == {"models", "reference", "ratios", "flops_note"}
    assert [m["name"] for m in data["models"]] == [r.name for r in rep.rows]
    assert data["models"][0]["params"]["total"] == 1_828_817
    assert data["models"][0]["gflops_all_passes"] > data["models"][0]["gflops"]
    assert data["reference"] == "resnet18"
    assert data["ratios"] == [r.to_dict() for r in rep.ratios]
    assert data["ratios"][0]["params"] == pytest.approx(1_828_817 / 11_173_962)

    lines = list(csv.DictReader(io.StringIO(rep.to_csv())))
    assert [r["name"] for r in lines] == [r.name for r in rep.rows]
    first = lines[0]
    assert int(first["params_total"]) == 1_828_817
    assert int(first["params_backbone"]) == 1_340_224
    assert int(first["params_capsules"]) == 488_593
    assert float(first["gflops"]) == pytest.approx(rep.rows[0].gflops)
    assert first["input"] == "3x32x32"
    assert first["reference_source"] == rep.rows[0].reference_source
    assert "Tsai et al. 2020" in first["reference_source"]
    assert lines[2]["routing"] == "" and lines[2]["gflops_all_passes"] == ""


# --------------------------------------------------------------------------------------------
# Checkpoints: accuracy from metadata, --eval


def test_accuracy_from_checkpoint_metadata(checkpoint: Path, tmp_path: Path) -> None:
    rep = compare([str(checkpoint)])
    (r,) = rep.rows
    assert r.source == "checkpoint" and r.name == str(checkpoint)
    assert r.params == parameter_counts(build_model(resolve_config(TINY)))
    assert r.accuracy == pytest.approx(0.61)
    assert r.accuracy_source == "checkpoint test (fashion-mnist-quickstart, 2,000 images)"
    assert r.input == [1, 28, 28] and r.reference_accuracy is None

    no_test = write_checkpoint(tmp_path / "last.safetensors", with_test=False)
    (r,) = compare([str(no_test)]).rows
    assert r.accuracy == pytest.approx(0.5)
    assert r.accuracy_source == "checkpoint val (epoch 1)"


def test_evaluate_recomputes_checkpoint_accuracy(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The real evaluation of this checkpoint on the bundled test set works but takes seconds on
    # a busy 2-core machine; evaluation's own tests cover it. Here: what compare passes and keeps.
    calls: list[tuple[Path, dict]] = []

    def fake(path: Path, **kwargs: object) -> tuple[SimpleNamespace, dict]:
        calls.append((path, kwargs))
        result = SimpleNamespace(accuracy=0.125, count=2000, dataset="fashion-mnist-quickstart")
        return result, {}

    monkeypatch.setattr(evaluation, "evaluate_checkpoint", fake)
    events: list[dict] = []
    on_event = events.append
    rep = compare(
        [str(checkpoint), "mnist-caps"], evaluate=True, data_dir="/data", on_event=on_event
    )
    ckpt, model = rep.rows
    assert calls == [
        (
            checkpoint,
            {"data_dir": "/data", "split": "test", "device": "cpu", "on_event": on_event},
        )
    ]
    assert ckpt.accuracy == pytest.approx(0.125)
    assert ckpt.accuracy_source == "--eval test (fashion-mnist-quickstart, 2,000 images)"
    assert model.accuracy is None and model.accuracy_source is None


# --------------------------------------------------------------------------------------------
# Speed


def test_speed_uses_run_bench(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[list, dict]] = []
    original = bench.run_bench

    def spy(models: list, **kwargs: object) -> list:
        calls.append((list(models), dict(kwargs)))
        return original(models, **kwargs)

    monkeypatch.setattr(bench, "run_bench", spy)
    events: list[dict] = []
    rep = compare([str(checkpoint)], speed=True, batch_size=2, iters=1, on_event=events.append)
    (r,) = rep.rows
    assert len(calls) == 1
    (models, kwargs) = calls[0]
    assert models == [(str(checkpoint), resolve_config(TINY))]
    assert kwargs["batch_size"] == 2 and kwargs["iters"] == 1 and kwargs["device"] == "cpu"
    assert r.train_step_s is not None and r.train_step_s > 0
    assert r.infer_images_per_s is not None and r.infer_images_per_s > 0
    assert r.peak_memory_bytes is not None and r.peak_memory_bytes > 0
    assert any(e["event"] == "bench_model" for e in events)


def test_speed_argument_errors() -> None:
    with pytest.raises(UsageError):
        compare(["mnist-caps"], speed=True, iters=0)
    with pytest.raises(UsageError):
        compare(["mnist-caps"], speed=True, batch_size=0)
    with pytest.raises(UsageError):
        compare(["mnist-caps"], speed=True, device="tpu")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["compare", "nosuch"], ["'nosuch'", "capsctl models", "capsctl presets"]),
        (["compare", "cifar10-cap"], ["did you mean cifar10-caps?"]),
        (["compare", "resnet18", "--suite", "nope"], ["--suite nope", "paper"]),
        (["train", "--preset", "cifar10-cap"], ["did you mean cifar10-caps?", "capsctl presets"]),
        (["bench", "cifar10-cap"], ["did you mean cifar10-caps?", "capsctl models"]),
    ],
)
def test_an_unknown_name_is_a_short_line_that_says_how_to_list_them(
    args: list[str], words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Not a list of every model and preset (1,300 characters and growing)."""
    from conftest import run_cli

    code, _, err = run_cli(capsys, args)
    assert code == 2
    (line,) = err.strip().splitlines()
    assert len(line) <= 200 and all(w in line for w in words), (len(line), line)


def test_a_long_message_from_anywhere_is_cut_to_one_short_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The fallback where the CLI renders errors: one line of at most about 1,000 characters,
    its start and its end (what to do) kept."""
    from conftest import run_cli

    import capsctl.registry

    def long(pattern: str) -> list:
        raise UsageError("first part\n" + "x" * 2000 + "; do this")

    monkeypatch.setattr(capsctl.registry, "model_summaries", long)
    code, _, err = run_cli(capsys, ["models"])
    assert code == 2
    (line,) = err.strip().splitlines()
    assert line.startswith("error: first part xxx") and line.endswith("x; do this"), line
    assert len(line) <= 1000 and "--debug" in line, len(line)
