"""Every routing algorithm is a first-class citizen: one interface, one registration, every
command (train, eval with the model's own loss, compare with the routing's FLOPs, export to
ONNX, inspect-routing) on a checkpoint of each, and older configurations and checkpoints
still load."""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from capsctl.checkpoint import load_checkpoint, model_tensors, save_checkpoint
from capsctl.config import Preset, load_preset, preset_from_dict, preset_to_dict, resolve_config
from capsctl.errors import ConfigError, UsageError
from capsctl.evaluation import evaluate_checkpoint
from capsctl.layers.algorithm import RoutingAlgorithm
from capsctl.layers.routers import ROUTERS
from capsctl.models import build_model_from_config
from capsctl.registry import get_config, list_models
from capsctl.training import BEST, fit

ALGORITHMS = ("idpa", "dynamic", "em", "self")
# each algorithm's own loss on one-label data (the papers: cross-entropy, margin, spread;
# self-routing: cross-entropy on the log class activations)
OWN_LOSS = {"idpa": "cross_entropy", "dynamic": "margin", "em": "spread", "self": "cross_entropy"}
HAS_ONNX = all(importlib.util.find_spec(p) for p in ("onnx", "onnxscript", "onnxruntime"))
CAPSCTL = Path(__file__).resolve().parents[3] / "capsctl"


def tiny_model(router: str) -> dict:
    return {
        "base": "mnist-caps",
        "primary_types": 4,
        "layers": [{"kind": "conv", "types": 4, "pose_dim": 16, "kernel": 3, "stride": 2}],
        "router": {"name": router},
    }


def tiny_preset(router: str) -> Preset:
    raw = preset_to_dict(load_preset("quickstart"))
    raw["model"] = tiny_model(router)
    raw["data"]["val_size"] = 200
    raw["train"].update(
        {"epochs": 1, "batch_size": 16, "eval_batch_size": 500, "steps_per_epoch": 3, "seed": 1}
    )
    return preset_from_dict(raw)


def test_one_registration_per_algorithm() -> None:
    assert list(ROUTERS) == list(ALGORITHMS)
    for name, cls in ROUTERS.items():
        assert issubclass(cls, RoutingAlgorithm) and cls.name == name
        assert cls.title and cls.reference and cls.summary and cls.coefficient_name
    for name in ("dynamic", "em", "self"):
        for bb in ("", "-simple"):
            for ds in ("cifar10", "cifar100"):
                assert get_config(f"{ds}-{name}{bb}").router["name"] == name
                preset = load_preset(f"paper-{ds}-{name}{bb}")
                assert preset.model.router["name"] == name


def _branches_on_names(tree: ast.AST) -> list[str]:
    """Comparisons of any expression with an algorithm's name or an old ``arch`` name."""
    names = {*ALGORITHMS, "capsnet-dynamic", "capsnet-em"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for part in [node.left, *node.comparators]:
                consts = part.elts if isinstance(part, (ast.Tuple, ast.List, ast.Set)) else [part]
                for c in consts:
                    if isinstance(c, ast.Constant) and c.value in names:
                        found.append(f"line {node.lineno}: {c.value!r}")
    return found


def test_nothing_outside_the_algorithms_branches_on_their_names() -> None:
    allowed = {CAPSCTL / "layers" / "routers", CAPSCTL / "models" / "spec.py"}
    offenders = []
    for path in sorted(CAPSCTL.rglob("*.py")):
        if any(path == a or a in path.parents for a in allowed):
            continue
        for hit in _branches_on_names(ast.parse(path.read_text())):
            offenders.append(f"{path.relative_to(CAPSCTL)} {hit}")
    assert not offenders


def test_the_branch_finder_finds_branches() -> None:
    tree = ast.parse("if cfg.router['name'] == 'em' or arch in ('x', 'capsnet-dynamic'): pass")
    assert len(_branches_on_names(tree)) == 2


@pytest.mark.parametrize(
    ("legacy", "router"),
    [
        ({"arch": "capsnet", "iterations": 3, "routing": "sequential"}, {"name": "idpa"}),
        ({"arch": "capsnet-dynamic", "iterations": 3, "routing": "sequential"}, {}),
        (
            {
                "arch": "capsnet-em",
                "iterations": 2,
                "routing": "sequential",
                "em_lambda": 0.5,
                "em_assignment": "window",
                "em_standardize_costs": True,
            },
            {},
        ),
    ],
)
def test_configs_written_before_routers_were_data_still_load(legacy: dict, router: dict) -> None:
    raw = {**tiny_model("idpa"), **legacy}
    del raw["router"]
    cfg = resolve_config(raw)
    assert cfg.arch == "capsnet"
    want = {
        "capsnet": {"name": "idpa", "iterations": 3, "schedule": "sequential"},
        "capsnet-dynamic": {"name": "dynamic", "iterations": 3},
        "capsnet-em": {
            "name": "em",
            "iterations": 2,
            "lambda_inf": 0.5,
            "assignment": "window",
            "standardize_costs": True,
        },
    }[legacy["arch"]]
    assert cfg.router == want
    # a legacy override on a new-style model moves into its router
    assert resolve_config({**tiny_model("em"), "iterations": 5}).router["iterations"] == 5


def test_checkpoint_of_an_old_em_model_loads(tmp_path: Path) -> None:
    """EM checkpoints written before routers were data: ``arch: capsnet-em``, top-level
    settings and the primary activation convolution at ``primary_act``."""
    cfg = resolve_config(tiny_model("em"))
    torch.manual_seed(0)
    model = build_model_from_config(cfg)
    tensors = model_tensors(model)
    old = {k.replace("model.primary.act.", "model.primary_act."): v for k, v in tensors.items()}
    assert any(k.startswith("model.primary_act.") for k in old)
    raw = {k: v for k, v in cfg.to_dict().items() if k != "router"}
    raw.update(arch="capsnet-em", iterations=3, routing="sequential", em_lambda=0.02)
    raw.update(em_assignment="parents", em_standardize_costs=False)
    path = tmp_path / "old.safetensors"
    save_checkpoint(path, old, {"preset": {"model": raw}})
    loaded, _ = load_checkpoint(path)
    x = torch.randn(2, 1, 28, 28)
    model.eval()
    loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_set_routing_follows_the_algorithm(name: str) -> None:
    model = build_model_from_config(resolve_config(tiny_model(name)))
    cls = ROUTERS[name]
    if "concurrent" not in cls.schedules:
        with pytest.raises(ValueError, match="only mode 'sequential'"):
            model.set_routing(mode="concurrent")
    if not cls.iterative:
        with pytest.raises(ValueError, match="no iterations"):
            model.set_routing(iterations=2)
        assert model.iterations == 1
    else:
        model.set_routing(iterations=4)
        assert model.iterations == 4


def test_flop_count_includes_the_routing() -> None:
    """A routed pass of inverted dot-product attention adds ``2 * 2 * J * B * m * d`` FLOPs
    (the agreement and the weighted sum, one multiply-accumulate per vote entry each) to what
    torch's counter sees."""
    from torch.utils.flop_counter import FlopCounterMode

    from capsctl.compare.flops import count_flops

    cfg = resolve_config({**tiny_model("idpa"), "router": {"name": "idpa", "iterations": 2}})
    model = build_model_from_config(cfg).eval()
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(torch.randn(2, 1, 28, 28))
    matmuls = counter.get_total_flops() / 2 / 1e9
    # concurrent T=2: only the class layer is routed. Its children: the 28x28 input -> 14x14
    # grid -> conv capsules k3 s2 -> 6x6 grid of 4 types, J = 144; B = 1 site per image;
    # m = 10 classes; d = 16
    routing = 2 * 2 * (6 * 6 * 4) * 1 * 10 * 16 / 1e9
    assert count_flops(model, [1, 28, 28]) == pytest.approx(matmuls + routing, rel=1e-9)


def test_flop_count_includes_em_routing() -> None:
    """EM routing adds ``2 * 2 * J * B * m * d`` FLOPs per M-step (the two moments) and per
    E-step but the last (the quadratic form): ``2 T - 1`` of them at T iterations; and
    ``2 * J * B * m`` per M-step (the mass ``sum_J R a``)."""
    from torch.utils.flop_counter import FlopCounterMode

    from capsctl.compare.flops import count_flops

    cfg = resolve_config({**tiny_model("em"), "router": {"name": "em", "iterations": 3}})
    model = build_model_from_config(cfg).eval()
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(torch.randn(2, 1, 28, 28))
    matmuls = counter.get_total_flops() / 2 / 1e9  # per image
    # per image: conv capsules: 6x6 sites, J = 3*3*4 children, m = 4 types, d = 16;
    # class capsules: 1 site, J = 6*6*4, m = 10, d = 16
    entries = 6 * 6 * (3 * 3 * 4) * 4 * 16 + 1 * (6 * 6 * 4) * 10 * 16
    assignments = 6 * 6 * (3 * 3 * 4) * 4 + 1 * (6 * 6 * 4) * 10
    routing = (2 * 2 * entries * (2 * 3 - 1) + 2 * assignments * 3) / 1e9
    assert count_flops(model, [1, 28, 28]) == pytest.approx(matmuls + routing, rel=1e-9)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, data_root: Path) -> dict[str, Path]:
    """One tiny trained checkpoint per algorithm (3 steps on MNIST)."""
    out = {}
    for name in ALGORITHMS:
        preset = tiny_preset(name)
        preset.data.data_dir = str(data_root)
        run = tmp_path_factory.mktemp(name)
        res = fit(preset, run, handle_sigint=False)
        assert res.test is not None and res.test.loss_name == OWN_LOSS[name]
        out[name] = run / BEST
    return out


@pytest.mark.parametrize("name", ALGORITHMS)
def test_eval_reports_the_models_own_loss(checkpoints: dict[str, Path], name: str) -> None:
    test, _ = evaluate_checkpoint(checkpoints[name], split="test", device="cpu")
    assert test.loss_name == OWN_LOSS[name]
    assert 0 <= test.accuracy <= 1 and torch.isfinite(torch.tensor(test.loss))


@pytest.mark.parametrize("name", ALGORITHMS)
def test_inspect_routing_on_a_checkpoint(
    checkpoints: dict[str, Path], name: str, tmp_path: Path
) -> None:
    from capsctl.inspection import inspect_checkpoint

    pytest.importorskip("matplotlib")
    res = inspect_checkpoint(
        checkpoints[name], random=2, png_dir=tmp_path / "png", dump=tmp_path / "r.safetensors"
    )
    cls = ROUTERS[name]
    assert res.algorithm == cls.title and res.coefficient_name == cls.coefficient_name
    iterations = cls.Params().iterations if cls.iterative else 1  # the default T
    assert res.iterations == iterations
    for layer in res.layers:
        assert len(layer.iterations) == iterations
        for it in layer.iterations:
            assert 0 <= it.mean_entropy <= 1 + 1e-9
    assert sorted(p.suffix for p in (tmp_path / "png").iterdir()) and res.written
    summary = res.report.to_dict()
    assert summary["algorithm"] == name and json.dumps(summary)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "r.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.metadata()["algorithm"] == name
    assert f"layer0.iter{iterations}" in keys
    has_act = name in ("em", "self")
    assert (f"layer0.iter{iterations}.activations" in keys) == has_act


@pytest.mark.skipif(not HAS_ONNX, reason="needs the export extra (onnx, onnxscript, onnxruntime)")
@pytest.mark.parametrize("name", ALGORITHMS)
def test_onnx_export_of_a_checkpoint(
    checkpoints: dict[str, Path], name: str, tmp_path: Path
) -> None:
    from capsctl.export import export_checkpoint

    res = export_checkpoint(checkpoints[name], "onnx", tmp_path / "m.onnx", check_images=4)
    assert res.max_abs_diff <= 1e-4 and (tmp_path / "m.onnx").stat().st_size > 0


def test_usage_errors_name_the_algorithm(checkpoints: dict[str, Path]) -> None:
    from capsctl.inspection import inspect_checkpoint

    with pytest.raises(UsageError, match="dynamic routing routes layer by layer"):
        inspect_checkpoint(checkpoints["dynamic"], random=1, routing="concurrent")
    with pytest.raises(UsageError, match="self-routing has no iterations"):
        inspect_checkpoint(checkpoints["self"], random=1, iterations=3)


def test_paper_suite_is_table_one_plus_self_routing() -> None:
    from capsctl.compare.targets import SUITES

    suite = SUITES["paper"]
    assert len(suite) == 2 * 2 * 5 + 1 and suite[-1] == "resnet18"
    assert set(suite) <= set(list_models())
    for ds in ("cifar10", "cifar100"):
        for bb in ("", "-simple"):
            for method in ("caps", "dynamic", "em", "self", "cnn"):
                assert f"{ds}-{method}{bb}" in suite


def test_bad_router_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="model.router.name"):
        resolve_config({**tiny_model("idpa"), "router": {"name": "nope"}})
