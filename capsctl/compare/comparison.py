"""``compare``: parameters, FLOPs, accuracy and optionally speed of several models, side by side.

:func:`compare` takes registered model names, preset names, aliases (``caps``, ``resnet18``),
``.yaml`` preset files, ``.safetensors`` checkpoints and model folders
(:func:`capsctl.compare.targets.find_target`) and returns a
:class:`~capsctl.compare.report.CompareReport`. Speed columns come from
:func:`capsctl.bench.run_bench`; test accuracy from the checkpoint's metadata or, with
``evaluate=True``, from :func:`capsctl.evaluation.evaluate_checkpoint`. Nothing is printed:
progress goes to an optional ``on_event`` callback (:mod:`capsctl.events`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from capsctl.compare.flops import count_flops
from capsctl.compare.measured import is_suite_folder, suite_member_targets
from capsctl.compare.published import reference_accuracy
from capsctl.compare.report import CompareReport, CompareRow, reference_ratios
from capsctl.compare.targets import Target, find_target, stored_accuracy
from capsctl.errors import ConfigError, UsageError
from capsctl.events import EventFn, emit
from capsctl.models import build_model_from_config, parameter_counts
from capsctl.models.spec import ModelConfig

__all__ = ["compare"]


def compare(
    specs: Sequence[str],
    *,
    speed: bool = False,
    batch_size: int = 32,
    iters: int = 3,
    device: str = "cpu",
    evaluate: bool = False,
    data_dir: str | None = None,
    on_event: EventFn = None,
    suite_names: Sequence[str] = (),
) -> CompareReport:
    """Compare the given targets (see :func:`~capsctl.compare.targets.find_target`); one row
    per target, in order.

    Always: parameters (:func:`capsctl.models.parameter_counts`), GFLOPs per image
    (:func:`~capsctl.compare.flops.count_flops`, on the CPU), routing, the checkpoint's stored
    accuracy (test if the checkpoint has it, else validation) and the published reference
    accuracy. ``speed=True`` adds :func:`capsctl.bench.run_bench` measurements
    (``batch_size``, ``iters`` timed steps, ``device``). ``evaluate=True`` recomputes
    checkpoint rows' accuracy on the test split with
    :func:`capsctl.evaluation.evaluate_checkpoint` (``data_dir``, ``device``). With a
    ResNet-18 row, every other row gets its ratios to it (``report.ratios``).

    Events: ``{"event": "compare_model", "name", "step", "steps"}`` before each target
    (``step`` counts from 1), plus the events of ``run_bench`` and ``evaluate_checkpoint``.

    A spec in ``suite_names`` (a ``capsctl suite`` name or file) or a folder written by
    ``capsctl suite run`` stands for the suite's members, each row with its ``measured``
    accuracy (:mod:`capsctl.compare.measured`).
    """
    if isinstance(specs, str):
        specs = [specs]
    if not specs:
        raise UsageError("nothing to compare; pass at least one model, preset or checkpoint")
    if batch_size < 1:  # refused even without --speed: a mistake either way
        raise UsageError(f"--batch-size must be >= 1, got {batch_size}")
    if speed:
        _check_speed_options(batch_size, iters, device)
    targets: list[tuple[Target, dict | None]] = []
    for s in specs:
        if is_suite_folder(s) or s in suite_names:
            targets += suite_member_targets(s)  # a suite's members, with measured accuracy
        else:
            targets.append((find_target(s), None))

    rows: list[CompareRow] = []
    for index, (target, measured) in enumerate(targets):
        emit(on_event, "compare_model", name=target.name, step=index + 1, steps=len(targets))
        row = _static_row(target)
        row.measured = measured
        if speed:
            _add_speed(
                row,
                target.config,
                batch_size=batch_size,
                iters=iters,
                device=device,
                on_event=on_event,
            )
        if evaluate and target.path is not None:
            _add_evaluation(row, target.path, data_dir=data_dir, device=device, on_event=on_event)
        rows.append(row)

    ref = next((r for r in rows if r.arch == "resnet18"), None)
    ratios = [reference_ratios(r, ref) for r in rows if ref is not None and r is not ref]
    return CompareReport(rows=rows, reference=ref.name if ref else None, ratios=ratios)


def _check_speed_options(batch_size: int, iters: int, device: str) -> None:
    from capsctl.devices import resolve_device

    if batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {batch_size}")
    if iters < 1:
        raise UsageError(f"--iters must be >= 1, got {iters}")
    resolve_device(device)


def _static_row(target: Target) -> CompareRow:
    """What needs no timing: parameters, FLOPs, routing, stored and published accuracy."""
    cfg = target.config
    try:
        model = build_model_from_config(cfg)
    except ValueError as e:  # e.g. an inconsistent custom layer list
        raise ConfigError(f"{target.name}: cannot build the model ({e})") from None
    shape = [cfg.in_channels, cfg.input_size, cfg.input_size]
    caps = cfg.arch == "capsnet"
    gflops = count_flops(model, shape)
    all_passes = count_flops(model, shape, all_passes=True) if caps else None
    groups = parameter_counts(model)
    del model
    path = target.path
    accuracy, accuracy_source = stored_accuracy(path) if path else (None, None)
    ref_acc, ref_source = reference_accuracy(cfg, target.dataset)
    return CompareRow(
        name=target.name,
        source=target.source,
        arch=cfg.arch,
        num_classes=cfg.num_classes,
        input=shape,
        params={k: int(groups[k]) for k in ("total", "backbone", "capsules")},
        gflops=gflops,
        routing=cfg.routing if caps else None,
        iterations=cfg.iterations if caps else None,
        accuracy=accuracy,
        accuracy_source=accuracy_source,
        reference_accuracy=ref_acc,
        reference_source=ref_source,
        gflops_all_passes=all_passes,
    )


def _add_speed(
    row: CompareRow,
    cfg: ModelConfig,
    *,
    batch_size: int,
    iters: int,
    device: str,
    on_event: EventFn,
) -> None:
    from capsctl.bench import run_bench

    (bench,) = run_bench(
        [(row.name, cfg)], batch_size=batch_size, iters=iters, device=device, on_event=on_event
    )
    row.train_step_s = bench.train_step_s
    row.infer_images_per_s = bench.infer_images_per_s
    row.peak_memory_bytes = (
        bench.peak_device_bytes if bench.peak_device_bytes is not None else bench.peak_rss_bytes
    )


def _add_evaluation(
    row: CompareRow, path: Path, *, data_dir: str | None, device: str, on_event: EventFn
) -> None:
    from capsctl.evaluation import evaluate_checkpoint

    result, _ = evaluate_checkpoint(
        path, data_dir=data_dir, split="test", device=device, on_event=on_event
    )
    row.accuracy = float(result.accuracy)
    row.accuracy_source = f"--eval test ({result.dataset}, {result.count:,} images)"
