"""Registry sweep: parameter counts, shapes, gradients, batch independence, input sizes."""

from __future__ import annotations

import pytest
import torch

import capsctl
from capsctl.errors import ConfigError
from capsctl.models import param_groups
from capsctl.registry import get_config, list_models, resolve_config

EXPECTED_PARAMS = {
    ("cifar10-caps", None): 1_828_817,
    ("cifar10-caps-simple", None): 492_177,
    ("cifar100-caps", None): 2_799_629,
    ("cifar100-caps-simple", None): 1_462_989,
    ("resnet18", None): 11_173_962,
    ("resnet18", 100): 11_220_132,
}


@pytest.mark.parametrize("name,classes", list(EXPECTED_PARAMS))
def test_parameter_counts_are_exact(name: str, classes: int | None) -> None:
    model = capsctl.build_model(name, num_classes=classes)
    assert sum(p.numel() for p in model.parameters()) == EXPECTED_PARAMS[(name, classes)]


def test_backbone_split() -> None:
    groups = param_groups(capsctl.build_model("cifar10-caps"))
    assert groups == {"total": 1_828_817, "backbone": 1_340_224, "capsules": 488_593}


def test_registry_lists_required_models() -> None:
    names = capsctl.list_models()
    for required in (
        "cifar10-caps",
        "cifar10-caps-simple",
        "cifar100-caps",
        "resnet18",
        "cifar10-cnn",
        "cifar10-cnn-simple",
    ):
        assert required in names
    assert list_models("cifar100-*") == [n for n in names if n.startswith("cifar100-")]


def test_unknown_model_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown model 'nope'"):
        capsctl.build_model("nope")


@pytest.mark.parametrize("name", list_models())
def test_every_registered_model_trains_one_step(name: str) -> None:
    """Forward shape, finite loss, and every parameter gets a finite gradient (batch 2)."""
    torch.manual_seed(0)
    cfg = get_config(name)
    model = capsctl.build_model(cfg).train()
    x = torch.randn(2, cfg.in_channels, cfg.input_size, cfg.input_size)
    out = model(x)
    assert out.shape == (2, cfg.num_classes)
    loss = torch.nn.functional.cross_entropy(out, torch.tensor([0, 1]))
    loss.backward()
    assert torch.isfinite(loss)
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname
        if pname == "head.bias" and cfg.arch != "resnet18":
            # one bias shared by every class logit cancels in the softmax: its gradient is 0
            assert p.grad.abs().max() < 1e-6
            continue
        assert p.grad.abs().sum() > 0, pname


@pytest.mark.parametrize(
    "name,routing", [("cifar10-caps", "concurrent"), ("cifar10-caps-simple", "sequential")]
)
def test_eval_output_is_independent_of_the_batch(name: str, routing: str) -> None:
    torch.manual_seed(1)
    model = capsctl.build_model(name).eval()
    model.set_routing(iterations=3, mode=routing)
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        full = model(x)
        alone = torch.cat([model(x[i : i + 1]) for i in range(4)])
        flipped = model(x.flip(0)).flip(0)
    assert alone.shape == (4, 10)  # batch size 1 works
    assert torch.allclose(full, alone, atol=1e-4)
    assert torch.allclose(full, flipped, atol=1e-4)


@pytest.mark.parametrize("size", [28, 32, 36, 64])
@pytest.mark.parametrize("channels", [1, 3])
def test_input_sizes_and_channels(size: int, channels: int) -> None:
    cfg = resolve_config(
        {"base": "cifar10-caps-simple", "input_size": size, "in_channels": channels}
    )
    model = capsctl.build_model(cfg).eval()
    with torch.no_grad():
        out = model(torch.randn(1, channels, size, size))
    assert out.shape == (1, 10)
    assert torch.isfinite(out).all()


def test_too_small_input_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="too small"):
        capsctl.build_model({"base": "cifar10-caps-simple", "input_size": 8})


def test_wrong_input_size_at_run_time_is_explained() -> None:
    model = capsctl.build_model("cifar10-caps-simple").eval()
    with pytest.raises(ValueError, match="another input size"):
        model(torch.randn(1, 3, 40, 40))


def test_no_nan_with_large_inputs() -> None:
    torch.manual_seed(2)
    model = capsctl.build_model("cifar10-caps-simple").eval()
    with torch.no_grad():
        out = model(torch.randn(2, 3, 32, 32) * 1e3)
    assert torch.isfinite(out).all()


def test_cnn_baseline_widths_follow_the_capsule_head() -> None:
    model = capsctl.build_model("cifar10-cnn-simple")
    convs = [m for m in model.convs if isinstance(m, torch.nn.Conv2d)]
    assert [c.out_channels for c in convs] == [32 * 16, 32 * 16]
    assert [c.stride for c in convs] == [(2, 2), (1, 1)]
