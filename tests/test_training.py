"""Training: checkpoints, exact resume (after an epoch and mid-epoch), options, evaluation."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from capsctl.checkpoint import load_checkpoint, load_tensors, read_metadata
from capsctl.config import Preset, load_preset, preset_from_dict, preset_to_dict
from capsctl.errors import CapsctlError, UsageError
from capsctl.evaluation import evaluate_checkpoint
from capsctl.training import BEST, LAST, METRICS, Interrupted, fit, lr_factor

TINY_MODEL = {
    "base": "mnist-caps",
    "primary_types": 4,
    "layers": [{"kind": "conv", "types": 4, "pose_dim": 16, "kernel": 3, "stride": 2}],
}


def tiny_preset(val_size: int = 200, **train: object) -> Preset:
    raw = preset_to_dict(load_preset("quickstart"))
    raw["model"] = TINY_MODEL
    raw["data"]["val_size"] = val_size
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


def test_metrics_line_says_where_the_epoch_went(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seconds per phase of the step in each metrics line: they add up to the epoch's time and
    a slow loader shows up as data time (0.4 s a batch, 6 batches), not as forward time."""
    from capsctl.data.loader import Loader

    real = Loader._augment

    def slow_augment(self: Loader, *a: object) -> torch.Tensor:
        time.sleep(0.4)
        return real(self, *a)

    monkeypatch.setattr(Loader, "_augment", slow_augment)
    fit(tiny_preset(epochs=1), tmp_path / "run")
    lines = [json.loads(x) for x in (tmp_path / "run" / METRICS).read_text().splitlines()]
    assert len(lines) == 1
    rec = lines[0]
    parts = [rec[f"{p}_seconds"] for p in ("data", "forward", "backward", "optimizer", "other")]
    assert min(parts) >= 0.0 and rec["forward_seconds"] > 0 and rec["backward_seconds"] > 0
    assert sum(parts) == pytest.approx(rec["epoch_seconds"], rel=0.05, abs=0.01)
    assert rec["data_seconds"] >= 6 * 0.4
    assert rec["forward_seconds"] < 6 * 0.4
    assert rec["val_seconds"] > 0
    assert rec["images"] == 6 * 16  # the epoch's steps x batch


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
    # the epoch's gradient trace counts the steps before the interruption too
    before, after = (
        [json.loads(x) for x in (f / METRICS).read_text().splitlines()] for f in (full, run)
    )
    for key in ("grad_norm_mean", "grad_norm_max"):
        assert after[-1][key] == pytest.approx(before[-1][key], rel=1e-6) and after[-1][key] > 0


def test_a_resumed_runs_seconds_and_speed_add_up_its_pieces(tmp_path: Path) -> None:
    """Epoch 2 is interrupted after 3 steps, each slowed by 0.3 s, and resumed: its seconds
    and images/s count the steps before the interruption, and so do the run's seconds."""
    run = tmp_path / "run"

    def slow_then_interrupt(e: dict) -> None:
        if e["event"] == "step" and e["epoch"] == 2:
            time.sleep(0.3)
            if e["step"] == 3:
                os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(Interrupted):
        fit(tiny_preset(), run, on_event=slow_then_interrupt)
    res = fit(tiny_preset(), run, resume=run / LAST)
    second = res.history[1]
    assert second["epoch"] == 2 and second["epoch_seconds"] >= 0.9
    assert second["images_per_s"] <= second["images"] / 0.9
    # the machine's load as each epoch ends: above the CPUs, the run shared the machine
    assert second["cpus"] >= 1 and second["load_1m"] >= 0.0
    assert json.loads((run / "results.json").read_text())["seconds"] >= 0.9


def test_out_dir_holding_a_run_is_refused(tmp_path: Path) -> None:
    fit(tiny_preset(epochs=1), tmp_path)
    with pytest.raises(UsageError, match="already holds a run"):
        fit(tiny_preset(epochs=1), tmp_path)
    fit(tiny_preset(epochs=1), tmp_path, overwrite=True)


def test_out_dir_killed_before_its_first_checkpoint_says_overwrite(tmp_path: Path) -> None:
    """A run killed between writing best.safetensors and last.safetensors of its first epoch
    cannot be resumed: the message must not point at a last.safetensors that is not there."""
    fit(tiny_preset(epochs=1), tmp_path)
    (tmp_path / LAST).unlink()
    with pytest.raises(UsageError, match="--overwrite") as info:
        fit(tiny_preset(epochs=1), tmp_path)
    assert "--resume" not in str(info.value) and "no last.safetensors" in str(info.value)
    fit(tiny_preset(epochs=1), tmp_path, overwrite=True)
    assert (tmp_path / LAST).exists()


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import types

    import capsctl.losses as losses

    calls = {"n": 0}
    real = torch.nn.functional

    def cross_entropy(*args: object, **kw: object) -> torch.Tensor:
        loss = real.cross_entropy(*args, **kw)  # type: ignore[arg-type]
        calls["n"] += 1
        return (
            loss * float("nan") if calls["n"] == 6 + 1 + 2 else loss
        )  # 6 steps, 1 val batch, then step 2

    monkeypatch.setattr(losses, "F", types.SimpleNamespace(cross_entropy=cross_entropy))
    with pytest.raises(
        CapsctlError, match=r"loss became nan at epoch 2, step 2; the last good checkpoint"
    ):
        fit(tiny_preset(), tmp_path)
    assert read_metadata(tmp_path / LAST)["epoch"] == 1
    load_checkpoint(tmp_path / LAST)


def test_on_an_accelerator_the_loss_is_read_every_few_steps_and_a_bad_step_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU the loop keeps the first non-finite step on the device and reads it (with the
    loss shown) every SYNC_EVERY steps and at an epoch's end; simulated here on the CPU."""
    import types

    import capsctl.losses as losses
    from capsctl.training import trainer
    from capsctl.training.epoch_stats import EpochStats

    start = EpochStats.start.__func__

    def on_device(cls, device, partial):  # type: ignore[no-untyped-def]
        stats = start(cls, device, partial)
        stats.first_bad = torch.full((), -1, dtype=torch.int64)  # as on an accelerator
        return stats

    monkeypatch.setattr(EpochStats, "start", classmethod(on_device))
    monkeypatch.setattr(trainer, "SYNC_EVERY", 4)
    calls = {"n": 0}
    real = torch.nn.functional

    def cross_entropy(*args: object, **kw: object) -> torch.Tensor:
        loss = real.cross_entropy(*args, **kw)  # type: ignore[arg-type]
        calls["n"] += 1
        return loss * float("nan") if calls["n"] == 6 + 1 + 2 else loss  # epoch 2, step 2

    monkeypatch.setattr(losses, "F", types.SimpleNamespace(cross_entropy=cross_entropy))
    steps: list[tuple[int, int]] = []

    def seen(e: dict) -> None:
        if e["event"] == "step":
            steps.append((e["epoch"], e["step"]))

    with pytest.raises(CapsctlError, match=r"loss became nan at epoch 2, step 2; the last good"):
        fit(tiny_preset(), tmp_path, on_event=seen)
    assert steps == [(1, 4), (1, 6)]  # read at step 4 and at the epoch's end; stopped at (2, 4)
    assert read_metadata(tmp_path / LAST)["epoch"] == 1


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


def _spy_on_models(monkeypatch: pytest.MonkeyPatch) -> list[torch.nn.Module]:
    """Record every model the trainer builds (to look at it during and after training)."""
    import capsctl.training.setup as trainer

    built: list[torch.nn.Module] = []
    real = trainer.build_model_from_config

    def build(cfg: object) -> torch.nn.Module:
        model = real(cfg)  # type: ignore[arg-type]
        built.append(model)
        return model

    monkeypatch.setattr(trainer, "build_model_from_config", build)
    return built


def test_training_options_take_effect(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each option does what it says during a real run: bf16 activations inside autocast,
    channels_last weights and inputs, gradients clipped to the given norm; AdamW with cosine
    and warmup and label smoothing train and change the result."""
    import capsctl.training.setup as setup

    built = _spy_on_models(monkeypatch)
    seen: dict[str, list] = {"act": [], "channels_last": [], "pre_clip": [], "post_clip": []}

    def watch(model: torch.nn.Module) -> None:
        first_conv = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))

        def record(mod: torch.nn.Module, inp: object, out: torch.Tensor) -> None:
            if mod.training:
                seen["act"].append(out.dtype)
                # [b, c, h, w] with c > 1: channels_last strides differ from contiguous ones
                seen["channels_last"].append(
                    out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()
                )

        first_conv.register_forward_hook(record)

    real_clip = torch.nn.utils.clip_grad_norm_

    def clip(params: object, max_norm: float, *a: object, **kw: object) -> torch.Tensor:
        params = list(params)  # type: ignore[call-overload]
        total = real_clip(params, max_norm, *a, **kw)  # the norm before clipping
        seen["pre_clip"].append(float(total))
        grads = [p.grad.flatten() for p in params if p.grad is not None]
        seen["post_clip"].append(float(torch.cat(grads).norm()))
        return total

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    real_optimizer = setup.make_optimizer

    def make_optimizer(model: torch.nn.Module, preset: Preset) -> torch.optim.Optimizer:
        watch(model)
        return real_optimizer(model, preset)

    monkeypatch.setattr(setup, "make_optimizer", make_optimizer)

    plain = fit(tiny_preset(epochs=1, ema_decay=None), tmp_path / "plain", handle_sigint=False)
    assert set(seen["act"]) == {torch.float32} and not any(seen["channels_last"])
    # without grad_clip the norm is only measured: the gradients are left as they were
    assert len(seen["pre_clip"]) == 6
    assert seen["post_clip"] == pytest.approx(seen["pre_clip"], rel=1e-6)
    for key in seen:
        seen[key].clear()
    opts = tiny_preset(
        epochs=1,
        ema_decay=None,
        amp=True,
        channels_last=True,
        grad_clip=0.05,
        label_smoothing=0.1,
        optimizer="adamw",
        lr=0.003,
        schedule="cosine",
        warmup_epochs=0.5,
    )
    res = fit(opts, tmp_path / "opts", handle_sigint=False)
    assert res.test is not None and plain.test is not None
    assert set(seen["act"]) == {torch.bfloat16}  # autocast ran the convolutions in bf16
    assert seen["channels_last"] and all(seen["channels_last"])
    trained = built[-1]
    conv_weights = [m.weight for m in trained.modules() if isinstance(m, torch.nn.Conv2d)]
    assert all(w.is_contiguous(memory_format=torch.channels_last) for w in conv_weights)
    assert len(seen["pre_clip"]) == 6 and max(seen["pre_clip"]) > 0.05  # clipping was active
    assert all(n <= 0.05 * (1 + 1e-4) for n in seen["post_clip"])
    # the metrics trace the norm before clipping
    (rec,) = [json.loads(x) for x in (tmp_path / "opts" / METRICS).read_text().splitlines()]
    assert rec["grad_norm_max"] == pytest.approx(max(seen["pre_clip"]), rel=1e-5)
    assert rec["grad_norm_mean"] == pytest.approx(sum(seen["pre_clip"]) / 6, rel=1e-5)
    a = load_tensors(tmp_path / "plain" / LAST)
    b = load_tensors(tmp_path / "opts" / LAST)
    assert any(not torch.equal(a[k], b[k]) for k in a if k.startswith("model."))
    assert any(k.startswith("optim.") and "exp_avg" in k for k in b)  # AdamW's state


def test_resume_without_a_validation_split(tmp_path: Path) -> None:
    """val_size 0 stores no best validation accuracy (null); resume must still work."""
    run = tmp_path / "run"
    fit(tiny_preset(epochs=1, val_size=0), run, handle_sigint=False)
    assert read_metadata(run / LAST)["best"]["val_accuracy"] is None
    stored = preset_from_dict(read_metadata(run / LAST)["preset"])
    stored.train.epochs = 2
    res = fit(stored, run, resume=run / LAST, handle_sigint=False)
    assert res.epochs_done == 2 and res.best_val_accuracy is None
    assert res.test is not None and res.test.count == 2000


def test_interrupt_before_the_first_validation_resumes_exactly(tmp_path: Path) -> None:
    full = tmp_path / "full"
    fit(tiny_preset(), full)
    run = tmp_path / "run"

    def interrupt(e: dict) -> None:
        if e["event"] == "step" and e["epoch"] == 1 and e["step"] == 2:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(Interrupted, match="--resume"):
        fit(tiny_preset(), run, on_event=interrupt)
    meta = read_metadata(run / LAST)
    assert meta["epoch"] == 0 and meta["partial"]["step"] == 2
    assert meta["best"] == {"epoch": None, "val_accuracy": None}
    fit(tiny_preset(), run, resume=run / LAST)
    assert_same(weights(full / LAST), weights(run / LAST))
    # the epoch's gradient trace counts the steps before the interruption too
    before, after = (
        [json.loads(x) for x in (f / METRICS).read_text().splitlines()] for f in (full, run)
    )
    for key in ("grad_norm_mean", "grad_norm_max"):
        assert after[-1][key] == pytest.approx(before[-1][key], rel=1e-6) and after[-1][key] > 0


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"train": {"seed": 4}}, "train.seed"),
        ({"train": {"batch_size": 8}}, "train.batch_size"),
        ({"train": {"lr": 0.5}}, "train.lr"),
        ({"data": {"val_size": 300}}, "data.val_size"),
        ({"data": {"dataset": "mnist"}}, "data.dataset"),
        ({"model": {"primary_types": 8}}, "model.primary_types"),
    ],
)
def test_resume_refuses_fields_that_shape_the_run(tmp_path: Path, change: dict, field: str) -> None:
    run = tmp_path / "run"
    fit(tiny_preset(epochs=1), run, handle_sigint=False)
    raw = read_metadata(run / LAST)["preset"]
    for section, values in change.items():
        raw[section].update(values)
    if "model" in change:
        raw["model"] = {**raw["model"], **change["model"]}
    with pytest.raises(UsageError, match=rf"^{field}: cannot change on resume"):
        fit(preset_from_dict(raw), run, resume=run / LAST, handle_sigint=False)


def test_resume_applies_and_reports_allowed_changes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    fit(tiny_preset(epochs=1), run, handle_sigint=False)
    p = preset_from_dict(read_metadata(run / LAST)["preset"])
    old_device = p.train.device
    new_device = "auto" if old_device == "cpu" else "cpu"
    p.train.epochs, p.train.time_limit, p.train.device = 2, 3600.0, new_device
    events: list[dict] = []
    res = fit(p, run, resume=run / LAST, on_event=events.append, handle_sigint=False)
    assert res.epochs_done == 2
    (resume,) = [e for e in events if e["event"] == "resume"]
    changed = {c["field"]: (c["old"], c["new"]) for c in resume["changes"]}
    assert changed == {
        "train.epochs": (1, 2),
        "train.time_limit": (None, 3600.0),
        "train.device": (old_device, new_device),
    }


def test_ema_switched_on_at_resume_starts_from_the_resumed_weights(tmp_path: Path) -> None:
    run = tmp_path / "run"
    fit(tiny_preset(epochs=1, ema_decay=None), run, handle_sigint=False)
    resumed = {
        k[len("model.") :]: v for k, v in load_tensors(run / LAST).items() if k.startswith("model.")
    }
    p = preset_from_dict(read_metadata(run / LAST)["preset"])
    p.train.epochs, p.train.ema_decay = 2, 0.999999
    fit(p, run, resume=run / LAST, handle_sigint=False)
    ema = {k[len("ema.") :]: v for k, v in load_tensors(run / LAST).items() if k.startswith("ema.")}
    floats = [k for k, v in resumed.items() if v.dtype.is_floating_point]
    assert floats and set(floats) <= set(ema)
    # 6 steps at decay 1 - 1e-6 keep the average within 1e-5 of where it started
    for k in floats:
        assert torch.allclose(ema[k], resumed[k], atol=1e-4, rtol=0), k


def test_eval_reports_the_models_own_loss(tmp_path: Path) -> None:
    """Dynamic routing outputs capsule lengths, EM routing activations: their loss is the
    margin loss (Sabour et al. 2017, eq. 4) or the spread loss (Hinton et al. 2018, eq. 3, at
    its final margin 0.9), never a cross-entropy on those outputs."""
    from capsctl.losses import eval_loss

    out = torch.tensor([[0.95, 0.3, 0.05], [0.2, 0.5, 0.7]])
    y = torch.tensor([0, 1])

    def margin(v: list[float], t: int) -> float:
        total = 0.0
        for k, vk in enumerate(v):
            if k == t:
                total += max(0.0, 0.9 - vk) ** 2
            else:
                total += 0.5 * max(0.0, vk - 0.1) ** 2
        return total

    def spread(a: list[float], t: int) -> float:
        return sum(max(0.0, 0.9 - (a[t] - ai)) ** 2 for i, ai in enumerate(a) if i != t)

    rows = out.tolist()
    p = tiny_preset()
    p.model.router = {"name": "dynamic", "iterations": 3}
    name, fn = eval_loss(p, False, 3)
    expected = (margin(rows[0], 0) + margin(rows[1], 1)) / 2
    assert name == "margin" and float(fn(out, y)) == pytest.approx(expected, rel=1e-6)
    p.model.router = {"name": "em", "iterations": 3}
    name, fn = eval_loss(p, False, 3)
    expected = (spread(rows[0], 0) + spread(rows[1], 1)) / 2
    assert name == "spread" and float(fn(out, y)) == pytest.approx(expected, rel=1e-6)
    p = tiny_preset(label_smoothing=0.2)
    name, fn = eval_loss(p, False, 3)
    ce = torch.nn.functional.cross_entropy(out, y)  # no label smoothing in the reported loss
    assert name == "cross_entropy" and float(fn(out, y)) == pytest.approx(float(ce), rel=1e-6)


def test_evaluate_checkpoint_of_a_dynamic_routing_model_reports_margin_loss(
    tmp_path: Path,
) -> None:
    p = tiny_preset(epochs=1, ema_decay=None, steps_per_epoch=2)
    p.model.router = {"name": "dynamic", "iterations": 3}
    p.model.layers[0].pose = "vector"
    p.model.class_pose = "vector"
    res = fit(p, tmp_path, handle_sigint=False)
    assert res.test is not None and res.test.loss_name == "margin"
    lines = [json.loads(x) for x in (tmp_path / METRICS).read_text().splitlines()]
    test, _ = evaluate_checkpoint(tmp_path / BEST, split="test", device="cpu")
    assert test.loss_name == "margin" and test.loss == pytest.approx(res.test.loss, rel=1e-5)
    assert lines[0]["val_loss"] < 10  # a margin loss over 10 classes, not a CE of lengths


def test_compile_option_compiles_the_model_and_uses_the_dense_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--compile hands the training module to torch.compile; under compilation the routed pass
    takes the traceable dense formula (compiling for real takes minutes on 2 cores, so the
    compiler is replaced by a spy here)."""
    import capsctl.layers.passes.routed as routing

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


@pytest.mark.slow
def test_compiled_training_matches_eager(tmp_path: Path) -> None:
    """A real torch.compile run (inductor, CPU): the same two steps as eager give the same
    weights to 1e-4 (compiled kernels fuse and reorder float32 sums)."""
    eager = tiny_preset(epochs=1, ema_decay=None, steps_per_epoch=2, val_size=0)
    compiled = tiny_preset(epochs=1, ema_decay=None, steps_per_epoch=2, val_size=0, compile=True)
    fit(eager, tmp_path / "eager", handle_sigint=False)
    fit(compiled, tmp_path / "compiled", handle_sigint=False)
    a = load_tensors(tmp_path / "eager" / LAST)
    b = load_tensors(tmp_path / "compiled" / LAST)
    # The shared head bias cancels in the softmax: its gradient is rounding noise, which the
    # quickstart recipe's AdamW scales up to full steps, so it is not comparable.
    keys = [
        k
        for k in a
        if k.startswith("model.") and a[k].dtype.is_floating_point and k != "model.head.bias"
    ]
    assert len(keys) > 5
    for k in keys:
        assert torch.allclose(a[k], b[k], atol=1e-4, rtol=1e-4), k


def test_run_folder_gets_curves_and_tensorboard_events(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="pip install 'capsctl[plot]'")
    pytest.importorskip("tensorboard", reason="pip install 'capsctl[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    p = tiny_preset(ema_decay=None, steps_per_epoch=2)
    p.log.tensorboard = True
    events: list[dict] = []
    fit(p, tmp_path / "run", on_event=events.append, handle_sigint=False)
    run = tmp_path / "run"
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any(e["event"] == "curves" for e in events)
    acc = EventAccumulator(str(run))
    acc.Reload()
    val = [e.value for e in acc.Scalars("accuracy/val")]
    lines = [json.loads(x) for x in (run / METRICS).read_text().splitlines()]
    assert val == pytest.approx([r["val_accuracy"] for r in lines])
    # --overwrite starts clean: no curves or event files of the replaced run are left behind
    p.log.tensorboard, p.log.curves = False, False
    fit(p, run, overwrite=True, handle_sigint=False)
    assert not (run / "curves.png").exists() and not list(run.glob("events.out.tfevents.*"))


def test_test_flip_averages_the_outputs_on_each_image_and_its_mirror() -> None:
    """Images bright on the left: the model says class 0 (score 1 vs 0), and on the mirror
    image class 1 (0 vs 2); the average (0.5 vs 1) says class 1, the label."""
    from capsctl.data import ArrayDataset
    from capsctl.evaluation import evaluate

    class LeftRight(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = x.shape[-1] // 2
            left, right = x[..., :w].mean((1, 2, 3)), x[..., w:].mean((1, 2, 3))
            return torch.stack([left, 2 * right], 1)  # [b, 2]

    images = torch.zeros(4, 1, 4, 4, dtype=torch.uint8)
    images[..., :2] = 255
    ds = ArrayDataset(images, torch.ones(4, dtype=torch.long), ["a", "b"], "halves")
    kwargs = dict(batch_size=2, device=torch.device("cpu"), mean=[0.0], std=[1.0])
    plain = evaluate(LeftRight(), ds, classes=["a", "b"], **kwargs)
    flipped = evaluate(LeftRight(), ds, classes=["a", "b"], flip=True, **kwargs)
    assert plain.accuracy == 0.0 and not plain.flip
    assert flipped.accuracy == 1.0 and flipped.flip
    expected = torch.nn.functional.cross_entropy(torch.tensor([[0.5, 1.0]]), torch.tensor([1]))
    assert flipped.loss == pytest.approx(float(expected))
