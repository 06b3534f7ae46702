"""capsctl robustness: FGSM/PGD on [0, 1] pixels with each model's own loss, clean accuracy at
eps 0 and at an identity shift, the CLI's outputs and one-line errors."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from capsctl.cli import main
from capsctl.robustness import robustness_checkpoint, robustness_summary
from capsctl.robustness.api import _load
from capsctl.robustness.attacks import cw_margin, fgsm, loss_gradient, pgd

EPS = 8 / 255


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 26 * 26, 10)
    ).eval()


def _images(n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(n, 1, 28, 28, generator=gen)
    x[:, :, :4] = 0.0  # pixels at the edges of [0, 1], where clipping matters
    x[:, :, -4:] = 1.0
    return x, torch.randint(0, 10, (n,), generator=gen)


def _write_router_checkpoint(
    path: Path, router: dict, dataset: str = "fashion-mnist-quickstart", size: int = 28
) -> Path:
    """A tiny untrained capsule net with ``router`` (default: the embedded Fashion-MNIST
    subset's 28x28 images)."""
    from capsctl.checkpoint import model_tensors, save_checkpoint
    from capsctl.config import Preset, preset_to_dict, resolve_config
    from capsctl.models import build_model_from_config

    cfg = resolve_config(
        {"base": "mnist-caps", "primary_types": 4, "primary_dim": 16, "layers": [],
         "router": router, "input_size": size}
    )  # fmt: skip
    torch.manual_seed(0)
    model = build_model_from_config(cfg)
    preset = Preset(name="tiny", model=cfg)
    preset.data.dataset = dataset
    preset.data.normalization = "fashion-mnist" if dataset.startswith("fashion") else "mnist"
    preset.data.val_size = 200
    save_checkpoint(path, model_tensors(model), {"preset": preset_to_dict(preset), "epoch": 1})
    return path


def test_attacks_stay_in_the_eps_ball_and_in_unit_range() -> None:
    model, (x, y) = _cnn(), _images()
    for adv in (
        fgsm(model, x, y, EPS, F.cross_entropy),
        fgsm(model, x, y, EPS, F.cross_entropy, targeted=True),
        pgd(model, x, y, EPS, F.cross_entropy, steps=5, generator=torch.Generator()),
    ):
        assert float((adv - x).abs().max()) <= EPS + 1e-6
        assert float(adv.min()) >= 0.0 and float(adv.max()) <= 1.0
        assert float((adv - x).abs().max()) > EPS / 2  # it did move


def test_fgsm_agrees_with_foolbox() -> None:
    """Foolbox's L-inf fast gradient attack (FGSM, cross-entropy, no random start) on the same
    CNN gives the same adversarial images."""
    fb = pytest.importorskip("foolbox", reason="foolbox (the robustness extra) is not installed")
    model, (x, y) = _cnn(), _images()
    attack = fb.attacks.LinfFastGradientAttack(random_start=False)
    _, theirs, _ = attack(fb.PyTorchModel(model, bounds=(0, 1)), x, y, epsilons=EPS)
    ours = fgsm(model, x, y, EPS, F.cross_entropy)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


def _margin_loss_by_hand(v: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Sabour et al. 2017, eq. 4: m+ = 0.9, m- = 0.1, lambda = 0.5; summed over classes."""
    t = F.one_hot(y, v.shape[1]).float()
    per = t * torch.clamp(0.9 - v, min=0) ** 2 + 0.5 * (1 - t) * torch.clamp(v - 0.1, min=0) ** 2
    return per.sum(1).mean()


def _spread_loss_by_hand(a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Hinton et al. 2018, §3.1, at the final margin m = 0.9: sum over i != t of
    max(0, m - (a_t - a_i))^2."""
    a_t = a.gather(1, y[:, None])  # [b, 1]
    per = torch.clamp(0.9 - (a_t - a), min=0) ** 2  # [b, C]
    per = per * (1 - F.one_hot(y, a.shape[1]).float())
    return per.sum(1).mean()


@pytest.mark.parametrize(
    ("router", "by_hand"),
    [
        ({"name": "dynamic", "iterations": 2}, _margin_loss_by_hand),
        ({"name": "em", "iterations": 2}, _spread_loss_by_hand),
    ],
)
def test_the_attack_uses_the_models_own_loss(
    tmp_path: Path, router: dict, by_hand: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> None:
    setup = _load(_write_router_checkpoint(tmp_path / "m.safetensors", router), None, "cpu", 4, 4)
    x = setup.test.images.float() / 255
    y = setup.test.labels
    used = loss_gradient(setup.model, x, y, setup.loss_fn)
    xr = x.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(by_hand(setup.model(xr), y), xr)
    assert float(expected.abs().max()) > 0
    torch.testing.assert_close(used, expected, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(
        fgsm(setup.model, x, y, EPS, setup.loss_fn), (x + EPS * expected.sign()).clamp(0, 1)
    )


def test_cw_margin_against_typed_numbers() -> None:
    """Carlini and Wagner's margin: best other output minus the label's, summed over images."""
    z = torch.tensor([[0.2, 0.9, 0.1], [0.5, 0.3, 0.4], [0.1, 0.1, 0.7]])
    y = torch.tensor([1, 0, 0])
    # (0.2 - 0.9) + (0.4 - 0.5) + (0.7 - 0.1)
    assert float(cw_margin(z, y)) == pytest.approx(-0.2)


def test_a_flat_own_loss_stalls_the_attack_and_cw_does_not() -> None:
    """Outputs that meet the margin loss's margins (label length above 0.9, the others below
    0.1) give it a zero gradient: FGSM with it leaves the images as they are (the gradient
    masking that makes a margin-loss model look robust). The CW margin still moves them,
    across the boundary."""
    from capsctl.losses import margin_loss

    class Lengths(nn.Module):  # lengths 0.95 for class 0 and 0.05 for class 1 at x = 0.5
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            s = x.flatten(1).mean(1, keepdim=True) - 0.5  # [b, 1]
            return torch.cat([0.95 - 3 * s, 0.05 + 3 * s], 1)  # [b, 2]

    x, y = torch.full((2, 1, 4, 4), 0.5), torch.zeros(2, dtype=torch.long)
    model, eps = Lengths(), 0.2
    assert float(loss_gradient(model, x, y, margin_loss).abs().max()) == 0.0
    assert torch.equal(fgsm(model, x, y, eps, margin_loss), x)
    adv = fgsm(model, x, y, eps, cw_margin)
    assert torch.allclose(adv, x + eps)  # every pixel up: class 0's length falls
    assert bool((model(adv).argmax(1) == 1).all())


def test_the_cli_attacks_the_cw_margin_when_asked(
    tiny_checkpoint: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["robustness", str(tiny_checkpoint()), "--attack", "fgsm", "--eps", "8/255",
            "--limit", "8", "--device", "cpu", "--json"]  # fmt: skip
    main([*args, "--loss", "cw"])
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert result["loss_name"] == "cw_margin" and len(result["attacks"]) == 1
    with pytest.raises(SystemExit) as e:
        main([*args, "--loss", "hinge"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.count("\n") == 0 and "--loss hinge" in err and "cw" in err


@pytest.mark.parametrize("option", [{"loss": "cw"}, {"targeted": True}], ids=["cw", "targeted"])
def test_multi_label_data_refuses_a_single_label_attack_in_one_line(
    option: dict, tmp_path: Path, data_root: Path
) -> None:
    """The CW margin and the targeted attack need one label per image; DiverseMultiMNIST has
    two."""
    from capsctl.checkpoint import model_tensors, save_checkpoint
    from capsctl.config import Preset, preset_to_dict, resolve_config
    from capsctl.errors import UsageError
    from capsctl.models import build_model_from_config

    cfg = resolve_config(
        {"base": "mnist-caps", "primary_types": 4, "primary_dim": 16, "layers": [],
         "input_size": 36}
    )  # fmt: skip
    preset = Preset(name="tiny", model=cfg)
    preset.data.dataset, preset.data.normalization = "diverse-multimnist", "mnist"
    path = tmp_path / "m.safetensors"
    weights = model_tensors(build_model_from_config(cfg))
    save_checkpoint(path, weights, {"preset": preset_to_dict(preset), "epoch": 1})
    with pytest.raises(UsageError) as e:
        robustness_checkpoint(
            path, attacks=("fgsm",), eps=(EPS,), limit=4, device="cpu",
            data_dir=str(data_root), **option,
        )  # fmt: skip
    assert "one label per image" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "model",
    [{"router": {"name": "self"}}, {"arch": "cnn"}, {"arch": "resnet18", "in_channels": 1}],
    ids=["self-routing", "cnn", "resnet18"],
)
def test_every_router_and_baseline_can_be_attacked(tmp_path: Path, model: dict) -> None:
    from capsctl.checkpoint import model_tensors, save_checkpoint
    from capsctl.config import Preset, preset_to_dict, resolve_config
    from capsctl.models import build_model_from_config

    base = {"base": "mnist-caps", "primary_types": 4, "primary_dim": 16, "layers": []}
    cfg = resolve_config({**base, **model})
    preset = Preset(name="tiny", model=cfg)
    preset.data.dataset, preset.data.normalization = "fashion-mnist-quickstart", "fashion-mnist"
    path = tmp_path / "m.safetensors"
    torch.manual_seed(0)
    weights = model_tensors(build_model_from_config(cfg))
    save_checkpoint(path, weights, {"preset": preset_to_dict(preset), "epoch": 1})
    res = robustness_checkpoint(path, attacks=("fgsm",), eps=(EPS,), limit=2, device="cpu")
    assert [p.attack for p in res.attacks] == ["fgsm"]
    assert all(0 <= p.accuracy <= 1 for p in res.attacks) and res.loss_name == "cross_entropy"


def test_eps_zero_gives_the_clean_accuracy_exactly(tiny_checkpoint: Callable[..., Path]) -> None:
    from capsctl.evaluation import evaluate

    path = tiny_checkpoint()
    res = robustness_checkpoint(
        path, eps=(0.0, EPS), steps=3, limit=40, batch_size=16, device="cpu"
    )
    at_zero = [p for p in res.attacks if p.eps == 0]
    assert [p.attack for p in at_zero] == ["fgsm", "pgd"]
    assert all(p.accuracy == res.clean_accuracy for p in at_zero)
    assert all(p.success_rate == 0.0 for p in at_zero)
    setup = _load(path, None, "cpu", 40, 16)
    plain = evaluate(
        setup.model.model, setup.test, batch_size=16, device=torch.device("cpu"),
        mean=[0.286], std=[0.353], classes=setup.test.classes,
    )  # fmt: skip
    assert res.clean_accuracy == pytest.approx(plain.accuracy, abs=1 / 40 + 1e-9)


def test_an_identity_shift_gives_the_clean_accuracy(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint()
    for kind in ("rotate", "translate"):
        res = robustness_checkpoint(
            path, attacks=(), shift=kind, magnitudes=(0.0, 30.0), limit=24, device="cpu"
        )
        assert res.shifts[0].accuracy == res.clean_accuracy


def test_affine_needs_a_40x40_expanded_mnist_model(tiny_checkpoint: Callable[..., Path]) -> None:
    from capsctl.errors import UsageError

    with pytest.raises(UsageError, match="expanded-mnist"):
        robustness_checkpoint(tiny_checkpoint(), attacks=(), shift="affine", limit=4)


def test_affine_set_on_an_expanded_mnist_checkpoint(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Sabour et al.'s protocol: a 40x40 expanded-MNIST model tested on affNIST-style digits."""
    ckpt = _write_router_checkpoint(
        tmp_path / "e.safetensors", {"name": "idpa", "iterations": 1}, "expanded-mnist", 40
    )
    main(["robustness", str(ckpt), "--shift", "affine", "--limit", "8", "--device", "cpu",
          "--json"])  # fmt: skip
    res = json.loads(capsys.readouterr().out)["results"][0]
    assert res["attacks"] == [] and res["dataset"] == "expanded-mnist"
    assert [p["magnitude"] for p in res["shifts"]] == [0.0, 1.0]
    assert all(p["count"] == 8 for p in res["shifts"])


def test_cli_json_pictures_and_no_overwrite(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    ckpt, pics = str(tiny_checkpoint()), tmp_path / "pics"
    args = ["robustness", ckpt, ckpt, "--attack", "fgsm", "--eps", "0,8/255", "--limit", "8",
            "--device", "cpu", "--png", str(pics)]  # fmt: skip
    main([*args, "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["results"]) == 2 and doc["results"][0]["attacks"][1]["eps"] == EPS
    # where it was measured travels with the numbers
    assert doc["provenance"]["torch_version"] == torch.__version__
    assert doc["provenance"]["cores"] == os.cpu_count() and "commit" in doc["provenance"]
    assert (pics / "accuracy-vs-eps.png").stat().st_size > 0
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "already exists" in err and "--overwrite" in err
    main([*args, "--csv", "--overwrite"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("checkpoint,test,setting") and len(lines) == 1 + 2 * 3


def test_cli_one_line_error_when_the_test_data_cannot_be_loaded(
    tiny_checkpoint: Callable[..., Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("CAPSCTL_DATA", str(empty))
    ckpt = tiny_checkpoint(dataset="mnist")
    with pytest.raises(SystemExit) as e:
        main(["robustness", str(ckpt), "--limit", "4", "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert str(ckpt) in err and "cannot load its test data" in err and str(empty) in err


def test_robustness_summary(tiny_checkpoint: Callable[..., Path]) -> None:
    doc = robustness_summary(tiny_checkpoint(), limit=8, corruption_limit=2, steps=2, device="cpu")
    assert set(doc) >= {"fgsm_8_255_accuracy", "pgd_8_255_accuracy", "mean_corruption_accuracy"}
    assert 0 <= doc["pgd_8_255_accuracy"] <= doc["clean_accuracy"] + 1e-9
    assert 0 <= doc["mean_corruption_accuracy"] <= 1


def test_a_picture_never_replaces_a_checkpoint_it_reads(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pics = tmp_path / "pics"
    pics.mkdir()
    ckpt = tiny_checkpoint(pics / "accuracy-vs-eps.png")  # a checkpoint under a picture's name
    before = ckpt.read_bytes()
    with pytest.raises(SystemExit) as e:
        main(["robustness", str(ckpt), "--png", str(pics), "--overwrite", "--device", "cpu"])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and str(ckpt) in line and "pick another output path" in line
    assert ckpt.read_bytes() == before and [p.name for p in pics.iterdir()] == [ckpt.name]


def test_each_attack_and_shift_carries_its_own_wall_time(
    tiny_checkpoint: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A clock that moves 1.5 s per reading: each setting reads it twice, so each takes 1.5 s.
    import types

    import capsctl.robustness.api as api

    ticks = iter(range(1000))
    clock = types.SimpleNamespace(perf_counter=lambda: 1.5 * next(ticks))
    monkeypatch.setattr(api, "time", clock)
    ckpt = str(tiny_checkpoint())
    args = ["robustness", ckpt, "--attack", "fgsm,pgd", "--eps", "8/255", "--shift", "rotate",
            "--magnitudes", "0,30", "--steps", "2", "--limit", "8", "--device", "cpu"]  # fmt: skip
    main([*args, "--json"])
    res = json.loads(capsys.readouterr().out)["results"][0]
    assert [a["seconds"] for a in res["attacks"]] == [1.5, 1.5]
    assert [p["seconds"] for p in res["shifts"]] == [1.5, 1.5]
    assert res["seconds"] > 4 * 1.5  # the whole measurement holds the four settings
    main([*args, "--csv"])
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].endswith(",success_rate,seconds")
    assert [r.rsplit(",", 1)[1] for r in rows[1:]] == ["", "1.500", "1.500", "1.500", "1.500"]
    main(args)
    assert "seconds" in capsys.readouterr().out


def test_a_result_reads_back_from_its_json_also_from_an_older_capsctl(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    from capsctl.robustness.api import RobustnessResult

    res = robustness_checkpoint(
        tiny_checkpoint(), eps=(EPS,), steps=2, shift="rotate", magnitudes=(0.0, 15.0),
        limit=8, device="cpu",
    )  # fmt: skip
    doc = json.loads(json.dumps(res.to_dict()))
    assert RobustnessResult.from_dict(doc) == res
    for item in doc["attacks"] + doc["shifts"]:  # written before settings were timed
        del item["seconds"]
    old = RobustnessResult.from_dict(doc | {"written_by": "a later capsctl"})
    assert [a.seconds for a in old.attacks] == [0.0, 0.0]
    assert [a.accuracy for a in old.attacks] == [a.accuracy for a in res.attacks]


def test_an_interrupted_measurement_resumes_from_its_resume_file(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import capsctl.robustness.api as api
    from capsctl.errors import UsageError
    from capsctl.robustness.run import run_robustness

    ckpt, kept = tiny_checkpoint(), tmp_path / "kept.jsonl"
    options = {"eps": (EPS, 2 * EPS), "steps": 2, "shift": "rotate", "magnitudes": (0.0, 15.0),
               "limit": 8, "device": "cpu"}  # fmt: skip

    def numbers(res: api.RobustnessResult) -> list[tuple[object, ...]]:
        return [(p.attack, p.eps, p.accuracy, p.success_rate) for p in res.attacks] + [
            (p.shift, p.magnitude, p.accuracy) for p in res.shifts
        ]

    whole = robustness_checkpoint(ckpt, **options)
    real, calls = api._attack_point, []

    def counted(*args: object, **kwargs: object) -> api.AttackPoint:
        calls.append(args[1:3])
        if interrupt and len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "_attack_point", counted)
    interrupt = True
    with pytest.raises(KeyboardInterrupt):
        run_robustness([ckpt], resume_file=kept, **options)
    interrupt, calls[:] = False, []
    with kept.open("a") as f:
        f.write('{"checkpoint": {"path": ')  # the line a kill cut short
    again = run_robustness([ckpt], resume_file=kept, **options).results[0]
    assert calls == [("fgsm", 2 * EPS), ("pgd", EPS), ("pgd", 2 * EPS)]  # the first one kept
    assert numbers(again) == numbers(whole)
    calls[:] = []
    assert numbers(run_robustness([ckpt], resume_file=kept, **options).results[0]) == numbers(whole)
    assert calls == []  # everything kept, shifts included
    run_robustness([ckpt], resume_file=kept, **(options | {"steps": 3}))
    assert calls == [("fgsm", EPS), ("fgsm", 2 * EPS), ("pgd", EPS), ("pgd", 2 * EPS)]
    calls[:] = []
    stat = ckpt.stat()
    os.utime(ckpt, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # retrained in place
    run_robustness([ckpt], resume_file=kept, **options)
    assert len(calls) == 4
    (tmp_path / "other.txt").write_text("hello\n")
    with pytest.raises(UsageError, match="not a file of finished robustness settings"):
        run_robustness([ckpt], resume_file=tmp_path / "other.txt", **options)
    with pytest.raises(UsageError, match="is the input"):
        run_robustness([ckpt], resume_file=ckpt, **options)
