"""Tests for capsctl.inspection: statistics, JSON, raw dumps, pictures and the checkpoint call."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_cli
from safetensors import safe_open

from capsctl.checkpoint import model_tensors, save_checkpoint
from capsctl.config import resolve_config
from capsctl.errors import CapsctlError, UsageError
from capsctl.inspection import (
    RoutingReport,
    class_flow,
    dump_coefficients,
    inspect_checkpoint,
    inspect_routing,
    parse_indices,
    spatial_map,
    write_pngs,
)
from capsctl.models import build_model_from_config

CLASSES = ["cat", "dog", "ému"]
SIZE = 12


def make_model(**changes: Any) -> torch.nn.Module:
    spec = {
        "base": "mnist-caps",
        "input_size": SIZE,
        "num_classes": len(CLASSES),
        "primary_types": 4,
        "primary_dim": 4,
        "layers": [{"kind": "conv", "types": 4, "pose_dim": 4, "kernel": 3, "stride": 1}],
        "iterations": 2,
        **changes,
    }
    torch.manual_seed(0)
    return build_model_from_config(resolve_config(spec))


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return make_model().eval()


@pytest.fixture(scope="module")
def fc_model() -> torch.nn.Module:
    """conv -> fc (vector poses) -> class capsules: the class layer's children are flat."""
    return make_model(
        layers=[
            {"kind": "conv", "types": 3, "pose_dim": 4, "kernel": 3, "stride": 2},
            {"kind": "fc", "types": 5, "pose_dim": 6, "pose": "vector"},
        ],
        class_pose="vector",
    ).eval()


def batch(n: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 1, SIZE, SIZE, generator=torch.Generator().manual_seed(seed))


def trace_of(model: torch.nn.Module, x: torch.Tensor, t: int, mode: str):
    model.set_routing(t, mode)
    try:
        with torch.no_grad():
            return model(x, trace=True)[1]
    finally:
        model.set_routing(2, "concurrent")


# --------------------------------------------------------------------------------------------
# Hand computation with plain loops
# --------------------------------------------------------------------------------------------


def hand_stats(coeffs: list[torch.Tensor], poses: list[torch.Tensor]) -> list[dict[str, Any]]:
    rows = []
    prev_children = None
    for t, (c, p) in enumerate(zip(coeffs, poses, strict=True)):
        children = c.reshape(-1, c.shape[-1]).tolist()
        m = len(children[0])
        ent, mx, changed = 0.0, 0.0, 0
        for i, r in enumerate(children):
            h = -sum(v * math.log(v) for v in r if v > 0)
            ent += h / math.log(m)
            mx += max(r)
            if prev_children is not None:
                top = max(range(m), key=lambda j, r=r: r[j])
                if prev_children[i][top] < max(prev_children[i]):
                    changed += 1
        n = len(children)
        row = {"entropy": ent / n, "max": mx / n, "changed": None, "stability": None}
        if t > 0:
            row["changed"] = changed / n
            cur = p.reshape(-1, p.shape[-1]).tolist()
            old = poses[t - 1].reshape(-1, p.shape[-1]).tolist()
            total = 0.0
            for a, b in zip(cur, old, strict=True):
                dot = sum(x * y for x, y in zip(a, b, strict=True))
                total += dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))
            row["stability"] = total / len(cur)
        rows.append(row)
        prev_children = children
    return rows


@pytest.mark.parametrize("mode", ["concurrent", "sequential"])
@pytest.mark.parametrize("t", [1, 2, 3])
def test_statistics_match_hand_computation(model, mode: str, t: int) -> None:
    x = batch()
    report = inspect_routing(model, x, classes=CLASSES, iterations=t, routing=mode)
    trace = trace_of(model, x, t, mode)
    assert report.iterations == t and report.routing == mode
    assert [layer.kind for layer in report.layers] == trace.kinds == ["conv", "fc"]
    for li, layer in enumerate(report.layers):
        expected = hand_stats(trace.coefficients[li], trace.poses[li])
        assert [s.iteration for s in layer.iterations] == list(range(1, t + 1))
        for stats, hand in zip(layer.iterations, expected, strict=True):
            assert stats.mean_entropy == pytest.approx(hand["entropy"], abs=1e-6)
            assert stats.mean_max == pytest.approx(hand["max"], abs=1e-6)
            if hand["changed"] is None:
                assert stats.top_changed is None and stats.pose_stability is None
            else:
                assert stats.top_changed == pytest.approx(hand["changed"], abs=1e-12)
                assert stats.pose_stability == pytest.approx(hand["stability"], abs=1e-6)
        for a, b in zip(report.coefficients[li], trace.coefficients[li], strict=True):
            assert torch.equal(a, b)
    # the model's own settings are restored
    assert (model.iterations, model.routing, model.training) == (2, "concurrent", False)


@pytest.mark.parametrize("mode", ["concurrent", "sequential"])
def test_uniform_pass_is_exactly_uniform(model, fc_model, mode: str) -> None:
    for net in (model, fc_model):
        report = inspect_routing(net, batch(2), classes=CLASSES, iterations=1, routing=mode)
        for layer in report.layers:
            (stats,) = layer.iterations
            assert stats.mean_entropy == 1.0
            assert stats.mean_max == 1.0 / layer.parent_types
            assert stats.top_changed is None and stats.pose_stability is None
        later = inspect_routing(net, batch(2), classes=CLASSES, iterations=3, routing=mode)
        for layer in later.layers:
            assert layer.iterations[0].mean_entropy == 1.0
            assert layer.iterations[1].top_changed == 0.0  # vs. a pass where all parents tie
            for s in layer.iterations[1:]:
                assert 0.0 <= s.mean_entropy < 1.0
                assert 1.0 / layer.parent_types < s.mean_max <= 1.0
                assert 0.0 <= s.top_changed <= 1.0
                assert -1.0 <= s.pose_stability <= 1.0 + 1e-9


def test_first_layer_is_the_same_in_both_modes(model) -> None:
    x = batch()
    a = inspect_routing(model, x, classes=CLASSES, iterations=3, routing="concurrent")
    b = inspect_routing(model, x, classes=CLASSES, iterations=3, routing="sequential")
    assert a.layers[0].iterations == b.layers[0].iterations


def test_training_mode_and_settings_restored() -> None:
    net = make_model()
    net.train()
    inspect_routing(net, batch(), classes=CLASSES, iterations=3, routing="sequential")
    assert net.training and net.iterations == 2 and net.routing == "concurrent"


# --------------------------------------------------------------------------------------------
# Parents, children and spatial maps
# --------------------------------------------------------------------------------------------


def test_parents_receiving_and_top_children(model) -> None:
    x = batch(4)
    labels = torch.tensor([0, 1, 2, 1])
    report = inspect_routing(model, x, labels=labels, classes=CLASSES, top=3)
    full = inspect_routing(model, x, classes=CLASSES, top=10)
    for layer, whole in zip(report.layers, full.layers, strict=True):
        shares = [s for _, s in layer.parents_receiving]
        assert len(shares) == min(3, layer.parent_types)
        assert shares == sorted(shares, reverse=True)
        assert sum(s for _, s in whole.parents_receiving) == pytest.approx(1.0)
        last = report.coefficients[layer.index][-1]
        received = last.reshape(-1, last.shape[-1]).double().sum(0)
        j, share = layer.parents_receiving[0]
        assert share == pytest.approx(float(received[j] / received.sum()))

    h, w, n = report.child_grids[-1]
    assert report.layers[-1].child_grid == (h, w, n)
    coeff = report.coefficients[-1][-1]  # [b, h*w*n, classes]
    for i, record in enumerate(report.images):
        assert record.predicted == int(report.logits[i].argmax())
        assert record.predicted_class == CLASSES[record.predicted]
        assert record.label == int(labels[i]) and record.label_class == CLASSES[record.label]
        assert len(record.top_children) == 3
        grid = coeff[i].view(h, w, n, len(CLASSES))
        column = coeff[i, :, record.predicted]
        assert record.top_children[0].coefficient == pytest.approx(float(column.max()))
        for child in record.top_children:
            assert grid[child.h, child.w, child.type, record.predicted].item() == pytest.approx(
                child.coefficient
            )


def test_spatial_map_sums_child_types(model) -> None:
    report = inspect_routing(model, batch(2), classes=CLASSES)
    h, w, n = report.child_grids[-1]
    for i in range(2):
        sm = spatial_map(report, i)
        assert sm.shape == (h, w)
        pred = report.images[i].predicted
        expected = report.coefficients[-1][-1][i, :, pred].view(h, w, n).sum(-1)
        assert torch.allclose(sm, expected)
    with pytest.raises(UsageError, match="out of range"):
        spatial_map(report, 2)


def test_spatial_map_through_fc_layers(fc_model) -> None:
    report = inspect_routing(fc_model, batch(2), classes=CLASSES, top=2)
    assert report.child_grids[-1] is None
    child = report.images[0].top_children[0]
    assert child.h is None and child.w is None and 0 <= child.type < 5
    flow, (h, w, n) = class_flow(report, 0)
    pred = report.images[0].predicted
    c_fc = report.coefficients[-2][-1][0].double()  # [grid children, 5]
    c_cls = report.coefficients[-1][-1][0].double()  # [5, classes]
    assert torch.allclose(flow, c_fc @ c_cls[:, pred])
    assert spatial_map(report, 0).shape == (h, w)


# --------------------------------------------------------------------------------------------
# JSON and raw dumps
# --------------------------------------------------------------------------------------------


def test_json_round_trip(model) -> None:
    report = inspect_routing(
        model, batch(), labels=torch.tensor([2, 0, 1]), classes=CLASSES, iterations=3
    )
    data = report.to_dict()
    text = json.dumps(data, ensure_ascii=False)
    assert json.loads(text) == data
    assert data["iterations"] == 3 and data["classes"] == CLASSES
    assert data["layers"][0]["iterations"][0]["top_changed"] is None
    assert data["images"][0]["label_class"] == "ému"
    assert isinstance(report, RoutingReport)


def test_dump_keys_and_shapes(model, tmp_path: Path) -> None:
    report = inspect_routing(model, batch(2), classes=CLASSES, iterations=3, routing="sequential")
    path = dump_coefficients(report, tmp_path / "routing.safetensors")
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        assert keys == {f"layer{li}.iter{t}" for li in range(2) for t in (1, 2, 3)}
        assert list(f.get_tensor("layer0.iter2").shape) == [2, 4, 4, 3, 3, 4, 4]
        for li, per_layer in enumerate(report.coefficients):
            for ti, c in enumerate(per_layer):
                assert torch.equal(f.get_tensor(f"layer{li}.iter{ti + 1}"), c)
        meta = f.metadata()
    assert json.loads(meta["kinds"]) == ["conv", "fc"]
    assert json.loads(meta["child_grids"]) == [None, [4, 4, 4]]
    assert [p.name for p in tmp_path.iterdir()] == ["routing.safetensors"]
    with pytest.raises(CapsctlError, match="does not exist"):
        dump_coefficients(report, tmp_path / "missing" / "r.safetensors")


# --------------------------------------------------------------------------------------------
# Pictures
# --------------------------------------------------------------------------------------------


def display(x: torch.Tensor) -> torch.Tensor:
    return ((x.clamp(-2, 2) + 2) / 4 * 255).round().to(torch.uint8)


def test_write_pngs(model, tmp_path: Path) -> None:
    from PIL import Image

    x = batch(2)
    report = inspect_routing(model, x, classes=CLASSES, iterations=2)
    paths = write_pngs(report, display(x), tmp_path / "pictures")
    names = sorted(p.name for p in paths)
    expected = [f"routing_layer{li}_iter{t}.png" for li in range(2) for t in (1, 2)]
    assert names == sorted(expected + ["image0_routing.png", "image1_routing.png"])
    assert sorted(p.name for p in (tmp_path / "pictures").iterdir()) == names  # no temp files
    limits: dict[int, set] = {}
    for path in paths:
        with Image.open(path) as im:
            im.load()
            assert im.format == "PNG" and im.size[0] > 100 and im.size[1] > 100
            text = dict(im.text)
        if text["capsctl:kind"] == "coefficients":
            layer = limits.setdefault(int(text["capsctl:layer"]), set())
            layer.add((float(text["capsctl:vmin"]), float(text["capsctl:vmax"])))
        else:
            assert float(text["capsctl:vmin"]) == 0.0
    # one colour range per layer, the same for its iterations: its data's, not [0, 1]
    from capsctl.inspection.pictures import _mean_matrix

    for li, ranges in limits.items():
        (lo, hi), *rest = ranges
        assert not rest
        means = [_mean_matrix(report, li, ti) for ti in range(2)]
        assert lo == pytest.approx(min(float(m.min()) for m in means), abs=1e-6)
        assert hi == pytest.approx(max(float(m.max()) for m in means), abs=1e-6)
        assert (lo, hi) != (0.0, 1.0)
    # float images in [0, 1] work too; each kind of picture can be switched off
    one = inspect_routing(model, x[:1], classes=CLASSES)
    floats = write_pngs(one, display(x[:1]).float() / 255, tmp_path / "floats", heatmaps=False)
    assert [p.name for p in floats] == ["image0_routing.png"]
    assert write_pngs(one, display(x[:1]), tmp_path / "none", heatmaps=False, overlays=False) == []


def test_overlay_changes_with_the_input(model, tmp_path: Path) -> None:
    a, b = batch(1, seed=1), batch(1, seed=2)
    ra = inspect_routing(model, a, classes=CLASSES)
    rb = inspect_routing(model, b, classes=CLASSES)
    pa = write_pngs(ra, display(a), tmp_path / "a", heatmaps=False)
    pb = write_pngs(rb, display(b), tmp_path / "b", heatmaps=False)
    overlay_a = (tmp_path / "a" / "image0_routing.png").read_bytes()
    overlay_b = (tmp_path / "b" / "image0_routing.png").read_bytes()
    assert overlay_a != overlay_b
    # same routing, different background: the routing map still differs between a and b
    assert not torch.allclose(spatial_map(ra, 0), spatial_map(rb, 0))
    assert [p.name for p in pa] == [p.name for p in pb] == ["image0_routing.png"]


def test_write_pngs_needs_matplotlib(model, tmp_path: Path, monkeypatch) -> None:
    report = inspect_routing(model, batch(1), classes=CLASSES)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(CapsctlError, match=r"pip install 'capsctl\[plot\]'"):
        write_pngs(report, display(batch(1)), tmp_path)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------
# The checkpoint call (capsctl inspect-routing)
# --------------------------------------------------------------------------------------------


def save_tiny_checkpoint(model: torch.nn.Module, path: Path) -> Path:
    meta = {
        "preset": {"model": model.config.to_dict()},
        "classes": CLASSES,
        "in_channels": 1,
        "input_size": SIZE,
        "normalization": {"mean": [0.5], "std": [0.25]},
    }
    save_checkpoint(path, model_tensors(model), meta)
    return path


def test_inspect_checkpoint_is_inspect_routing_on_the_sampled_images(model, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    ckpt = save_tiny_checkpoint(model, tmp_path / "tiny.safetensors")
    events: list[dict[str, Any]] = []
    result = inspect_checkpoint(
        ckpt,
        random=2,
        seed=3,
        iterations=3,
        routing="sequential",
        top=2,
        dump=tmp_path / "coeffs.safetensors",
        png_dir=tmp_path / "png",
        on_event=events.append,
    )
    # the same images by hand: seeded uint8 noise, then (x / 255 - mean) / std
    raw = torch.randint(
        0, 256, (2, 1, SIZE, SIZE), generator=torch.Generator().manual_seed(3), dtype=torch.uint8
    )
    expected = inspect_routing(
        model,
        (raw.float() / 255.0 - 0.5) / 0.25,
        classes=CLASSES,
        iterations=3,
        routing="sequential",
        top=2,
    )
    doc = result.to_dict()
    assert list(doc) == [
        "checkpoint",
        "inputs",
        "algorithm",
        "coefficients",
        "iterations",
        "routing",
        "classes",
        "layers",
        "images",
        "written",
    ]
    assert doc["checkpoint"] == str(ckpt) and doc["inputs"] == "2 random images (seed 3)"
    assert (doc["algorithm"], doc["coefficients"]) == ("idpa", "routing coefficients")
    assert {k: doc[k] for k in expected.to_dict()} == expected.to_dict()
    assert result.raw_images is None  # no image is kept beyond its batch
    assert result.layers == expected.layers and result.images == expected.images
    assert (result.iterations, result.routing, result.classes) == (3, "sequential", CLASSES)
    pictures = sorted(p.name for p in (tmp_path / "png").iterdir())
    assert doc["written"][0] == str(tmp_path / "coeffs.safetensors")
    assert sorted(Path(w).name for w in doc["written"][1:]) == pictures
    assert len(pictures) == 2 * 3 + 2  # 2 layers x 3 iterations, 2 overlays
    progress = [(e["step"], e["steps"]) for e in events if e.get("task") == "pictures"]
    assert progress == [(k, 8) for k in range(1, 9)]
    assert all(e["event"] == "progress" for e in events)


def test_inspect_checkpoint_errors(model, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no such file"):
        inspect_checkpoint(tmp_path / "missing.safetensors")
    ckpt = save_tiny_checkpoint(model, tmp_path / "tiny.safetensors")
    with pytest.raises(UsageError, match="choose one of --indices, --image and --random"):
        inspect_checkpoint(ckpt, indices="0-1", random=2)
    with pytest.raises(UsageError, match="top must be >= 1"):
        inspect_checkpoint(ckpt, random=1, top=0)
    cnn = save_tiny_checkpoint(make_model(arch="cnn"), tmp_path / "cnn.safetensors")
    with pytest.raises(UsageError, match="needs a capsule network"):
        inspect_checkpoint(cnn, random=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cnn.safetensors", "tiny.safetensors"]


def test_parse_indices() -> None:
    assert parse_indices("0,3,10-12") == [0, 3, 10, 11, 12]
    assert parse_indices(" 4 , 2-2,") == [4, 2]
    with pytest.raises(UsageError, match="--indices 1,x: expected numbers and ranges"):
        parse_indices("1,x")


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def test_non_capsule_model_is_a_usage_error() -> None:
    cnn = make_model(arch="cnn")
    with pytest.raises(UsageError, match="needs a capsule network") as info:
        inspect_routing(cnn, batch(), classes=CLASSES)
    assert info.value.exit_code == 2


def test_bad_arguments(model) -> None:
    with pytest.raises(UsageError, match="iterations"):
        inspect_routing(model, batch(), classes=CLASSES, iterations=0)
    with pytest.raises(UsageError, match="routing mode"):
        inspect_routing(model, batch(), classes=CLASSES, routing="dynamic")
    with pytest.raises(UsageError, match="class names"):
        inspect_routing(model, batch(), classes=["a"])
    with pytest.raises(UsageError, match=r"model takes \[N, 1, 12, 12\]"):
        inspect_routing(model, torch.zeros(2, 3, SIZE, SIZE), classes=CLASSES)
    with pytest.raises(UsageError, match="labels"):
        inspect_routing(model, batch(), classes=CLASSES, labels=torch.tensor([0]))
    assert model.iterations == 2 and model.routing == "concurrent"


# --------------------------------------------------------------------------------------------
# Any number of images in bounded memory; outputs that never replace a file unasked
# --------------------------------------------------------------------------------------------


def _random_images(n: int, seed: int) -> torch.Tensor:
    raw = torch.randint(
        0, 256, (n, 1, SIZE, SIZE), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8
    )
    return (raw.float() / 255.0 - 0.5) / 0.25


def _concatenated(parts: list[RoutingReport]) -> tuple[list, list]:
    """The raw coefficients and poses of several batches' reports as of one batch."""
    coeffs = [
        [torch.cat([p.coefficients[li][ti] for p in parts]) for ti in range(len(per))]
        for li, per in enumerate(parts[0].coefficients)
    ]
    poses = [
        [torch.cat([p.poses[li][ti] for p in parts]) for ti in range(len(per))]
        for li, per in enumerate(parts[0].poses)
    ]
    return coeffs, poses


@pytest.mark.parametrize("which", ["model", "fc_model"])
def test_statistics_added_up_batch_by_batch_equal_those_of_all_images_at_once(
    which: str, request: pytest.FixtureRequest
) -> None:
    from capsctl.inspection.pictures import _mean_matrix, matrix_sum
    from capsctl.inspection.statistics import layer_routings
    from capsctl.inspection.stream import RoutingTally

    net = request.getfixturevalue(which)
    images = _random_images(7, 5)
    parts = [inspect_routing(net, images[b : b + 3], classes=CLASSES, top=3) for b in (0, 3, 6)]
    tally = RoutingTally(3)
    for part in parts:
        tally.add(part)
    coeffs, poses = _concatenated(parts)
    whole = layer_routings(coeffs, poses, parts[0].kinds, parts[0].child_grids, 3)
    got = tally.report()
    assert len(got.layers) == len(whole)
    for mine, want in zip(got.layers, whole, strict=True):
        assert (mine.kind, mine.child_types, mine.parent_types) == (
            want.kind,
            want.child_types,
            want.parent_types,
        )
        for a, b in zip(mine.iterations, want.iterations, strict=True):
            assert a.iteration == b.iteration
            for name in ("mean_entropy", "mean_max", "top_changed", "pose_stability"):
                x, y = getattr(a, name), getattr(b, name)
                assert (x is None) == (y is None) and (
                    x is None or math.isclose(x, y, abs_tol=1e-12)
                )
        assert [j for j, _ in mine.parents_receiving] == [j for j, _ in want.parents_receiving]
        for (_, x), (_, y) in zip(mine.parents_receiving, want.parents_receiving, strict=True):
            assert math.isclose(x, y, rel_tol=1e-12)
    assert [im.index for im in got.images] == list(range(7))
    assert [im.top_children for im in got.images] == [
        im.top_children for p in parts for im in p.images
    ]
    whole_report = RoutingReport(
        iterations=parts[0].iterations, routing=parts[0].routing, classes=CLASSES, layers=[],
        images=[], coefficients=coeffs, kinds=parts[0].kinds, child_grids=parts[0].child_grids,
    )  # fmt: skip
    for li, per in enumerate(coeffs):
        for ti in range(len(per)):
            assert torch.allclose(tally.mean_matrix(li, ti), _mean_matrix(whole_report, li, ti))
            assert matrix_sum(per[ti], parts[0].kinds[li], parts[0].child_grids[li])[1] > 0


def test_a_streamed_inspection_is_the_inspection_of_all_images_at_once(
    model, tmp_path: Path
) -> None:
    """Batches of 3 of 7 images: the same statistics, images and dump as one batch of 7 (to
    float32 rounding: a batch's size may change the order of a convolution's sums)."""
    ckpt = save_tiny_checkpoint(model, tmp_path / "tiny.safetensors")
    result = inspect_checkpoint(
        ckpt, random=7, seed=5, top=3, batch_size=3, dump=tmp_path / "streamed.safetensors"
    )
    expected = inspect_routing(model, _random_images(7, 5), classes=CLASSES, top=3)
    dump_coefficients(expected, tmp_path / "whole.safetensors")
    got, want = result.to_dict(), expected.to_dict()
    assert len(got["layers"]) == len(want["layers"])
    for a, b in zip(got["layers"], want["layers"], strict=True):
        for s, t in zip(a["iterations"], b["iterations"], strict=True):
            for k, v in s.items():
                assert v == t[k] or math.isclose(v, t[k], abs_tol=1e-5), (k, v, t[k])
    assert [im["predicted"] for im in got["images"]] == [im["predicted"] for im in want["images"]]
    assert result.report.coefficients == [] and result.report.poses == []
    with (
        safe_open(str(tmp_path / "streamed.safetensors"), "pt") as s,
        safe_open(str(tmp_path / "whole.safetensors"), "pt") as w,
    ):
        assert sorted(s.keys()) == sorted(w.keys()) and s.metadata() == w.metadata()
        names = w.keys()
        for key in names:
            assert torch.allclose(s.get_tensor(key), w.get_tensor(key), atol=1e-5), key
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "streamed.safetensors", "tiny.safetensors", "whole.safetensors"
    ]  # fmt: skip


def test_random_images_in_batches_are_the_random_images_of_one_batch() -> None:
    from capsctl.data.samples import sample_images
    from capsctl.inspection.images import random_batches

    meta = {
        "in_channels": 3,
        "input_size": 8,
        "normalization": {"mean": [0.1] * 3, "std": [0.3] * 3},
    }
    whole = sample_images(meta, random=11, seed=4)
    parts = list(random_batches(meta, 11, 4, 4))
    assert [p.raw.shape[0] for p in parts] == [4, 4, 3]
    assert torch.equal(torch.cat([p.raw for p in parts]), whole.raw)
    assert torch.equal(torch.cat([p.normalized for p in parts]), whole.normalized)


@pytest.mark.parametrize("count", [8, 40])
def test_no_per_image_tensor_outlives_its_batch(
    count: int, model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory does not grow with the number of images: every batch's routing trace is freed
    once the batch is added up and dumped (``--random 100000`` was killed for memory)."""
    import gc
    import weakref

    from capsctl.inspection import api

    ckpt = save_tiny_checkpoint(model, tmp_path / "tiny.safetensors")
    kept: list[weakref.ref] = []
    sizes: list[int] = []
    real = api.inspect_routing

    def watched(net: torch.nn.Module, images: torch.Tensor, **kwargs: Any) -> RoutingReport:
        report = real(net, images, **kwargs)
        sizes.append(images.shape[0])
        kept.extend(weakref.ref(t) for per in report.coefficients + report.poses for t in per)
        kept.append(weakref.ref(images))
        return report

    monkeypatch.setattr(api, "inspect_routing", watched)
    result = inspect_checkpoint(ckpt, random=count, batch_size=4, dump=tmp_path / "d.safetensors")
    gc.collect()
    assert max(sizes) <= 4 and sum(sizes) == count
    assert [r for r in kept if r() is not None] == []
    assert len(result.images) == count and result.raw_images is None


def test_an_output_never_replaces_the_checkpoint_it_reads(model, tmp_path: Path) -> None:
    ckpt = save_tiny_checkpoint(model, tmp_path / "tiny.safetensors")
    before = ckpt.read_bytes()
    for overwrite in (False, True):
        with pytest.raises(UsageError) as info:
            inspect_checkpoint(ckpt, random=2, dump=ckpt, overwrite=overwrite)
        assert str(ckpt) in str(info.value) and "choose another file" in str(info.value)
    assert ckpt.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.safetensors"]


def test_an_existing_dump_is_replaced_only_with_overwrite(model, tmp_path: Path) -> None:
    ckpt = save_tiny_checkpoint(model, tmp_path / "tiny.safetensors")
    dump = tmp_path / "mine.safetensors"
    dump.write_text("my own file")
    with pytest.raises(UsageError) as info:
        inspect_checkpoint(ckpt, random=2, dump=dump)
    assert str(info.value) == f"--dump {dump}: exists; pass --overwrite to replace it"
    with pytest.raises(UsageError, match="is not a routing dump"):  # not one: kept, always
        inspect_checkpoint(ckpt, random=2, dump=dump, overwrite=True)
    assert dump.read_text() == "my own file"
    dump.unlink()
    inspect_checkpoint(ckpt, random=2, dump=dump)
    inspect_checkpoint(ckpt, random=2, dump=dump, overwrite=True)  # an earlier dump: replaced
    with safe_open(str(dump), "pt") as f:
        assert f.metadata()["format"] == "capsctl-routing"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.safetensors", "tiny.safetensors"]


def test_existing_pictures_are_replaced_only_with_overwrite_the_checkpoint_never(
    model, tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    ckpt = save_tiny_checkpoint(model, tmp_path / "tiny.safetensors")
    png = tmp_path / "png"
    png.mkdir()
    (png / "image1_routing.png").write_text("my own picture")
    with pytest.raises(UsageError) as info:
        inspect_checkpoint(ckpt, random=2, png_dir=png)
    path = png / "image1_routing.png"
    assert str(info.value) == f"--png {path}: exists; pass --overwrite to replace it"
    assert [p.name for p in png.iterdir()] == ["image1_routing.png"]
    assert path.read_text() == "my own picture"
    inside = png / "image0_routing.png"  # a checkpoint under the name of a picture
    inside.write_bytes(ckpt.read_bytes())
    with pytest.raises(UsageError, match="is the checkpoint being inspected; choose another"):
        inspect_checkpoint(inside, random=2, png_dir=png, overwrite=True)
    assert inside.read_bytes() == ckpt.read_bytes()
    with pytest.raises(UsageError, match="is not a PNG picture"):  # foreign: kept, always
        inspect_checkpoint(ckpt, random=2, png_dir=png, overwrite=True)
    assert inside.read_bytes() == ckpt.read_bytes() and path.read_text() == "my own picture"
    for earlier in (inside, path):  # earlier pictures are replaced with --overwrite
        earlier.write_bytes(b"\x89PNG\r\n\x1a\n an earlier picture")
    result = inspect_checkpoint(ckpt, random=2, png_dir=png, overwrite=True)
    assert len(result.written) == 2 * 2 + 2 and path.read_bytes().startswith(b"\x89PNG")
    assert len(path.read_bytes()) > 100


def test_the_command_refuses_to_dump_over_its_checkpoint(
    model, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = save_tiny_checkpoint(model, tmp_path / "tiny.safetensors")
    before = ckpt.read_bytes()
    code, out, err = run_cli(
        capsys, ["inspect-routing", str(ckpt), "--random", "2", "--dump", str(ckpt), "--overwrite"]
    )
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert str(ckpt) in line and "choose another file" in line
    assert ckpt.read_bytes() == before


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--random", "-1"], ["--random -1", "an integer in [1, "]),
        (["--random", "0"], ["--random 0", "an integer in [1, "]),
        (["--indices", "5-2"], ["--indices 5-2", "write it as 2-5"]),
    ],
)
def test_a_bad_image_count_or_a_reversed_range_is_a_usage_error(
    args: list[str], words: list[str], model, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = save_tiny_checkpoint(model, tmp_path / "tiny.safetensors")
    code, out, err = run_cli(capsys, ["inspect-routing", str(ckpt), *args])
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert all(w in line for w in words), line
    assert "Traceback" not in err
