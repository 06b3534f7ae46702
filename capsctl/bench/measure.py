"""Measuring models one after another in this process: :func:`run_bench`.

Each model is built with seeded weights and timed on seeded synthetic inputs: training steps
(forward, cross-entropy, backward, SGD step) and inference passes (eval mode under
:func:`torch.inference_mode`), with the peak memory recorded while it was measured
(:mod:`capsctl.bench.memory`; ``peak_device_bytes`` is ``torch.cuda.max_memory_allocated``,
tensors only, not the CUDA context, on cuda, else None).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from capsctl.bench.memory import RssSampler, release_memory
from capsctl.bench.results import BenchRow, add_ratios
from capsctl.config import build_model, resolve_config
from capsctl.devices import autocast, flush_denormals, resolve_amp, resolve_device
from capsctl.errors import UsageError
from capsctl.events import EventFn, emit
from capsctl.layers import dispatch
from capsctl.models import parameter_counts, to_channels_last
from capsctl.models.spec import ModelConfig
from capsctl.provenance import machine_load

__all__ = ["ROUTING_MODES", "ModelSpec", "run_bench"]

ROUTING_MODES = ("concurrent", "sequential")

ModelSpec = str | ModelConfig | Mapping[str, Any] | tuple[str, ModelConfig]


@dataclass(frozen=True)
class _Settings:
    """What :func:`run_bench` measures for every model (its arguments of the same names)."""

    batch_size: int
    iters: int
    warmup: int
    train: bool
    infer: bool
    iterations: int | None
    routing: str | None
    seed: int
    amp: bool = False
    channels_last: bool = False
    compile: bool = False


def run_bench(
    models: Sequence[ModelSpec],
    *,
    batch_size: int = 32,
    iters: int = 5,
    warmup: int = 1,
    train: bool = True,
    infer: bool = True,
    device: str = "cpu",
    iterations: int | None = None,
    routing: str | None = None,
    threads: int | None = None,
    seed: int = 0,
    amp: bool | str = "auto",
    channels_last: bool = False,
    compile: bool = False,
    on_event: EventFn = None,
) -> list[BenchRow]:
    """Measure ``models`` one after another in this process and return one row per model.

    ``models``: registered names, :class:`ModelConfig` objects, config mappings (``base: <name>``
    allowed) or ``(label, config)`` pairs. All are resolved before anything is measured, so an
    unknown name raises the registry's ConfigError up front. ``iters`` timed steps follow
    ``warmup`` untimed ones, for training (SGD lr 0.01, momentum 0.9, cross-entropy) and for
    inference; ``train=False`` / ``infer=False`` skip a phase (its columns are None).
    ``iterations``/``routing`` override the routing of capsule models (via ``set_routing``) and
    are ignored for the others. ``device``: cpu, cuda[:N], mps or auto. ``threads`` calls
    ``torch.set_num_threads`` (process-wide, left in place). ``seed`` fixes weights, inputs and
    labels (the global RNG state is restored afterwards). ``amp`` (``True``, ``False`` or
    ``"auto"``, as ``train.amp``: :func:`capsctl.devices.resolve_amp`) runs forward passes under
    bf16 autocast, ``channels_last`` puts model and inputs in that memory format, ``compile`` times
    ``torch.compile(model)`` (compilation happens in the warm-up steps, so give at least one;
    the ratios then compare compiled models). Speed ratios are relative to
    ``resnet18`` when it is among the models (:func:`capsctl.bench.results.add_ratios`).

    Events: ``{"event": "bench_model", "name", "step", "steps"}`` before each model (``step``
    counts models from 1) and ``{"event": "bench_step", "name", "phase", "step", "steps",
    "warmup"}`` after every timed or warm-up step (``step`` counts from 1 to warmup + iters).
    """
    dev = resolve_device(device)
    settings = _Settings(batch_size, iters, warmup, train, infer, iterations, routing, seed)
    bf16, _ = resolve_amp(amp, dev)
    settings = dataclasses.replace(settings, amp=bf16, channels_last=channels_last, compile=compile)
    _check_settings(settings, threads)
    specs = [_label_and_config(m) for m in models]
    if threads is not None:
        torch.set_num_threads(threads)

    rows: list[BenchRow] = []
    with flush_denormals(dev):  # as training does
        for index, (label, cfg) in enumerate(specs):
            emit(on_event, "bench_model", name=label, step=index + 1, steps=len(specs))
            rows.append(_measure_with_memory(label, cfg, dev, settings, on_event))
    release_memory()
    add_ratios(rows)
    return rows


def _check_settings(s: _Settings, threads: int | None) -> None:
    if s.iters < 1:
        raise UsageError(f"--iters must be >= 1, got {s.iters}")
    if s.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {s.warmup}")
    if s.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {s.batch_size}")
    if s.iterations is not None and s.iterations < 1:
        raise UsageError(f"--iterations must be >= 1, got {s.iterations}")
    if s.routing is not None and s.routing not in ROUTING_MODES:
        raise UsageError(f"unknown routing {s.routing!r}; use {' or '.join(ROUTING_MODES)}")
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    if s.compile and s.warmup < 1:
        raise UsageError("--compile needs --warmup >= 1: compilation happens in the warm-up steps")


def _label_and_config(spec: ModelSpec) -> tuple[str, ModelConfig]:
    if isinstance(spec, tuple):
        label, cfg = spec
        return str(label), resolve_config(cfg)
    if isinstance(spec, str):
        return spec, resolve_config(spec)
    cfg = resolve_config(spec)
    base = spec.get("base") if isinstance(spec, Mapping) else None
    return (f"{base} (custom)" if base else f"custom-{cfg.arch}"), cfg


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()


def _fork_devices(dev: torch.device) -> list[int]:
    if dev.type != "cuda":
        return []
    return [dev.index if dev.index is not None else torch.cuda.current_device()]


def _measure_with_memory(
    label: str, cfg: ModelConfig, dev: torch.device, settings: _Settings, on_event: EventFn
) -> BenchRow:
    """:func:`_measure` with the peak memory of the process (and of the device on cuda)."""
    release_memory()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    with RssSampler() as sampler:
        row = _measure(label, cfg, dev, settings, on_event)
    row.peak_rss_bytes = sampler.peak_bytes
    load = machine_load()  # as the model's measurement ends
    row.load_1m, row.cpus = load.get("load_1m"), load.get("cpus")
    if dev.type == "cuda":
        row.peak_device_bytes = int(torch.cuda.max_memory_allocated(dev))
    return row


def _measure(
    label: str, cfg: ModelConfig, dev: torch.device, s: _Settings, on_event: EventFn
) -> BenchRow:
    """Build and time one model. Memory tracking is the caller's job."""
    with torch.random.fork_rng(devices=_fork_devices(dev)):
        torch.manual_seed(s.seed)
        model: nn.Module = build_model(cfg)
        gen = torch.Generator().manual_seed(s.seed)
        x = torch.randn(
            s.batch_size, cfg.in_channels, cfg.input_size, cfg.input_size, generator=gen
        )
        y = torch.randint(0, cfg.num_classes, (s.batch_size,), generator=gen)
        model.to(dev)
        x, y = x.to(dev), y.to(dev)
        if s.channels_last:
            to_channels_last(model)
            x = x.contiguous(memory_format=torch.channels_last)
        caps_iterations, caps_routing = _apply_routing(model, s.iterations, s.routing)
        run: nn.Module = torch.compile(model) if s.compile else model  # type: ignore[assignment]
        timer = _Timer(dev, label, s.warmup, s.iters, on_event)
        dispatch.reset_ran()
        with autocast(dev, s.amp):
            train_s = _time_training(run, x, y, timer) if s.train else []
            infer_s = _time_inference(run, x, timer) if s.infer else []

    infer_median = statistics.median(infer_s) if infer_s else None
    ran = dispatch.ran()  # the passes' backends (compiled: those seen while tracing)
    return BenchRow(
        name=label,
        arch=cfg.arch,
        params=int(parameter_counts(model)["total"]),
        batch_size=s.batch_size,
        device=str(dev),
        iterations=caps_iterations,
        routing=caps_routing,
        train_step_s=statistics.median(train_s) if train_s else None,
        train_step_min_s=min(train_s) if train_s else None,
        infer_images_per_s=(s.batch_size / infer_median) if infer_median else None,
        peak_rss_bytes=None,
        peak_device_bytes=None,
        input_size=cfg.input_size,
        amp=s.amp,
        channels_last=s.channels_last,
        compiled=s.compile,
        routing_backend="+".join(b for b in dispatch.BACKENDS if b in ran) or None,
    )


def _apply_routing(
    model: nn.Module, iterations: int | None, routing: str | None
) -> tuple[int | None, str | None]:
    """Override a capsule model's routing; its ``(T, routing)``, ``(None, None)`` otherwise."""
    set_routing = getattr(model, "set_routing", None)
    if not callable(set_routing):
        return None, None
    if iterations is not None or routing is not None:
        set_routing(iterations, routing)
    return int(model.iterations), str(model.routing)


@dataclass(frozen=True)
class _Timer:
    """Times ``warmup`` untimed then ``iters`` timed calls of a step, with ``bench_step`` events."""

    dev: torch.device
    name: str
    warmup: int
    iters: int
    on_event: EventFn

    def times(self, step: Callable[[], None], phase: str) -> list[float]:
        times: list[float] = []
        steps = self.warmup + self.iters
        for i in range(steps):
            _sync(self.dev)
            t0 = time.perf_counter()
            step()
            _sync(self.dev)
            elapsed = time.perf_counter() - t0
            if i >= self.warmup:
                times.append(elapsed)
            emit(
                self.on_event,
                "bench_step",
                name=self.name,
                phase=phase,
                step=i + 1,
                steps=steps,
                warmup=i < self.warmup,
            )
        return times


def _time_training(model: nn.Module, x: Tensor, y: Tensor, timer: _Timer) -> list[float]:
    """Seconds of each timed SGD step (lr 0.01, momentum 0.9) on cross-entropy."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()

    times = timer.times(train_step, "train")
    opt.zero_grad(set_to_none=True)
    return times


def _time_inference(model: nn.Module, x: Tensor, timer: _Timer) -> list[float]:
    """Seconds of each timed forward pass in eval mode under ``torch.inference_mode``."""
    model.eval()

    def infer_step() -> None:
        with torch.inference_mode():
            model(x)

    return timer.times(infer_step, "infer")
