"""Registry sweep: parameter counts, shapes, gradients, batch independence, input sizes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import capsctl
from capsctl.checkpoint import load_checkpoint, model_tensors, save_checkpoint
from capsctl.config import resolve_config
from capsctl.errors import ConfigError
from capsctl.layers import ROUTERS
from capsctl.layers.backend import dispatch, native
from capsctl.models import parameter_counts
from capsctl.models.capsnet import architecture_summary
from capsctl.registry import get_config, list_models

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
    groups = parameter_counts(capsctl.build_model("cifar10-caps"))
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
    if cfg.arch == "capsnet" and cfg.router["name"] == "self":
        # self-routing's gating starts at zero (uniform coefficients, as in Hahn et al.'s
        # code), where the poses cannot reach the output yet: move it off zero first
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith(("route_weight", "route_bias")):
                    p.normal_(0.0, 0.1)
    x = torch.randn(2, cfg.in_channels, cfg.input_size, cfg.input_size)
    dispatch.reset_ran()
    out = model(x)
    assert out.shape == (2, cfg.num_classes)
    loss = torch.nn.functional.cross_entropy(out, torch.tensor([0, 1]))
    loss.backward()
    assert torch.isfinite(loss)
    if native.loaded() is not None:
        # every routing pass of every bundled model runs as the compiled loops on a CPU: a
        # silent fall back to the torch code fails here
        assert set(dispatch.ran()) <= {"native"}, dispatch.ran()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname
        if pname == "head.bias" and cfg.arch != "resnet18":
            # one bias shared by every class logit cancels in the softmax: its gradient is 0
            assert p.grad.abs().max() < 1e-6
            continue
        assert p.grad.abs().sum() > 0, pname


@pytest.mark.parametrize(
    "name", ["cifar10-caps-simple", "cifar10-em-simple", "cifar10-self-simple", "cifar10-cnn-fast"]
)
def test_logits_are_float32_under_bf16_autocast(name: str) -> None:
    """The read-out runs in float32 under autocast: float32 logits, and the shared head's bias
    gradient (the sum over every class logit's gradient, 0 in exact arithmetic) keeps only
    float32's rounding. With that sum in bf16 it kept about 2**-8 of its terms."""
    torch.manual_seed(0)
    cfg = get_config(name)
    model = capsctl.build_model(cfg).train()
    x = torch.randn(4, cfg.in_channels, cfg.input_size, cfg.input_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert out.dtype == torch.float32
    out.retain_grad()
    torch.nn.functional.cross_entropy(out, torch.tensor([0, 1, 2, 3])).backward()
    bias = getattr(model.head, "bias", None)
    if bias is None:  # EM's head is the class activations themselves
        return
    terms = float(out.grad.abs().sum())  # the sum of |terms| of head.bias's gradient
    # float32: each of the 4 * 10 additions rounds by at most 2**-24 of the running sum
    assert float(bias.grad.abs().max()) <= 40 * 2**-24 * terms


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


def test_full_width_multimnist_net_is_the_authors_configuration() -> None:
    """``multimnist-caps-full``: the authors' DiverseMultiMNIST config, counted by hand. Conv
    k3 s2 1 -> 1,024 channels with bias (36 -> 18), primary conv k3 s2 1,024 -> 16 * 64 without
    bias (18 -> 8) and LayerNorm(64), conv capsules k3 s1 (8 -> 6: 3 * 3 * 16 children, 8x8
    weights, 16 parent types), FC capsules 6 * 6 * 16 -> 10, class capsules 10 -> 10, each with
    LayerNorm(64), and the shared Linear(64, 1) head."""
    model = capsctl.build_model("multimnist-caps-full")
    by_hand = (
        (1 * 9 * 1024 + 1024)  # backbone
        + (1024 * 9 * 16 * 64 + 2 * 64)  # primary capsules
        + (9 * 16 * 8 * 16 * 8 + 2 * 64)  # conv capsule layer
        + (6 * 6 * 16 * 8 * 10 * 8 + 2 * 64)  # fc capsule layer
        + (10 * 8 * 10 * 8 + 2 * 64)  # class capsules
        + (64 + 1)  # head
    )
    assert parameter_counts(model) == {
        "total": by_hand,
        "backbone": 1 * 9 * 1024 + 1024,
        "capsules": by_hand - (1 * 9 * 1024 + 1024),
    }
    with torch.no_grad():
        feats = model.backbone(torch.randn(2, 1, 36, 36))
        assert feats.shape == (2, 1024, 18, 18)
        assert model.primary(feats).poses.shape == (2, 8, 8, 16, 64)  # [b, h, w, n, D]


@pytest.mark.parametrize("arch,router", [("capsnet", r) for r in ROUTERS] + [("cnn", "idpa")])
def test_primary_capsules_take_their_kernel_and_stride(arch: str, router: str) -> None:
    """Every router's primary capsules (and the CNN's primary conv) are a k3 s2 convolution of
    the backbone's width when asked: 28 -> 14 (backbone) -> 6 (primary) -> 2 (conv layer)."""
    torch.manual_seed(0)
    cfg = resolve_config(
        {
            "base": "mnist-caps",
            "arch": arch,
            "router": {"name": router},
            "backbone_width": 24,
            "primary_types": 4,
            "primary_kernel": 3,
            "primary_stride": 2,
            "layers": [{"kind": "conv", "types": 4, "pose_dim": 16, "kernel": 3, "stride": 2}],
        }
    )
    model = capsctl.build_model(cfg).train()
    x = torch.randn(2, 1, 28, 28)
    feats = model.backbone(x)
    assert feats.shape == (2, 24, 14, 14)
    if arch == "cnn":
        conv = model.primary[0]
        assert (conv.in_channels, conv.kernel_size, conv.stride) == (24, (3, 3), (2, 2))
        assert model.primary(feats).shape == (2, 4 * 16, 6, 6)
    else:
        assert model.primary(feats).poses.shape == (2, 6, 6, 4, 16)  # [b, h, w, n, D]
    out = model(x)
    assert out.shape == (2, 10)
    out.float().square().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_primary_kernel_larger_than_the_grid_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="model.primary_kernel: a 14x14 feature grid is too"):
        capsctl.build_model({"base": "mnist-caps", "primary_kernel": 15})


def test_architecture_summary_names_the_width_and_the_primary_convolution() -> None:
    text = architecture_summary(get_config("multimnist-caps-full"))
    assert text.startswith(
        "simple backbone of 1024 channels, primary 16x64 k3s2 -> 8x8, conv 16x64 k3s1 -> 6x6"
    )
    assert architecture_summary(get_config("multimnist-caps")).startswith(
        "simple backbone, primary 16x16, conv"
    )


def test_cnn_baseline_widths_follow_the_capsule_head() -> None:
    model = capsctl.build_model("cifar10-cnn-simple")
    convs = [m for m in model.convs if isinstance(m, torch.nn.Conv2d)]
    assert [c.out_channels for c in convs] == [32 * 16, 32 * 16]
    assert [c.stride for c in convs] == [(2, 2), (1, 1)]


# ---------------------------------------------------------------------------------------------
# Per-class head and the ablation knobs (Tsai et al., ICLR 2020), checked against the equations

KNOBS_MODEL = {
    "base": "mnist-caps",
    "primary_types": 4,
    "layers": [{"kind": "conv", "types": 4, "pose_dim": 16, "kernel": 3, "stride": 2}],
    "head": "per_class",
    "iterations": 3,
    "routing": "sequential",
}
POSE_SIDE = 4  # the class capsules above have 4 x 4 matrix poses: D = 16
LN_EPS = 1e-5  # torch.nn.LayerNorm's default, as in the authors' code


def class_capsules_by_hand(
    child: torch.Tensor,
    parent: torch.Tensor,
    weight: torch.Tensor,
    *,
    scaled: bool,
    norm: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One routed pass of the class capsules written from the equations.

    ``child[b, n, D]``, ``parent[b, m, D]`` (the previous iteration), ``weight[n, s, m, s]``.
    Votes ``V_ij = P_i @ W_ij``; agreement ``<p_j, V_ij>``, divided by ``sqrt(D)`` when
    ``scaled``; ``r_ij = softmax_j``; parent pose ``sum_i r_ij V_ij``, then LayerNorm with
    ``norm = (gain, bias)`` unless ``norm`` is None. Returns ``(poses[b, m, D], r[b, n, m])``.
    """
    s = POSE_SIDE
    b, n, _ = child.shape
    m = parent.shape[1]
    poses = child.reshape(b, n, s, s)  # [b, n, a, x]
    votes = torch.einsum("bnax,nxmc->bnmac", poses, weight).reshape(b, n, m, s * s)  # [b,n,m,D]
    logits = (votes * parent[:, None]).sum(-1)  # [b, n, m]
    if scaled:
        logits = logits / math.sqrt(s * s)
    r = torch.softmax(logits, dim=-1)  # over the parents j
    out = (r[..., None] * votes).sum(1)  # [b, m, D]
    if norm is not None:
        mean = out.mean(-1, keepdim=True)
        var = ((out - mean) ** 2).mean(-1, keepdim=True)
        out = (out - mean) / torch.sqrt(var + LN_EPS) * norm[0] + norm[1]
    return out, r


def test_per_class_head_and_ablation_knobs(tmp_path: Path) -> None:
    """``head: per_class``, ``layer_norm: false`` and ``agreement_scale: false`` build, train a
    step, survive a checkpoint, and change the computation as the equations say."""
    torch.manual_seed(3)
    cfg = resolve_config({**KNOBS_MODEL, "layer_norm": False, "agreement_scale": False})
    model = capsctl.build_model(cfg).double()
    assert model.head.weight.shape == (10, 16) and model.head.bias.shape == (10,)
    assert not any(isinstance(mod, torch.nn.LayerNorm) for mod in model.modules())
    assert model.iterations == 3 and model.routing == "sequential"

    # one training step: finite loss, a finite gradient for every parameter, weights move
    model.train()
    x = torch.randn(4, 1, 28, 28, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    loss = torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 2, 3]))
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    opt.step()
    assert not torch.equal(before["head.weight"], model.head.weight.detach())
    assert not torch.equal(before["capsules.1.weight"], model.capsules[1].weight.detach())

    # the computation, from the trace of every pass
    model.eval()
    with torch.no_grad():
        logits, trace = model(x, trace=True)
        feats = model.backbone(x)  # [b, C, H, W]
        primary = model.primary(feats).poses  # [b, H, W, n, D]
    # primary capsules without LayerNorm: the raw 1x1 convolution, read channel-last
    conv_w = model.primary.conv.weight[:, :, 0, 0].view(4, 16, -1)  # [n, D, C]
    assert torch.allclose(
        primary, torch.einsum("ndc,bchw->bhwnd", conv_w, feats), rtol=0, atol=1e-10
    )
    # class capsules: the agreement has no 1/sqrt(D) and the parent pose is the raw sum
    weight = model.capsules[1].weight.detach()  # [n, s, m, s]
    child = trace.poses[0][-1].reshape(4, -1, 16)  # [b, n, D], flattened as (h, w, n)
    for t in (1, 2):
        parent = trace.poses[1][t - 1]  # [b, m, D]
        got_pose, got_r = trace.poses[1][t], trace.coefficients[1][t]
        want_pose, want_r = class_capsules_by_hand(child, parent, weight, scaled=False, norm=None)
        assert torch.allclose(got_r, want_r, rtol=0, atol=1e-10)
        assert torch.allclose(got_pose, want_pose, rtol=0, atol=1e-10)
        # the knobs matter here: the scaled agreement or a LayerNorm would give other numbers
        scaled_pose, scaled_r = class_capsules_by_hand(
            child, parent, weight, scaled=True, norm=None
        )
        assert (scaled_r - got_r).abs().max() > 1e-3
        ones, zeros = torch.ones(16, dtype=x.dtype), torch.zeros(16, dtype=x.dtype)
        normed, _ = class_capsules_by_hand(child, parent, weight, scaled=False, norm=(ones, zeros))
        assert (normed - got_pose).abs().max() > 1e-3
    # per-class head: logit_c = w_c . p_c + b_c
    head = model.head
    want_logits = (trace.poses[1][-1] * head.weight).sum(-1) + head.bias  # [b, classes]
    assert torch.allclose(logits, want_logits, rtol=0, atol=1e-10)

    # the same weights with the default knobs follow the scaled, normalized equations
    default = capsctl.build_model(resolve_config(KNOBS_MODEL)).double().eval()
    missing, unexpected = default.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all(".norm." in k for k in missing)
    with torch.no_grad():
        for mod in default.modules():
            if isinstance(mod, torch.nn.LayerNorm):
                mod.weight.normal_()
                mod.bias.normal_()
        _, dtrace = default(x, trace=True)
    dchild = dtrace.poses[0][-1].reshape(4, -1, 16)  # [b, n, D]
    norm = (default.capsules[1].norm.weight, default.capsules[1].norm.bias)
    for t in (1, 2):
        want_pose, want_r = class_capsules_by_hand(
            dchild, dtrace.poses[1][t - 1], weight, scaled=True, norm=norm
        )
        assert torch.allclose(dtrace.coefficients[1][t], want_r, rtol=0, atol=1e-10)
        assert torch.allclose(dtrace.poses[1][t], want_pose, rtol=0, atol=1e-10)

    # the knobs and the head survive a checkpoint
    path = tmp_path / "knobs.safetensors"
    save_checkpoint(path, model_tensors(model), {"preset": {"model": cfg.to_dict()}})
    loaded, meta = load_checkpoint(path)
    assert meta["preset"]["model"]["head"] == "per_class"
    assert loaded.head.weight.shape == (10, 16)
    assert loaded.iterations == 3 and loaded.routing == "sequential"
    assert not any(isinstance(mod, torch.nn.LayerNorm) for mod in loaded.modules())
    with torch.no_grad():
        # the checkpoint model is float32: the weights are rounded to float32
        assert torch.allclose(loaded.double()(x), logits, rtol=0, atol=1e-6)
