"""Training engine: checkpoints, exact resume (after an epoch and mid-epoch), evaluation."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from capsctl.checkpoint import load_checkpoint, load_tensors, read_metadata
from capsctl.config import Preset, load_preset, preset_from_dict, preset_to_dict
from capsctl.engine import BEST, LAST, METRICS, Interrupted, evaluate_checkpoint, fit, lr_factor
from capsctl.errors import CapsctlError, UsageError

TINY_MODEL = {
    "base": "mnist-caps",
    "primary_types": 4,
    "layers": [{"kind": "conv", "types": 4, "pose_dim": 16, "kernel": 3, "stride": 2}],
}


def tiny_preset(**train: object) -> Preset:
    raw = preset_to_dict(load_preset("quickstart"))
    raw["model"] = TINY_MODEL
    raw["data"]["val_size"] = 200
    raw["data"]["augment"] = {"crop_padding": 2, "hflip": True}
    raw["train"].update(
        {
            "epochs": 2,
            "batch_size": 16,
            "eval_batch_size": 500,
            "steps_per_epoch": 6,
            "deterministic": True,
            "seed": 3,
            "ema_decay": 0.9,
            **train,
        }
    )
    return preset_from_dict(raw)


def weights(path: Path) -> dict[str, torch.Tensor]:
    return {
        k: v for k, v in load_tensors(path).items() if k.startswith(("model.", "ema.", "optim."))
    }


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_fit_writes_a_complete_run(tmp_path: Path) -> None:
    events: list[dict] = []
    res = fit(tiny_preset(), tmp_path / "run", on_event=events.append)
    run = tmp_path / "run"
    for name in (LAST, BEST, METRICS, "preset.yaml", "results.json"):
        assert (run / name).exists(), name
    lines = [json.loads(x) for x in (run / METRICS).read_text().splitlines()]
    assert [r["epoch"] for r in lines] == [1, 2]
    assert res.test is not None and res.test.count == 2000
    assert 0.0 <= res.test.accuracy <= 1.0
    meta = read_metadata(run / BEST)
    assert meta["classes"][0] == "T-shirt/top"
    assert meta["test"]["count"] == 2000
    assert "training_state" not in meta
    assert "training_state" in read_metadata(run / LAST)
    kinds = {e["event"] for e in events}
    assert {"data", "epoch_start", "step", "epoch_end", "checkpoint", "test"} <= kinds
    model, meta = load_checkpoint(run / BEST)
    assert not model.training
    # the resolved preset is written beside the run and round-trips
    assert load_preset(str(run / "preset.yaml")).train.steps_per_epoch == 6


def test_resume_after_epoch_one_matches_uninterrupted_run(tmp_path: Path) -> None:
    full = tmp_path / "full"
    fit(tiny_preset(), full)
    part = tmp_path / "part"

    class Killed(Exception):
        pass

    def kill_after_epoch_one(e: dict) -> None:
        if e["event"] == "epoch_start" and e["epoch"] == 2:
            raise Killed

    with pytest.raises(Killed):
        fit(tiny_preset(), part, on_event=kill_after_epoch_one)
    assert read_metadata(part / LAST)["epoch"] == 1
    # the CLI resumes with the preset stored in the checkpoint
    resumed_preset = preset_from_dict(read_metadata(part / LAST)["preset"])
    fit(resumed_preset, part, resume=part / LAST)
    assert_same(weights(full / LAST), weights(part / LAST))
    lines = [json.loads(x) for x in (part / METRICS).read_text().splitlines()]
    assert [r["epoch"] for r in lines] == [1, 2]


def test_sigint_mid_epoch_saves_and_resumes_exactly(tmp_path: Path) -> None:
    full = tmp_path / "full"
    fit(tiny_preset(), full)
    run = tmp_path / "run"

    def interrupt(e: dict) -> None:
        if e["event"] == "step" and e["epoch"] == 2 and e["step"] == 3:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(Interrupted, match="--resume"):
        fit(tiny_preset(), run, on_event=interrupt)
    meta = read_metadata(run / LAST)
    assert meta["epoch"] == 1 and meta["partial"]["step"] == 3
    fit(tiny_preset(), run, resume=run / LAST)
    assert_same(weights(full / LAST), weights(run / LAST))


def test_out_dir_holding_a_run_is_refused(tmp_path: Path) -> None:
    fit(tiny_preset(epochs=1), tmp_path)
    with pytest.raises(UsageError, match="already holds a run"):
        fit(tiny_preset(epochs=1), tmp_path)
    fit(tiny_preset(epochs=1), tmp_path, overwrite=True)


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import types

    import capsctl.engine as engine

    calls = {"n": 0}
    real = torch.nn.functional

    def cross_entropy(*args: object, **kw: object) -> torch.Tensor:
        loss = real.cross_entropy(*args, **kw)  # type: ignore[arg-type]
        calls["n"] += 1
        return (
            loss * float("nan") if calls["n"] == 6 + 1 + 2 else loss
        )  # 6 steps, 1 val batch, then step 2

    monkeypatch.setattr(engine, "F", types.SimpleNamespace(cross_entropy=cross_entropy))
    with pytest.raises(
        CapsctlError, match=r"loss became nan at epoch 2, step 2; the last good checkpoint"
    ):
        fit(tiny_preset(), tmp_path)
    assert read_metadata(tmp_path / LAST)["epoch"] == 1
    load_checkpoint(tmp_path / LAST)


def test_evaluate_checkpoint_val_and_test(tmp_path: Path) -> None:
    fit(tiny_preset(epochs=1), tmp_path)
    test, meta = evaluate_checkpoint(tmp_path / BEST, split="test", device="cpu")
    assert test.count == 2000 and len(test.confusion) == 10
    assert sum(map(sum, test.confusion)) == 2000
    assert abs(test.accuracy - meta["test"]["accuracy"]) < 1e-9
    val, _ = evaluate_checkpoint(tmp_path / BEST, split="val", device="cpu")
    assert val.count == 200
    assert abs(val.accuracy - meta["metrics"]["val_accuracy"]) < 1e-9
    hits = sum(a * n for a, n in zip(val.per_class, map(sum, val.confusion), strict=True))
    assert abs(hits / 200 - val.accuracy) < 1e-9


@pytest.mark.parametrize("schedule", ["multistep", "cosine", "onecycle", "constant"])
def test_lr_schedules(schedule: str) -> None:
    p = tiny_preset(schedule=schedule, epochs=10, milestones=[5, 8], warmup_epochs=0.0)
    f = [lr_factor(p, s, 10) for s in range(100)]
    assert all(x > 0 for x in f[:-1])
    if schedule == "multistep":
        assert f[0] == 1.0 and abs(f[55] - 0.1) < 1e-12 and abs(f[85] - 0.01) < 1e-12
    elif schedule == "cosine":
        assert f[0] == 1.0 and f[50] < f[10] and f[99] < 0.01
    elif schedule == "onecycle":
        assert f[0] < 0.1 and max(f) > 0.99 and f[99] < 0.01
    else:
        assert set(f) == {1.0}
    warm = tiny_preset(schedule="constant", warmup_epochs=2.0)
    assert lr_factor(warm, 0, 10) == pytest.approx(0.05) and lr_factor(warm, 25, 10) == 1.0


def test_training_options_run_and_change_the_result(tmp_path: Path) -> None:
    """bf16 autocast, channels_last, gradient clipping, label smoothing, AdamW with cosine and
    warmup: a run with all of them trains, and differs from the plain run."""
    plain = fit(tiny_preset(epochs=1, ema_decay=None), tmp_path / "plain", handle_sigint=False)
    opts = tiny_preset(
        epochs=1,
        ema_decay=None,
        amp=True,
        channels_last=True,
        grad_clip=0.5,
        label_smoothing=0.1,
        optimizer="adamw",
        lr=0.003,
        schedule="cosine",
        warmup_epochs=0.5,
    )
    res = fit(opts, tmp_path / "opts", handle_sigint=False)
    assert res.test is not None and plain.test is not None
    a = load_tensors(tmp_path / "plain" / LAST)
    b = load_tensors(tmp_path / "opts" / LAST)
    assert any(not torch.equal(a[k], b[k]) for k in a if k.startswith("model."))
    assert "optim.state.0.exp_avg" in b or any(k.startswith("optim.") and "exp_avg" in k for k in b)


def test_per_class_head_and_ablation_knobs(tmp_path: Path) -> None:
    p = tiny_preset(epochs=1, ema_decay=None)
    p.model.head = "per_class"
    p.model.layer_norm = False
    p.model.agreement_scale = False
    p.model.iterations = 3
    p.model.routing = "sequential"
    fit(p, tmp_path, handle_sigint=False)
    model, meta = load_checkpoint(tmp_path / BEST)
    assert meta["preset"]["model"]["head"] == "per_class"
    assert model.head.weight.shape == (10, 16)
    assert model.iterations == 3 and model.routing == "sequential"


def test_compile_option_compiles_the_model_and_uses_the_dense_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--compile hands the training module to torch.compile; under compilation the routed pass
    takes the traceable dense formula (compiling for real takes minutes on 2 cores, so the
    compiler is replaced by a spy here)."""
    import capsctl.layers.routing as routing

    compiled: list[object] = []

    def fake_compile(module: torch.nn.Module) -> torch.nn.Module:
        compiled.append(module)
        return module

    monkeypatch.setattr(torch, "compile", fake_compile)
    fit(
        tiny_preset(epochs=1, ema_decay=None, compile=True, steps_per_epoch=2),
        tmp_path,
        handle_sigint=False,
    )
    assert len(compiled) == 1
    dense_calls = []
    real_dense = routing.routed_pass_dense
    monkeypatch.setattr(
        routing, "routed_pass_dense", lambda *a: dense_calls.append(1) or real_dense(*a)
    )
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    x = torch.randn(4, 3, 2, 2)
    w = torch.randn(4, 2, 3, 2)
    p = torch.randn(3, 3, 2, 2)
    s, _ = routing.routed_pass(x, w, p, 0.5)
    assert dense_calls and torch.allclose(
        s, routing.routed_pass_reference(x, w, p, 0.5)[0], atol=1e-5
    )
