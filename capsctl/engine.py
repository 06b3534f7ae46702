"""Training and evaluation. Returns results and emits progress events; never prints.

Data flow of :func:`fit`: preset -> datasets (train split into train/val, test kept apart) ->
model -> optimizer, per-step LR schedule, optional EMA -> epochs. After each epoch the run folder
gets ``last.safetensors`` (weights and everything needed to resume) and, when validation accuracy
improved, ``best.safetensors``; ``metrics.jsonl`` gets one line. At the end the best weights are
evaluated once on the test split.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from capsctl import __version__
from capsctl.atomic import write_text_atomic
from capsctl.checkpoint import (
    capture_rng_state,
    load_tensors,
    model_tensors,
    pack_training_state,
    read_metadata,
    restore_rng_state,
    save_checkpoint,
    stored_preset,
    unpack_training_state,
)
from capsctl.config import Preset, dump_yaml, preset_to_dict
from capsctl.data.prepare import prepare_data
from capsctl.devices import resolve_device
from capsctl.errors import CapsctlError, CheckpointError, ConfigError, UsageError
from capsctl.losses import EvalLoss, count_correct, default_eval_loss, eval_loss, make_loss

Event = dict[str, Any]
EventFn = Callable[[Event], None] | None

LAST = "last.safetensors"
BEST = "best.safetensors"
METRICS = "metrics.jsonl"
RESOLVED_PRESET = "preset.yaml"
RESULTS = "results.json"
CURVES = "curves.png"


def _emit(on_event: EventFn, event: str, **fields: Any) -> None:
    if on_event is not None:
        on_event({"event": event, **fields})


# ---------------------------------------------------------------------------------------------
# Data


# ---------------------------------------------------------------------------------------------
# Evaluation


@dataclass
class EvalResult:
    split: str
    dataset: str
    count: int
    loss: float
    accuracy: float  # top-1, micro (fraction of images)
    top5: float
    per_class: list[float]
    confusion: list[list[int]]  # rows: true class, columns: predicted class
    classes: list[str]
    images_per_s: float
    seconds: float
    metric: str = "top-1"
    loss_name: str = "cross_entropy"  # the model's own training loss: cross_entropy, bce, ...

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@torch.no_grad()
def evaluate(
    model: nn.Module,
    ds: Any,
    *,
    batch_size: int,
    device: torch.device,
    mean: list[float],
    std: list[float],
    classes: list[str],
    split: str = "test",
    amp: bool = False,
    loss: EvalLoss | None = None,
    on_event: EventFn = None,
) -> EvalResult:
    """Top-1/top-5 accuracy, loss, per-class accuracy and confusion matrix over ``ds``.

    ``loss`` is the model's own loss as ``(name, fn(outputs, labels) -> batch mean)`` (see
    :func:`eval_loss`); by default cross-entropy, or binary cross-entropy for multi-label data.
    """
    from capsctl.data import Loader

    loader = Loader(ds, batch_size, shuffle=False, device=device, mean=mean, std=std)
    model.eval()
    n_cls = len(classes)
    multi_label = ds.labels.dim() == 2
    loss_name, loss_fn = loss or default_eval_loss(multi_label, n_cls)
    if multi_label:
        return _evaluate_multi_label(
            model,
            loader,
            ds,
            device=device,
            classes=classes,
            split=split,
            amp=amp,
            loss=(loss_name, loss_fn),
            on_event=on_event,
        )
    confusion = torch.zeros(n_cls, n_cls, dtype=torch.int64)
    loss_sum, top5_hits, count = 0.0, 0, 0
    t0 = time.perf_counter()
    for step, (x, y) in enumerate(loader):
        with _autocast(device, amp):
            logits = model(x)
        logits = logits.float()
        loss_sum += float(loss_fn(logits, y)) * int(y.shape[0])
        pred = logits.argmax(1)
        k = min(5, n_cls)
        top5_hits += int((logits.topk(k, 1).indices == y[:, None]).any(1).sum())
        confusion += torch.bincount((y * n_cls + pred).cpu(), minlength=n_cls * n_cls).view(
            n_cls, n_cls
        )
        count += int(y.numel())
        _emit(on_event, "eval_step", split=split, step=step + 1, steps=len(loader))
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    correct = confusion.diag()
    per_class = (correct.double() / confusion.sum(1).clamp(min=1).double()).tolist()
    return EvalResult(
        split=split,
        dataset=getattr(ds, "name", "?"),
        count=count,
        loss=loss_sum / max(count, 1),
        accuracy=float(correct.sum()) / max(count, 1),
        top5=top5_hits / max(count, 1),
        per_class=per_class,
        confusion=confusion.tolist(),
        classes=list(classes),
        images_per_s=count / max(seconds, 1e-9),
        seconds=seconds,
        loss_name=loss_name,
    )


def _evaluate_multi_label(
    model: nn.Module,
    loader: Any,
    ds: Any,
    *,
    device: torch.device,
    classes: list[str],
    split: str,
    amp: bool,
    loss: EvalLoss,
    on_event: EventFn,
) -> EvalResult:
    """Multi-label data (DiverseMultiMNIST): the paper's metric — for two digits the top-2
    classes equal the two labels, for one digit the top-1 class equals it. ``per_class`` is the
    recall of each class (share of its appearances found among the top-k, k = digits in the
    image); ``top5``: share of images whose labels are all among the top 5; loss: the model's
    own loss (binary cross-entropy per class by default)."""
    from capsctl.losses import multi_hot, top2_correct

    loss_name, loss_fn = loss
    n_cls = len(classes)
    hits = torch.zeros(n_cls, dtype=torch.int64)
    seen = torch.zeros(n_cls, dtype=torch.int64)
    loss_sum, correct, top5_hits, count = 0.0, 0, 0, 0
    t0 = time.perf_counter()
    for step, (x, y) in enumerate(loader):
        with _autocast(device, amp):
            logits = model(x)
        logits = logits.float()
        target = multi_hot(y, n_cls)
        loss_sum += float(loss_fn(logits, y)) * int(y.shape[0])
        correct += int(top2_correct(logits, y).sum())
        k = (y >= 0).sum(1)  # digits per image
        top2 = logits.topk(2, 1).indices
        found = torch.zeros_like(target)
        found.scatter_(1, top2[:, :1], 1.0)
        found[k == 2] = found[k == 2].scatter(1, top2[k == 2], 1.0)
        hits += (found * target).sum(0).long().cpu()
        seen += target.sum(0).long().cpu()
        top5 = torch.zeros_like(target).scatter_(1, logits.topk(min(5, n_cls), 1).indices, 1.0)
        top5_hits += int(((top5 * target).sum(1) == target.sum(1)).sum())
        count += int(y.shape[0])
        _emit(on_event, "eval_step", split=split, step=step + 1, steps=len(loader))
    seconds = time.perf_counter() - t0
    return EvalResult(
        split=split,
        dataset=getattr(ds, "name", "?"),
        count=count,
        loss=loss_sum / max(count, 1),
        accuracy=correct / max(count, 1),
        top5=top5_hits / max(count, 1),
        per_class=(hits.double() / seen.clamp(min=1).double()).tolist(),
        confusion=[],
        classes=list(classes),
        images_per_s=count / max(seconds, 1e-9),
        seconds=seconds,
        metric="top-2 exact match (DiverseMultiMNIST)",
        loss_name=loss_name,
    )


def evaluate_checkpoint(
    path: str | Path,
    *,
    data_dir: str | None = None,
    split: str = "test",
    batch_size: int | None = None,
    device: str = "auto",
    test_file: str | None = None,
    on_event: EventFn = None,
) -> tuple[EvalResult, dict[str, Any]]:
    """Rebuild the model and its data from a checkpoint alone and evaluate one split."""
    from capsctl.checkpoint import load_checkpoint

    if split not in ("val", "test"):
        raise UsageError(f"--split {split}: expected val or test")
    dev = resolve_device(device)
    model, meta = load_checkpoint(path, device=dev)
    preset = stored_preset(meta, Path(path))
    if data_dir is not None:
        preset.data.data_dir = data_dir
    if test_file is not None:
        preset.data.test_file = test_file
    if split == "val" and preset.data.val_size == 0:
        raise UsageError(
            f"{path}: this run had no validation split (data.val_size = 0); use --split test"
        )
    data = prepare_data(preset, on_event)
    stored = meta.get("dataset_fingerprint")
    if stored and stored != data.fingerprint:
        _emit(
            on_event,
            "warning",
            message=(
                f"the training data differs from the data {Path(path).name} was trained on "
                f"(fingerprint {data.fingerprint} != {stored}); the validation split may overlap "
                "training"
            ),
        )
    ds = data.val if split == "val" else data.test
    result = evaluate(
        model,
        ds,
        batch_size=batch_size or preset.train.eval_batch_size,
        device=dev,
        mean=data.mean,
        std=data.std,
        classes=data.classes,
        split=split,
        loss=eval_loss(preset, ds.labels.dim() == 2, len(data.classes)),
        on_event=on_event,
    )
    return result, meta


# ---------------------------------------------------------------------------------------------
# Training pieces


def make_optimizer(model: nn.Module, preset: Preset) -> torch.optim.Optimizer:
    t = preset.train
    params = [p for p in model.parameters() if p.requires_grad]
    if t.optimizer == "sgd":
        return torch.optim.SGD(
            params,
            lr=t.lr,
            momentum=t.momentum,
            nesterov=t.nesterov and t.momentum > 0,
            weight_decay=t.weight_decay,
        )
    return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)


def lr_factor(preset: Preset, step: int, steps_per_epoch: int) -> float:
    """Multiplier of the base LR at global optimizer step ``step`` (0-based).

    Linear warmup over ``warmup_epochs``, then: ``multistep`` (x gamma at each milestone epoch),
    ``cosine`` (to 0 at the end), ``onecycle`` (warmup from lr/25 over 30% of training unless
    ``warmup_epochs`` is set, then cosine down to lr/1e4), ``constant``.
    """
    t = preset.train
    total = max(1, t.epochs * steps_per_epoch)
    epoch = step / steps_per_epoch
    if t.schedule == "onecycle":
        warm = t.warmup_epochs * steps_per_epoch if t.warmup_epochs > 0 else 0.3 * total
        if step < warm:
            return 1 / 25 + (1 - 1 / 25) * step / warm
        frac = (step - warm) / max(1.0, total - warm)
        return 1e-4 + (1 - 1e-4) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    warm = t.warmup_epochs * steps_per_epoch
    if step < warm:
        return (step + 1) / warm
    if t.schedule == "multistep":
        return t.gamma ** sum(1 for m in t.milestones if epoch >= m)
    if t.schedule == "cosine":
        frac = (step - warm) / max(1.0, total - warm)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return 1.0


class EMA:
    """Exponential moving average of the parameters and buffers (used for evaluation)."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for k, v in model.state_dict().items():
            s = self.shadow[k]
            if v.dtype.is_floating_point:
                s.lerp_(v, 1 - self.decay)
            else:
                s.copy_(v)

    def state_dict(self) -> dict[str, Tensor]:
        return self.shadow

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        for k, v in state.items():
            self.shadow[k].copy_(v)


def _autocast(device: torch.device, amp: bool) -> contextlib.AbstractContextManager[Any]:
    if not amp:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def seed_everything(seed: int, deterministic: bool) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


@contextlib.contextmanager
def _sigint_as_flag() -> Iterator[dict[str, bool]]:
    """Turn Ctrl-C into a flag checked between steps, so a checkpoint can be written cleanly.

    A second Ctrl-C interrupts at once.
    """
    flag = {"stop": False}
    try:
        previous = signal.getsignal(signal.SIGINT)
    except ValueError:  # not the main thread
        yield flag
        return

    def handler(signum: int, frame: Any) -> None:
        if flag["stop"]:
            raise KeyboardInterrupt
        flag["stop"] = True

    try:
        signal.signal(signal.SIGINT, handler)
    except ValueError:
        yield flag
        return
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


# ---------------------------------------------------------------------------------------------
# fit


@dataclass
class FitResult:
    out_dir: Path
    epochs_done: int
    best_epoch: int | None
    best_val_accuracy: float | None
    test: EvalResult | None
    interrupted: bool
    seconds: float
    history: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "out_dir": str(self.out_dir),
            "epochs_done": self.epochs_done,
            "best_epoch": self.best_epoch,
            "best_val_accuracy": self.best_val_accuracy,
            "test": self.test.to_dict() if self.test else None,
            "interrupted": self.interrupted,
            "seconds": self.seconds,
            "history": self.history,
        }


class Interrupted(CapsctlError):
    """Training stopped on Ctrl-C after saving a resumable checkpoint."""

    exit_code = 130


def _check_out_dir(out: Path, resume: bool, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a folder; choose another path")
    holds_run = out.is_dir() and any((out / f).exists() for f in (LAST, BEST, METRICS))
    if holds_run and not (resume or overwrite):
        raise UsageError(
            f"--out {out}: already holds a run; pass --resume {out / LAST} to continue it, "
            "--overwrite to replace it, or choose another --out"
        )
    if holds_run and overwrite and not resume:
        old_files = [out / f for f in (LAST, BEST, METRICS, RESOLVED_PRESET, RESULTS, CURVES)]
        for f in old_files + sorted(out.glob("events.out.tfevents.*")):
            with contextlib.suppress(FileNotFoundError):
                f.unlink()


def _truncate_metrics(path: Path, epochs_done: int) -> list[dict[str, Any]]:
    """Keep the metrics lines of the epochs a resumed run already has (drop later ones)."""
    if not path.exists():
        return []
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if isinstance(rec, dict) and rec.get("epoch", 10**9) <= epochs_done:
            kept.append(rec)
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
    return kept


def load_resume_preset(path: str | Path) -> Preset:
    """The preset stored in a checkpoint (for ``--resume``)."""
    return stored_preset(read_metadata(path), Path(path))


# Fields a resumed run may change: how long it runs, where and how fast it computes, what it
# logs and which files hold the data. Everything else shapes the data split, the order of the
# batches, the optimizer's trajectory or the model, and is refused on resume.
RESUME_MAY_CHANGE = (
    "name",
    "description",
    "train.epochs",
    "train.time_limit",
    "train.device",
    "train.eval_batch_size",
    "train.amp",
    "train.compile",
    "train.channels_last",
    "train.deterministic",
    "train.ema_decay",
    "data.data_dir",
    "data.download",
    "data.test_file",
    "log.",
)

_RESUME_REFUSED_WHY = (
    (
        "train.seed",
        "it drew the validation split and the batch order; a new seed would put "
        "trained images into validation",
    ),
    ("train.batch_size", "the step-based LR schedule and the mid-epoch position depend on it"),
    ("train.steps_per_epoch", "the step-based LR schedule and the mid-epoch position depend on it"),
    ("data.", "the training and validation images depend on it"),
    ("model.", "the checkpoint's weights belong to the stored model"),
    ("train.", "the run's optimizer state and LR schedule depend on it"),
)


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    flat: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            flat.update(_flatten(v, key))
        else:
            flat[key] = v
    return flat


def resume_changes(stored: Preset, new: Preset) -> list[dict[str, Any]]:
    """The fields ``new`` changes in a run stored with ``stored``, as ``{field, old, new}``.

    Raises :class:`UsageError` naming the first field that may not change on resume and why
    (see :data:`RESUME_MAY_CHANGE`).
    """
    old_flat = _flatten(preset_to_dict(stored))
    new_flat = _flatten(preset_to_dict(new))
    changes = []
    for key in sorted(set(old_flat) | set(new_flat)):
        a, b = old_flat.get(key), new_flat.get(key)
        if a == b:
            continue
        if any(key == f or (f.endswith(".") and key.startswith(f)) for f in RESUME_MAY_CHANGE):
            changes.append({"field": key, "old": a, "new": b})
            continue
        why = next(
            (w for prefix, w in _RESUME_REFUSED_WHY if key.startswith(prefix)),
            "it is part of the run's recipe",
        )
        raise UsageError(
            f"{key}: cannot change on resume ({a!r} -> {b!r}): {why}; drop the override or "
            "start a new run"
        )
    return changes


def fit(
    preset: Preset,
    out_dir: str | Path,
    *,
    resume: str | Path | None = None,
    overwrite: bool = False,
    on_event: EventFn = None,
    handle_sigint: bool = True,
) -> FitResult:
    """Train ``preset`` into ``out_dir``; resume from a ``last.safetensors`` if given.

    Started by ``torchrun`` (``WORLD_SIZE`` > 1) it trains with DistributedDataParallel:
    ``train.batch_size`` is then the global batch, split evenly over the processes.
    """
    t_start = time.perf_counter()
    out = Path(out_dir)
    t = preset.train
    device = resolve_device(t.device)
    dist = Distributed.from_env(device)
    try:
        return _fit(
            preset,
            out,
            t,
            dist,
            dist.device,
            resume,
            overwrite,
            on_event if dist.is_main else None,
            handle_sigint,
            t_start,
        )
    finally:
        dist.close()


def _fit(
    preset: Preset,
    out: Path,
    t: Any,
    dist: Distributed,
    device: torch.device,
    resume: str | Path | None,
    overwrite: bool,
    on_event: EventFn,
    handle_sigint: bool,
    t_start: float,
) -> FitResult:
    from capsctl.data import Loader
    from capsctl.models import build_model_from_config, parameter_counts

    if dist.is_main:
        _check_out_dir(out, resume is not None, overwrite)
    if t.batch_size % dist.world_size:
        raise ConfigError(
            f"train.batch_size: {t.batch_size} is the global batch and must be divisible by the "
            f"{dist.world_size} processes"
        )
    changes: list[dict[str, Any]] = []
    if resume is not None:  # refuse a changed recipe before any work
        meta = read_metadata(resume)
        changes = resume_changes(stored_preset(meta, Path(resume)), preset)
    seed_everything(t.seed, t.deterministic)
    data = prepare_data(preset, on_event)
    _emit(
        on_event,
        "data",
        train=len(data.train),
        val=len(data.val) if data.val is not None else 0,
        test=len(data.test),
        test_name=data.test_name,
        classes=len(data.classes),
    )

    model = build_model_from_config(preset.model)
    if t.sync_bn and dist.world_size > 1:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    if t.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = make_optimizer(model, preset)
    aug = preset.data.augment
    train_loader = Loader(
        data.train,
        t.batch_size // dist.world_size,
        rank=dist.rank,
        world_size=dist.world_size,
        shuffle=True,
        seed=t.seed,
        device=device,
        mean=data.mean,
        std=data.std,
        crop_padding=aug.crop_padding,
        hflip=aug.hflip,
        drop_last=True,
    )
    steps_per_epoch = len(train_loader)
    if steps_per_epoch == 0:
        raise ConfigError(
            f"train.batch_size: {t.batch_size} is larger than the training set ({len(data.train)})"
        )
    if t.steps_per_epoch is not None:
        steps_per_epoch = min(steps_per_epoch, t.steps_per_epoch)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(preset, step, steps_per_epoch)
    )
    ema = EMA(model, t.ema_decay) if t.ema_decay else None
    loss_fn = make_loss(preset, data.train.labels.dim() == 2, len(data.classes))
    own_loss = eval_loss(preset, data.train.labels.dim() == 2, len(data.classes))
    total_steps = max(1, t.epochs * steps_per_epoch)
    step_fn: nn.Module = dist.wrap(model)
    if t.compile:
        step_fn = torch.compile(step_fn)  # type: ignore[assignment]

    start_epoch, best_acc, best_epoch = 0, -1.0, None
    partial: dict[str, Any] | None = None
    history: list[dict[str, Any]] = []
    if resume is not None:
        tensors = load_tensors(resume)
        state = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
        try:
            model.load_state_dict(state)
        except RuntimeError as e:
            raise CheckpointError(
                f"{resume}: its weights do not fit the preset's model ({str(e)[:120]})"
            ) from None
        opt_state, sched_state, ema_state, rng = unpack_training_state(tensors, meta)
        optimizer.load_state_dict(opt_state)
        if sched_state is not None:
            scheduler.load_state_dict(sched_state)
        if ema is not None:
            # EMA switched on at resume starts from the resumed weights, not the initial ones.
            ema = EMA(model, ema.decay)
            if ema_state is not None:
                ema.load_state_dict(ema_state)
        restore_rng_state(rng)
        start_epoch = int(meta.get("epoch", 0))
        partial = meta.get("partial")
        best = meta.get("best") or {}
        # No best epoch yet (Ctrl-C before the first validation) or no validation split: null.
        stored_acc = best.get("val_accuracy")
        best_acc = float(stored_acc) if stored_acc is not None else -1.0
        best_epoch = best.get("epoch")
        if dist.is_main:
            history = _truncate_metrics(out / METRICS, start_epoch)
        _emit(on_event, "resume", path=str(resume), epoch=start_epoch, changes=changes)

    if dist.is_main:
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out / RESOLVED_PRESET, dump_yaml(preset))
    base_meta = {
        "preset": preset_to_dict(preset),
        "classes": data.classes,
        "normalization": {"name": preset.data.normalization, "mean": data.mean, "std": data.std},
        "input_size": preset.model.input_size,
        "in_channels": preset.model.in_channels,
        "dataset": preset.data.dataset,
        "dataset_fingerprint": data.fingerprint,
        "params": parameter_counts(model),
        "capsctl_version": __version__,
        "torch_version": torch.__version__,
    }

    def eval_model() -> nn.Module:
        if ema is None:
            return model
        shadow = copy.deepcopy(model)
        shadow.load_state_dict(ema.state_dict())
        return shadow

    def save_last(epoch: int, metrics: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
        if not dist.is_main:
            return
        st, sm = pack_training_state(
            optimizer.state_dict(),
            _sched_state(scheduler),
            ema.state_dict() if ema else None,
            capture_rng_state(),
        )
        meta = {
            **base_meta,
            "epoch": epoch,
            "metrics": metrics,
            "kind": "last",
            "best": {"epoch": best_epoch, "val_accuracy": best_acc if best_acc >= 0 else None},
            **sm,
        }
        if extra:
            meta.update(extra)
        save_checkpoint(out / LAST, {**model_tensors(model), **st}, meta)
        _emit(on_event, "checkpoint", path=str(out / LAST), epoch=epoch)

    def _end_epoch(record: dict[str, Any]) -> tuple[float, int | None]:
        """Validation, best/last checkpoints and the metrics line (main process only)."""
        nonlocal best_acc, best_epoch
        if data.val is not None:
            ev = evaluate(
                eval_model(),
                data.val,
                batch_size=t.eval_batch_size,
                device=device,
                mean=data.mean,
                std=data.std,
                classes=data.classes,
                split="val",
                amp=t.amp,
                loss=own_loss,
            )
            record.update(val_loss=ev.loss, val_accuracy=ev.accuracy, val_top5=ev.top5)
            improved = ev.accuracy > best_acc
        else:
            improved = True
        if improved:
            best_acc = record.get("val_accuracy", -1.0) if data.val is not None else -1.0
            best_epoch = int(record["epoch"])
            save_checkpoint(
                out / BEST,
                model_tensors(eval_model()),
                {**base_meta, "epoch": record["epoch"], "metrics": record, "kind": "best"},
            )
        record["best"] = improved
        history.append(record)
        if tensorboard is not None:
            tensorboard.log_epoch(record)
        write_text_atomic(out / METRICS, "".join(json.dumps(r) + "\n" for r in history))
        save_last(int(record["epoch"]), record)
        _emit(on_event, "epoch_end", **record, epochs=t.epochs)
        return best_acc, best_epoch

    tensorboard = None
    if dist.is_main and preset.log.tensorboard:
        from capsctl.curves import TensorBoardLogger

        tensorboard = TensorBoardLogger(out, resume_epoch=start_epoch)
    interrupted = False
    epoch = start_epoch
    ctx = _sigint_as_flag() if handle_sigint else contextlib.nullcontext({"stop": False})
    with ctx as flag, tensorboard or contextlib.nullcontext():
        for epoch in range(start_epoch, t.epochs):
            model.train()
            train_loader.set_epoch(epoch)
            _emit(on_event, "epoch_start", epoch=epoch + 1, epochs=t.epochs, steps=steps_per_epoch)
            t0 = time.perf_counter()
            loss_sum = torch.zeros((), device=device)
            correct = torch.zeros((), device=device, dtype=torch.int64)
            seen, skip = 0, 0
            if epoch == start_epoch and partial:
                skip = int(partial["step"])
                loss_sum += float(partial["loss_sum"])
                correct += int(partial["correct"])
                seen = int(partial["seen"])
            stopped_at = None
            for step, (x, y) in enumerate(train_loader):
                if step >= steps_per_epoch:
                    break
                if step < skip:
                    continue  # done before the interruption; the loader's order is f(seed, epoch)
                if t.channels_last:
                    x = x.contiguous(memory_format=torch.channels_last)
                with _autocast(device, t.amp):
                    logits = step_fn(x)
                    loss = loss_fn(
                        logits.float(), y, (epoch * steps_per_epoch + step) / total_steps
                    )
                # with several processes, every rank learns of a bad loss or a Ctrl-C at once
                bad, stop = dist.any_flags(not bool(torch.isfinite(loss)), flag["stop"])
                flag["stop"] = stop
                if bad:
                    where = f"epoch {epoch + 1}, step {step + 1}"
                    kept = (
                        f"the last good checkpoint ({out / LAST}) is kept"
                        if (out / LAST).exists()
                        else "no checkpoint was written yet"
                    )
                    raise CapsctlError(
                        f"loss became {float(loss.detach())} at {where}; {kept}. "
                        "Lower train.lr or set "
                        "train.grad_clip"
                    )
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if t.grad_clip is not None:
                    nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
                optimizer.step()
                scheduler.step()
                if ema is not None:
                    ema.update(model)
                loss_sum += loss.detach() * y.numel()
                correct += count_correct(logits.detach(), y)
                seen += int(y.numel())
                if on_event is not None:
                    el = time.perf_counter() - t0
                    on_event(
                        {
                            "event": "step",
                            "epoch": epoch + 1,
                            "epochs": t.epochs,
                            "step": step + 1,
                            "steps": steps_per_epoch,
                            "loss": float(loss.detach()),
                            "lr": optimizer.param_groups[0]["lr"],
                            "images_per_s": (
                                seen - (partial or {}).get("seen", 0) * (epoch == start_epoch)
                            )
                            / max(el, 1e-9),
                        }
                    )
                if flag["stop"]:
                    stopped_at = step + 1
                    break
            if stopped_at is not None:
                # Save mid-epoch: resume skips the batches already done and continues exactly.
                save_last(
                    epoch,
                    history[-1] if history else {},
                    {
                        "partial": {
                            "step": stopped_at,
                            "loss_sum": float(loss_sum),
                            "correct": int(correct),
                            "seen": seen,
                        }
                    },
                )
                interrupted = True
                break
            train_time = time.perf_counter() - t0
            loss_sum, correct, seen = dist.sum_stats(loss_sum, correct, seen)
            record: dict[str, Any] = {
                "epoch": epoch + 1,
                "train_loss": float(loss_sum) / max(seen, 1),
                "train_accuracy": float(correct) / max(seen, 1),
                "lr": optimizer.param_groups[0]["lr"],
                "epoch_seconds": train_time,
                "images_per_s": seen / max(train_time, 1e-9),
            }
            if dist.is_main:
                best_acc, best_epoch = _end_epoch(record)
            else:
                history.append(record)
            dist.barrier()
            over_time = t.time_limit is not None and time.perf_counter() - t_start > t.time_limit
            if dist.any_flags(over_time)[0]:
                _emit(on_event, "time_limit", epoch=epoch + 1)
                break

    epochs_done = history[-1]["epoch"] if history else start_epoch
    if interrupted:
        raise Interrupted(
            f"interrupted during epoch {epoch + 1}; the run is saved, resume with "
            f"capsctl train --resume {out / LAST}"
        )

    test_result = None
    if dist.is_main and (out / BEST).exists():
        from capsctl.checkpoint import load_checkpoint

        best_model, best_meta = load_checkpoint(out / BEST, device=device)
        test_result = evaluate(
            best_model,
            data.test,
            batch_size=t.eval_batch_size,
            device=device,
            mean=data.mean,
            std=data.std,
            classes=data.classes,
            split="test",
            amp=t.amp,
            loss=own_loss,
        )
        best_meta["test"] = {
            k: v for k, v in test_result.to_dict().items() if k not in ("confusion",)
        }
        best_meta["test_name"] = data.test_name
        save_checkpoint(out / BEST, model_tensors(best_model), best_meta)
        _emit(
            on_event, "test", **{k: v for k, v in test_result.to_dict().items() if k != "confusion"}
        )
    result = FitResult(
        out,
        epochs_done,
        best_epoch,
        best_acc if best_acc >= 0 else None,
        test_result,
        False,
        time.perf_counter() - t_start,
        history,
    )
    if dist.is_main:
        write_text_atomic(out / RESULTS, json.dumps(result.to_dict(), indent=2))
        if preset.log.curves:
            _draw_curves(out, on_event)
    return result


def _draw_curves(out: Path, on_event: EventFn) -> None:
    """``curves.png`` in the run folder when matplotlib is present; a drawing problem is a
    warning, never a failed run."""
    from capsctl.curves import write_run_curves

    try:
        path = write_run_curves(out)
    except CapsctlError as e:
        _emit(on_event, "warning", message=f"curves.png not written: {e}")
        return
    if path is not None:
        _emit(on_event, "curves", path=str(path))


def _sched_state(scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
    # LambdaLR stores ``lr_lambdas`` as [None] for plain functions: the state is JSON-able.
    return scheduler.state_dict()


# ---------------------------------------------------------------------------------------------
# Several processes (torchrun)


@dataclass
class Distributed:
    """Process-group facts for a run started by ``torchrun`` (one process: a no-op).

    ``torchrun --nproc_per_node=N -m capsctl train ...`` sets ``RANK``, ``WORLD_SIZE`` and
    ``LOCAL_RANK``; each process then trains on its slice of every global batch with
    DistributedDataParallel (gloo on CPU, NCCL on CUDA) and only rank 0 writes files and logs.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    initialized_here: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device: torch.device) -> Distributed:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls(device=device)
        import torch.distributed as tdist

        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device.type == "cuda":
            device = torch.device("cuda", local)
            torch.cuda.set_device(device)
        here = False
        if not tdist.is_initialized():
            tdist.init_process_group("nccl" if device.type == "cuda" else "gloo")
            here = True
        return cls(rank, world, local, device, here)

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.world_size == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.local_rank] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def any_flags(self, *flags: bool) -> tuple[bool, ...]:
        """Logical OR of each flag over all processes."""
        if self.world_size == 1:
            return tuple(bool(f) for f in flags)
        import torch.distributed as tdist

        t = torch.tensor([float(f) for f in flags], device=self.device)
        tdist.all_reduce(t)
        return tuple(bool(v > 0) for v in t.tolist())

    def sum_stats(self, loss_sum: Tensor, correct: Tensor, seen: int) -> tuple[Tensor, Tensor, int]:
        if self.world_size == 1:
            return loss_sum, correct, seen
        import torch.distributed as tdist

        t = torch.stack(
            [
                loss_sum.double(),
                correct.double(),
                torch.tensor(float(seen), device=self.device, dtype=torch.float64),
            ]
        )
        tdist.all_reduce(t)
        return t[0], t[1].round().long(), int(t[2].item())

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as tdist

            tdist.barrier()

    def close(self) -> None:
        if self.initialized_here:
            import torch.distributed as tdist

            tdist.destroy_process_group()
