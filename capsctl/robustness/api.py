"""``capsctl robustness``: adversarial, shifted and corrupted test sets for any checkpoint.

:func:`robustness_checkpoint` rebuilds a checkpoint's model and test split from its metadata
alone (a file or a model folder), takes the first ``limit`` test images and scores:

- white-box FGSM/PGD (:mod:`capsctl.robustness.attacks`) at each eps, with the model's own
  loss (or Carlini and Wagner's margin, ``loss="cw"``, a check for gradient masking); robust
  accuracy over all images, and the attack success rate over the images the model classifies
  correctly before the attack (SR-CapsNet's definition, Hahn et al. 2019):
  untargeted, the share of them misclassified after it; targeted to ``(y + 1) mod classes``,
  the share of them classified as the target;
- rotation / translation sweeps or the affNIST-style set (:mod:`capsctl.robustness.shifts`);
- the 15 x 5 CIFAR-10-C corruptions (:mod:`capsctl.robustness.corruptions`).

Every image the model sees goes through :class:`~capsctl.robustness.attacks.PixelModel`, the
function scored in ``capsctl eval`` (normalization, and flip averaging where the checkpoint
evaluates with it). :func:`robustness_summary` is the short form for suite reports.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from capsctl.checkpoint import load_checkpoint, resolve_checkpoint, stored_preset
from capsctl.data.dataset import ArrayDataset
from capsctl.devices import resolve_device
from capsctl.errors import CapsctlError, DataError, UsageError
from capsctl.events import EventFn, emit
from capsctl.losses import eval_loss, top2_correct
from capsctl.numbers import Range, check_numbers
from capsctl.robustness.attacks import (
    ATTACK_LOSSES,
    ATTACKS,
    PixelModel,
    cw_margin,
    pgd_step_size,
    run_attack,
)
from capsctl.robustness.results import (
    AttackPoint,
    CorruptionRow,
    RobustnessResult,
    ShiftPoint,
)
from capsctl.robustness.shifts import DEFAULT_MAGNITUDES, MAX_MAGNITUDES, SHIFTS
from capsctl.robustness.store import PointStore, fingerprint

__all__ = [
    "DEFAULT_EPS",
    "AttackPoint",
    "CorruptionRow",
    "RobustnessResult",
    "ShiftPoint",
    "robustness_checkpoint",
    "robustness_summary",
]

DEFAULT_EPS = (1 / 255, 2 / 255, 4 / 255, 8 / 255)


@dataclass
class _Setup:
    model: PixelModel
    test: ArrayDataset
    preset: Any
    device: torch.device
    batch_size: int
    loss_name: str
    loss_fn: Any
    data_dir: str | None


def _load(
    path: str | Path,
    data_dir: str | None,
    device: str,
    limit: int | None,
    batch: int | None,
    loss: str = "own",
) -> _Setup:
    from capsctl.data.prepare import prepare_data

    dev = resolve_device(device)
    model, meta = load_checkpoint(path, device=dev)
    preset = stored_preset(meta, Path(path))
    if data_dir is not None:
        preset.data.data_dir = data_dir
    preset.data.download = False
    try:
        data = prepare_data(preset, None, need_train=False)
    except DataError as e:
        raise DataError(f"{path}: cannot load its test data ({e})") from None
    test = data.test
    if limit is not None:
        test = test.subset(torch.arange(min(limit, len(test))))
    multi = test.labels.dim() == 2
    loss_name, loss_fn = eval_loss(preset, multi, len(data.classes))
    if loss == "cw":
        if multi:
            raise UsageError(
                f"{path}: --loss cw needs one label per image (this data is multi-label)"
            )
        loss_name, loss_fn = "cw_margin", cw_margin
    pixel = PixelModel(model, data.mean, data.std, flip=preset.data.augment.test_flip).to(dev)
    pixel.eval()
    size = batch or preset.train.eval_batch_size
    return _Setup(pixel, test, preset, dev, size, loss_name, loss_fn, data_dir)


def _hits(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Bool ``[b]``: top-1 hits, or the top-2 metric for multi-label data."""
    return top2_correct(logits, y) if y.dim() == 2 else logits.argmax(1) == y


def _batches(s: _Setup, ds: ArrayDataset) -> Any:
    for start in range(0, len(ds), s.batch_size):
        end = min(start + s.batch_size, len(ds))
        x = ds.images[start:end].to(s.device).float() / 255.0  # [b, C, H, W] in [0, 1]
        yield x, ds.labels[start:end].to(s.device)


@torch.no_grad()
def _accuracy(s: _Setup, ds: ArrayDataset, name: str, on_event: EventFn) -> float:
    hits, steps = 0, math.ceil(len(ds) / s.batch_size)
    for step, (x, y) in enumerate(_batches(s, ds)):
        hits += int(_hits(s.model(x), y).sum())
        emit(on_event, "progress", task="robustness", name=name, step=step + 1, steps=steps)
    return hits / max(len(ds), 1)


def _attack_point(
    s: _Setup, attack: str, eps: float, targeted: bool, steps: int, seed: int, on_event: EventFn
) -> AttackPoint:
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(int(seed))
    classes = s.preset.model.num_classes
    right = before = success = 0
    total = math.ceil(len(s.test) / s.batch_size)
    for step, (x, y) in enumerate(_batches(s, s.test)):
        with torch.no_grad():
            clean = _hits(s.model(x), y)  # [b]
        goal = (y + 1) % classes if targeted else y
        adv = run_attack(
            attack, s.model, x, goal, eps, s.loss_fn, steps=steps, targeted=targeted, generator=gen
        )
        with torch.no_grad():
            logits = s.model(adv)  # [b, classes]
        now = _hits(logits, y)
        hit = (logits.argmax(1) == goal) if targeted else ~now
        right += int(now.sum())
        before += int(clean.sum())
        success += int((clean & hit).sum())
        emit(
            on_event, "progress", task="robustness", name=f"{attack} {eps * 255:g}/255",
            step=step + 1, steps=total,
        )  # fmt: skip
    rate = success / before if before else None
    return AttackPoint(
        attack, eps, targeted, right / max(len(s.test), 1), rate, before, len(s.test),
        time.perf_counter() - t0,
    )  # fmt: skip


def _shift_points(
    s: _Setup, kind: str, magnitudes: Sequence[float], seed: int, on_event: EventFn, keep: _Keep
) -> list[ShiftPoint]:
    from capsctl.robustness.shifts import affnist_set, shifted_set

    digits = _affine_digits(s) if kind == "affine" else s.test

    def one(m: float) -> ShiftPoint:
        t0 = time.perf_counter()
        if kind == "affine":
            ds = affnist_set(digits, seed, m)
        else:
            ds = shifted_set(digits, kind, m, seed)
        accuracy = _accuracy(s, ds, f"{kind} {m:g}", on_event)
        return ShiftPoint(kind, m, accuracy, len(ds), time.perf_counter() - t0)

    return [
        keep({"shift": kind, "magnitude": m}, ShiftPoint, lambda m=m: one(m)) for m in magnitudes
    ]


def _affine_digits(s: _Setup) -> ArrayDataset:
    """The 28x28 test digits an affNIST-style set is made of, for a 40x40 digit model."""
    from capsctl.data import load_dataset

    d, m = s.preset.data, s.preset.model
    if d.dataset != "expanded-mnist" or m.input_size != 40 or m.in_channels != 1:
        raise UsageError(
            f"--shift affine needs a model with 40x40 gray input trained on expanded-mnist "
            f"(this one: {d.dataset}, {m.input_size}x{m.input_size}); use --shift rotate or "
            "translate, or train expanded-mnist-caps / expanded-mnist-cnn"
        )
    try:
        digits = load_dataset("mnist", "test", d.data_dir, download=False)
    except DataError as e:
        raise DataError(f"--shift affine: cannot load the MNIST test digits ({e})") from None
    return digits.subset(torch.arange(len(s.test)))


def _corruption_rows(s: _Setup, seed: int, on_event: EventFn, keep: _Keep) -> list[CorruptionRow]:
    try:
        from capsctl.robustness.corruptions import CORRUPTIONS, SUBSTITUTES, corrupt_images
    except ImportError as e:
        raise CapsctlError(
            f"--corruptions needs scipy ({e}); pip install 'capsctl[robustness]'"
        ) from None
    images = s.test.images.numpy()

    def one(name: str) -> CorruptionRow:
        t0, accs = time.perf_counter(), []
        for severity in range(1, 6):
            bad = torch.from_numpy(corrupt_images(images, name, severity, seed))
            ds = ArrayDataset(bad, s.test.labels, list(s.test.classes), name)
            accs.append(_accuracy(s, ds, f"{name} {severity}", on_event))
        star = name in SUBSTITUTES
        label = name + ("*" if star else "")
        return CorruptionRow(label, accs, sum(accs) / 5, star, time.perf_counter() - t0)

    return [keep({"corruption": n}, CorruptionRow, lambda n=n: one(n)) for n in CORRUPTIONS]


#: ``keep(setting, kind, measure)``: a setting's point, from the store or measured (and kept).
_Keep = Callable[[dict[str, Any], Any, Callable[[], Any]], Any]


def _keeper(store: PointStore | None, path: str | Path, s: _Setup, seed: int) -> _Keep:
    """The ``keep`` of one checkpoint: every setting is qualified by what else changes its
    numbers (the test set and its size, the batches PGD's random starts are drawn in, the device,
    the seed, flip averaging)."""
    if store is None:
        return lambda setting, kind, measure: measure()
    checkpoint = fingerprint(path)
    common = {
        "dataset": s.test.name,
        "count": len(s.test),
        "batch_size": s.batch_size,
        "seed": seed,
        "device": s.device.type,
        "flip": s.model.flip,
    }

    def keep(setting: dict[str, Any], kind: Any, measure: Callable[[], Any]) -> Any:
        full = setting | common
        found = store.point(kind, checkpoint, full)
        if found is not None:
            return found
        point = measure()
        store.put(checkpoint, full, point.to_dict())
        return point

    return keep


def _check_options(attacks: Sequence[str], eps: Sequence[float], steps: int, shift: str | None,
                   limit: int | None, batch_size: int | None, loss: str) -> None:  # fmt: skip
    bad = [a for a in attacks if a not in ATTACKS]
    if bad:
        raise UsageError(f"--attack {','.join(bad)}: choose from {', '.join(ATTACKS)}")
    if loss not in ATTACK_LOSSES:
        raise UsageError(f"--loss {loss}: choose from {', '.join(ATTACK_LOSSES)}")
    check_numbers("--eps", eps, Range(0, 1), "numbers", " (pixels are in [0, 1])")
    if steps < 1:
        raise UsageError(f"--steps {steps}: must be >= 1")
    if shift is not None and shift not in SHIFTS:
        raise UsageError(f"--shift {shift}: choose from {', '.join(SHIFTS)}")
    if limit is not None and limit < 1:
        raise UsageError(f"--limit {limit}: must be >= 1")
    if batch_size is not None and batch_size < 1:
        raise UsageError(f"--batch-size {batch_size}: must be >= 1")


def _check_magnitudes(shift: str | None, magnitudes: Sequence[float] | None) -> None:
    if magnitudes is None:
        return
    if shift is None:
        raise UsageError("--magnitudes needs --shift rotate, translate or affine")
    units = {"rotate": "degrees", "translate": "pixels", "affine": "shares of affNIST's ranges"}
    within = Range(0, MAX_MAGNITUDES[shift])
    check_numbers(
        "--magnitudes", magnitudes, within, "numbers", f" for --shift {shift} ({units[shift]})"
    )


def robustness_checkpoint(
    path: str | Path,
    *,
    attacks: Sequence[str] = ATTACKS,
    eps: Sequence[float] = DEFAULT_EPS,
    targeted: bool = False,
    steps: int = 10,
    shift: str | None = None,
    magnitudes: Sequence[float] | None = None,
    corruptions: bool = False,
    limit: int | None = None,
    batch_size: int | None = None,
    device: str = "auto",
    data_dir: str | None = None,
    seed: int = 0,
    loss: str = "own",
    on_event: EventFn = None,
    store: PointStore | None = None,
) -> RobustnessResult:
    """Score one checkpoint (see the module docstring); ``attacks=()`` skips the attacks;
    ``loss="cw"`` attacks Carlini and Wagner's margin instead of the model's own loss. With
    ``store``, each setting found there is taken from it and each one measured is kept in it
    (:mod:`capsctl.robustness.store`)."""
    _check_options(attacks, eps, steps, shift, limit, batch_size, loss)
    _check_magnitudes(shift, magnitudes)
    path = resolve_checkpoint(path)  # a run folder: its best.safetensors
    # a repeated setting is measured once, in the order first given
    attacks, eps = tuple(dict.fromkeys(attacks)), tuple(dict.fromkeys(eps))
    magnitudes = None if magnitudes is None else tuple(dict.fromkeys(magnitudes))
    t0 = time.perf_counter()
    s = _load(path, data_dir, device, limit, batch_size, loss)
    keep = _keeper(store, path, s, seed)
    if targeted and s.test.labels.dim() == 2:
        raise UsageError(f"{path}: --targeted needs one label per image (this data is multi-label)")
    m = s.preset.model
    result = RobustnessResult(
        checkpoint=str(path),
        dataset=s.test.name,
        model=m.arch if m.arch != "capsnet" else f"capsnet/{m.router['name']}",
        count=len(s.test),
        clean_accuracy=_accuracy(s, s.test, "clean", on_event),
        loss_name=s.loss_name,
        flip=s.model.flip,
        seed=seed,
        steps=steps,
        pgd_step=f"2.5 * eps / {steps} (Madry et al.)",
    )
    for attack in attacks:
        for e in eps:
            setting = {"attack": attack, "eps": e, "targeted": targeted, "steps": steps}
            setting["loss"] = s.loss_name
            point = keep(
                setting, AttackPoint,
                lambda a=attack, e=e: _attack_point(s, a, e, targeted, steps, seed, on_event),
            )  # fmt: skip
            result.attacks.append(point)
    if shift is not None:
        mags = DEFAULT_MAGNITUDES[shift] if magnitudes is None else tuple(magnitudes)
        result.shifts = _shift_points(s, shift, mags, seed, on_event, keep)
    if corruptions:
        result.corruptions = _corruption_rows(s, seed, on_event, keep)
        result.mean_corruption_accuracy = sum(r.mean for r in result.corruptions) / len(
            result.corruptions
        )
    result.seconds = time.perf_counter() - t0
    return result


def robustness_summary(
    ckpt_path: str | Path,
    *,
    limit: int | None = 1000,
    corruption_limit: int | None = 1000,
    steps: int = 10,
    device: str = "auto",
    data_dir: str | None = None,
    batch_size: int | None = None,
    seed: int = 0,
    on_event: EventFn = None,
) -> dict[str, Any]:
    """For suite reports: clean, FGSM and PGD accuracy at eps 8/255 on the first ``limit`` test
    images and the mean corruption accuracy on the first ``corruption_limit`` (None: skipped)."""
    attacked = robustness_checkpoint(
        ckpt_path, eps=(8 / 255,), steps=steps, limit=limit, device=device,
        data_dir=data_dir, batch_size=batch_size, seed=seed, on_event=on_event,
    )  # fmt: skip
    by_name = {p.attack: p.accuracy for p in attacked.attacks}
    summary: dict[str, Any] = {
        "checkpoint": str(ckpt_path),
        "count": attacked.count,
        "clean_accuracy": attacked.clean_accuracy,
        "fgsm_8_255_accuracy": by_name["fgsm"],
        "pgd_8_255_accuracy": by_name["pgd"],
        "pgd_steps": steps,
        "pgd_step_size": pgd_step_size(8 / 255, steps),
        "mean_corruption_accuracy": None,
    }
    if corruption_limit is not None:
        corrupted = robustness_checkpoint(
            ckpt_path, attacks=(), corruptions=True, limit=corruption_limit, device=device,
            data_dir=data_dir, batch_size=batch_size, seed=seed, on_event=on_event,
        )  # fmt: skip
        summary["mean_corruption_accuracy"] = corrupted.mean_corruption_accuracy
    return summary
