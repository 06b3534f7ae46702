"""Side-by-side comparison of models: parameters, FLOPs, accuracy, and optionally speed.

:func:`compare` takes registered model names, preset names, aliases (``caps``, ``resnet18``),
``.yaml`` preset files and ``.safetensors`` checkpoints (:func:`resolve_target`) and returns a
:class:`CompareReport`: one :class:`CompareRow` per target and, when a ResNet-18 is among them,
footer lines with ratios relative to it.

FLOPs are ``2 x`` multiply-accumulates of one forward pass per image, counted by
:class:`torch.utils.flop_counter.FlopCounterMode` (:func:`count_flops`). That counter counts
matrix products and convolutions (``mm``, ``addmm``, ``bmm``, ``convolution``...), not
elementwise work: the routing's agreement dot products, coefficient-weighted sums and softmax,
LayerNorm, BatchNorm and activations are not counted. ``gflops`` is what our forward pass
computes; concurrent routing skips the routed passes that cannot reach the output (with T=2
only the class layer is routed). ``gflops_all_passes`` counts ``model(x, trace=True)``, which
computes every pass of every layer, as the authors' implementation does.

Speed columns come from :func:`capsctl.bench.run_bench`; test accuracy from the checkpoint's
metadata or, with ``evaluate=True``, from :func:`capsctl.engine.evaluate_checkpoint`.
Published accuracies (:data:`PUBLISHED`) each carry their source, the table or passage and
the setting, and a row gets one only when its configuration is the published one
(:func:`published_result`): same architecture, classes, input, routing and T, and, for presets
and checkpoints, the same dataset and standard test split.
Nothing is printed: progress goes to an optional ``on_event`` callback as dicts.
"""

from __future__ import annotations

import csv
import dataclasses
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from capsctl.errors import ConfigError, UsageError
from capsctl.models import build_model_from_config, parameter_counts
from capsctl.models.spec import ModelConfig

__all__ = [
    "ALIASES",
    "FLOPS_NOTE",
    "CompareReport",
    "CompareRow",
    "PUBLISHED",
    "PublishedResult",
    "compare",
    "count_flops",
    "published_result",
    "reference_accuracy",
    "resolve_target",
]

EventFn = Callable[[dict], None] | None

#: Short names accepted besides registered models and presets -> registered model name.
#: ``resnet18`` is the model of the ``cifar10-resnet18`` preset (the registered ``resnet18``).
ALIASES: dict[str, str] = {"caps": "cifar10-caps", "resnet18": "resnet18"}

FLOPS_NOTE = (
    "FLOPs = 2 x multiply-accumulates, counted by torch.utils.flop_counter.FlopCounterMode for "
    "one forward pass (batch 2, divided by 2, eval mode); it counts convolutions and matrix "
    "products (conv, mm, addmm, bmm), not elementwise work (routing agreements and weighted "
    "sums, softmax, normalization, activations); gflops_all_passes also counts the routed "
    "passes that cannot reach the output (every pass, as the authors' code computes them)"
)

_CHECKPOINT_SUFFIXES = (".safetensors",)
_PRESET_SUFFIXES = (".yaml", ".yml")

_TSAI = "Tsai et al. 2020 (ICLR, arXiv 2002.04764)"
_README_SETTING = (
    "resnet backbone, concurrent routing, T={t}, test accuracy, mean over runs (best epoch "
    "chosen on the test set)"
)


@dataclass(frozen=True)
class PublishedResult:
    """One published test accuracy, the configuration it was measured on, and its source.

    ``model`` is the registered model whose configuration the published runs used (with
    ``iterations`` = T for capsule nets), ``dataset`` the dataset they were trained and tested
    on (the standard test split). ``source`` names the publication or file, ``table`` the
    table or passage in it, ``setting`` what was run and how the number was obtained.
    """

    accuracy: float
    model: str
    iterations: int | None
    dataset: str
    source: str
    table: str
    setting: str

    @property
    def citation(self) -> str:
        """``source, table: setting`` on one line."""
        return f"{self.source}, {self.table}: {self.setting}"


#: Every published accuracy :func:`reference_accuracy` can report.
PUBLISHED: tuple[PublishedResult, ...] = (
    PublishedResult(
        0.9485,
        "cifar10-caps",
        2,
        "cifar10",
        f"{_TSAI}, authors' README",
        "results table, CIFAR-10 row, T=2",
        _README_SETTING.format(t=2),
    ),
    PublishedResult(
        0.9473,
        "cifar10-caps",
        1,
        "cifar10",
        f"{_TSAI}, authors' README",
        "results table, CIFAR-10 row, T=1",
        _README_SETTING.format(t=1),
    ),
    PublishedResult(
        0.7627,
        "cifar100-caps",
        2,
        "cifar100",
        f"{_TSAI}, authors' README",
        "results table, CIFAR-100 row, T=2",
        _README_SETTING.format(t=2),
    ),
    PublishedResult(
        0.7602,
        "cifar100-caps",
        1,
        "cifar100",
        f"{_TSAI}, authors' README",
        "results table, CIFAR-100 row, T=1",
        _README_SETTING.format(t=1),
    ),
    PublishedResult(
        0.95,
        "resnet18",
        None,
        "cifar10",
        f"{_TSAI}, paper",
        "abstract and section 5 (CIFAR-10 and CIFAR-100)",
        "ResNet-18 baseline (CIFAR stem) on CIFAR-10, about 95% test accuracy (approximate: "
        "the paper states that the capsule net is at par with it)",
    ),
)

#: Configuration fields a published capsule net result does not depend on (a regularizer
#: that changes neither the architecture nor the parameters); every other field must match.
_IGNORED_FIELDS = ("dropout",)
#: The only fields the ResNet-18 builder reads.
_RESNET_FIELDS = ("arch", "num_classes", "in_channels", "input_size")
#: Test files that are the standard test split (``data.test_file``).
_STANDARD_TEST_FILES = (None, "", "test", "test.npz")


# --------------------------------------------------------------------------------------------
# Rows and report
# --------------------------------------------------------------------------------------------


@dataclass
class CompareRow:
    """One compared model. ``None`` means "not known / not measured / not applicable".

    ``source``: ``model`` (registered), ``preset`` or ``checkpoint``. ``input``: ``[C, H, W]``.
    ``gflops``: per image, one forward pass of our implementation; ``gflops_all_passes``: the
    same with every routing pass computed (capsule nets only). ``accuracy``: top-1 test (or
    validation, as ``accuracy_source`` says) accuracy of a checkpoint. ``reference_accuracy``:
    the published number measured on this configuration (:func:`published_result`), and
    ``reference_source`` its citation (source, table, setting). Speed: median training step
    (seconds), inference images per second and peak memory (device bytes on cuda, else the
    peak resident memory of the process) from :func:`capsctl.bench.run_bench`.
    """

    name: str
    source: str
    arch: str
    num_classes: int
    input: list[int]
    params: dict[str, int]
    gflops: float
    routing: str | None
    iterations: int | None
    accuracy: float | None
    accuracy_source: str | None
    reference_accuracy: float | None
    reference_source: str | None
    gflops_all_passes: float | None = None
    train_step_s: float | None = None
    infer_images_per_s: float | None = None
    peak_memory_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: Columns of :meth:`CompareReport.to_csv`, in order.
CSV_COLUMNS = (
    "name",
    "source",
    "arch",
    "num_classes",
    "input",
    "params_total",
    "params_backbone",
    "params_capsules",
    "gflops",
    "gflops_all_passes",
    "routing",
    "iterations",
    "accuracy",
    "accuracy_source",
    "reference_accuracy",
    "reference_source",
    "train_step_s",
    "infer_images_per_s",
    "peak_memory_bytes",
)


def _csv_value(value: Any) -> Any:
    return "" if value is None else value


@dataclass
class CompareReport:
    """Rows, the name of the ResNet-18 row the footer ratios refer to, and the footer."""

    rows: list[CompareRow]
    reference: str | None
    footer: list[str]
    flops_note: str = field(default=FLOPS_NOTE)

    def to_dict(self) -> dict[str, Any]:
        return {
            "models": [row.to_dict() for row in self.rows],
            "reference": self.reference,
            "footer": list(self.footer),
            "flops_note": self.flops_note,
        }

    def to_csv(self) -> str:
        """A header line and one line per row; ``input`` as ``CxHxW``, empty cells for None."""
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(CSV_COLUMNS)
        for row in self.rows:
            flat = row.to_dict()
            params = flat.pop("params")
            flat["input"] = "x".join(str(v) for v in row.input)
            flat["params_total"] = params.get("total")
            flat["params_backbone"] = params.get("backbone")
            flat["params_capsules"] = params.get("capsules")
            writer.writerow([_csv_value(flat.get(col)) for col in CSV_COLUMNS])
        return buf.getvalue()


# --------------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------------


def _accepted(models: Sequence[str], presets: Sequence[str]) -> str:
    return (
        f"registered models ({', '.join(models) or 'none'}), "
        f"presets ({', '.join(presets) or 'none'}), aliases ({', '.join(ALIASES)}), "
        "a .yaml preset file, a .safetensors checkpoint or a model folder"
    )


def _checkpoint_config(path: Path) -> ModelConfig:
    """The model configuration stored in a checkpoint's metadata (no tensor is read)."""
    from capsctl.checkpoint import model_config

    return model_config(path)


#: Named sets of targets for ``capsctl compare --suite``.
SUITES: dict[str, list[str]] = {
    # Tsai et al. 2020, Table 1: routing procedures under the same backbones, a CNN of the same
    # layers and widths, and ResNet-18, on CIFAR-10 and CIFAR-100.
    "paper": [
        f"{ds}-{method}{bb}"
        for ds in ("cifar10", "cifar100")
        for bb in ("-simple", "")
        for method in ("caps", "dynamic", "em", "cnn")
    ]
    + ["resnet18"],
    "paper-cifar10": [
        f"cifar10-{method}{bb}"
        for bb in ("-simple", "")
        for method in ("caps", "dynamic", "em", "cnn")
    ]
    + ["resnet18"],
}


def resolve_target(spec: str) -> tuple[str, str, ModelConfig, Path | None]:
    """``(name, source, config, checkpoint path or None)`` of one compare target.

    Tried in order: an existing file (``.yaml``/``.yml``: a preset; anything else: a capsctl
    checkpoint), an alias (:data:`ALIASES`), a registered model, a preset name. ``source`` is
    ``"model"``, ``"preset"`` or ``"checkpoint"``. A checkpoint's name is ``spec`` as given.
    Raises UsageError naming what is accepted when nothing matches.
    """
    name, source, cfg, path, _ = _resolve(spec)
    return name, source, cfg, path


def _resolve(spec: str) -> tuple[str, str, ModelConfig, Path | None, str | None]:
    """:func:`resolve_target` plus the target's dataset (:func:`_dataset_key`; None for a
    registered model, which names no dataset)."""
    from capsctl.config import list_presets, load_preset
    from capsctl.registry import get_config, list_models

    text = str(spec).strip()
    if not text:
        raise UsageError(
            "empty model name; pass a model, preset, alias, .yaml, .safetensors or model folder"
        )
    path = Path(text).expanduser()
    if path.is_dir() and (path / "config.json").is_file():  # a model folder (export --format hf)
        return text, "checkpoint", _checkpoint_config(path), path
    if path.is_file():
        if path.suffix.lower() in _PRESET_SUFFIXES:
            preset = load_preset(path)
            name = preset.name or path.stem
            return name, "preset", preset.model, None, _dataset_key(preset.data)
        cfg = _checkpoint_config(path)
        return text, "checkpoint", cfg, path, _checkpoint_dataset(path)
    if path.suffix.lower() in _CHECKPOINT_SUFFIXES + _PRESET_SUFFIXES:
        raise UsageError(f"{text} does not exist; check the path")
    if text in ALIASES:
        name = ALIASES[text]
        return name, "model", get_config(name), None, None
    models = list_models()
    if text in models:
        return text, "model", get_config(text), None, None
    presets = [n for n, _ in list_presets()]
    if text in presets:
        preset = load_preset(text)
        return preset.name or text, "preset", preset.model, None, _dataset_key(preset.data)
    raise UsageError(f"unknown model {text!r}; compare accepts {_accepted(models, presets)}")


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------


def count_flops(model: nn.Module, input_shape: Sequence[int], *, all_passes: bool = False) -> float:
    """GFLOPs (``2 x`` multiply-accumulates, per image) of one forward pass of ``model``.

    ``input_shape`` is one image's ``(C, H, W)``. The model runs in eval mode under
    ``torch.no_grad`` on a batch of 2 (so batch-size-1 special cases do not matter) and the
    count is halved; its training mode is restored afterwards. ``all_passes=True`` calls
    ``model(x, trace=True)`` (capsule nets: every routing pass is computed). Only what
    :class:`~torch.utils.flop_counter.FlopCounterMode` counts is included: convolutions and
    matrix products, not elementwise operations.
    """
    from torch.utils.flop_counter import FlopCounterMode

    shape = [int(v) for v in input_shape]
    if len(shape) != 3 or min(shape) < 1:
        raise UsageError(f"input shape must be (channels, height, width), got {tuple(shape)}")
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    dtype = first.dtype if first is not None and first.is_floating_point() else torch.float32
    x = torch.randn(2, *shape, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    was_training = model.training
    model.eval()
    try:
        counter = FlopCounterMode(display=False)
        with torch.no_grad(), counter:
            if all_passes:
                model(x, trace=True)
            else:
                model(x)
    finally:
        model.train(was_training)
    return counter.get_total_flops() / 2 / 1e9


def _fields_match(cfg: ModelConfig, result: PublishedResult) -> bool:
    from capsctl.registry import get_config

    ref = get_config(result.model)
    if result.iterations is not None:
        ref = ref.replace(iterations=result.iterations)
    if ref.arch == "resnet18":
        names: Sequence[str] = _RESNET_FIELDS
    else:
        names = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in _IGNORED_FIELDS]
    return all(getattr(cfg, n) == getattr(ref, n) for n in names)


def published_result(cfg: ModelConfig, dataset: str | None = None) -> PublishedResult | None:
    """The published result (:data:`PUBLISHED`) measured on this configuration, or None.

    Matched by configuration, not by name: every field of ``cfg`` but dropout must equal the
    published model's configuration at the published T (ResNet-18: architecture, classes,
    channels and input size). ``dataset`` is the dataset the row's model is trained and tested
    on (``"cifar10"``; ``"cifar10[test-jpeg]"`` for another test file) when known; it must then
    be the published one. ``None`` (a bare registered model) leaves it to the configuration.
    """
    for result in PUBLISHED:
        if dataset is not None and dataset != result.dataset:
            continue
        if _fields_match(cfg, result):
            return result
    return None


def reference_accuracy(
    cfg: ModelConfig, dataset: str | None = None
) -> tuple[float | None, str | None]:
    """``(accuracy, citation)`` of :func:`published_result`; ``(None, None)`` if none."""
    result = published_result(cfg, dataset)
    if result is None:
        return None, None
    return result.accuracy, result.citation


def _dataset_key(data: Any) -> str | None:
    """The dataset a preset's ``data`` section (dict or DataConfig) trains and tests on.

    ``"<dataset>"`` for the standard test split, ``"<dataset>[<test file stem>]"`` for another
    test file, None when unknown.
    """
    if isinstance(data, dict):
        name, test_file = data.get("dataset"), data.get("test_file")
    else:
        name, test_file = getattr(data, "dataset", None), getattr(data, "test_file", None)
    if not isinstance(name, str) or not name:
        return None
    if test_file in _STANDARD_TEST_FILES or not isinstance(test_file, str):
        return name
    return f"{name}[{test_file.removesuffix('.npz')}]"


def _checkpoint_dataset(path: Path) -> str | None:
    from capsctl.checkpoint import read_metadata

    preset = read_metadata(path).get("preset")
    return _dataset_key(preset.get("data")) if isinstance(preset, dict) else None


def _checkpoint_accuracy(path: Path) -> tuple[float | None, str | None]:
    from capsctl.checkpoint import read_metadata

    meta = read_metadata(path)
    test = meta.get("test")
    if isinstance(test, dict) and isinstance(test.get("accuracy"), (int, float)):
        parts = [str(meta.get("test_name") or test.get("dataset") or "test split")]
        count = test.get("count")
        if isinstance(count, int):
            parts.append(f"{count:,} images")
        return float(test["accuracy"]), f"checkpoint test ({', '.join(parts)})"
    metrics = meta.get("metrics")
    if isinstance(metrics, dict) and isinstance(metrics.get("val_accuracy"), (int, float)):
        epoch = meta.get("epoch")
        where = f" (epoch {epoch})" if isinstance(epoch, int) else ""
        return float(metrics["val_accuracy"]), f"checkpoint val{where}"
    return None, None


def _times(ratio: float) -> str:
    return f"{ratio:.2f}x" if ratio < 2 else f"{ratio:.1f}x"


def _slower(ratio: float) -> str:
    """``ratio`` = this time / the reference's time, in words."""
    return f"{_times(ratio)} slower" if ratio >= 1 else f"{_times(1 / ratio)} faster"


def _footer_line(row: CompareRow, ref: CompareRow) -> str:
    parts = []
    mine, theirs = row.params["total"], ref.params["total"]
    if max(mine, theirs) < 1.005 * min(mine, theirs):
        parts.append(f"about as many parameters as {ref.name}")
    elif mine < theirs:
        parts.append(f"{_times(theirs / mine)} fewer parameters than {ref.name}")
    else:
        parts.append(f"{_times(mine / theirs)} the parameters of {ref.name}")
    if ref.gflops > 0:
        flops = f"{_times(row.gflops / ref.gflops)} the FLOPs"
        if row.gflops_all_passes is not None and row.gflops_all_passes != row.gflops:
            flops += f" ({_times(row.gflops_all_passes / ref.gflops)} with every routing pass)"
        parts.append(flops)
    if row.train_step_s and ref.train_step_s:
        parts.append(f"training step {_slower(row.train_step_s / ref.train_step_s)}")
    if row.infer_images_per_s and ref.infer_images_per_s:
        parts.append(f"inference {_slower(ref.infer_images_per_s / row.infer_images_per_s)}")
    return f"{row.name}: {', '.join(parts)}"


def _emit(on_event: EventFn, **event: Any) -> None:
    if on_event is not None:
        on_event(event)


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
) -> CompareReport:
    """Compare the given targets (see :func:`resolve_target`); one row per target, in order.

    Always: parameters (:func:`capsctl.models.parameter_counts`), GFLOPs per image
    (:func:`count_flops`, on the CPU), routing, the checkpoint's stored accuracy (test if the
    checkpoint has it, else validation) and the published reference accuracy.
    ``speed=True`` adds :func:`capsctl.bench.run_bench` measurements (``batch_size``, ``iters``
    timed steps, ``device``). ``evaluate=True`` recomputes checkpoint rows' accuracy on the test
    split with :func:`capsctl.engine.evaluate_checkpoint` (``data_dir``, ``device``).

    Events: ``{"event": "compare_model", "name", "index", "total"}`` before each target, plus
    the events of ``run_bench`` and ``evaluate_checkpoint``.
    """
    if isinstance(specs, str):
        specs = [specs]
    if not specs:
        raise UsageError("nothing to compare; pass at least one model, preset or checkpoint")
    if speed:
        from capsctl.devices import resolve_device

        if batch_size < 1:
            raise UsageError(f"--batch-size must be >= 1, got {batch_size}")
        if iters < 1:
            raise UsageError(f"--iters must be >= 1, got {iters}")
        resolve_device(device)
    targets = [_resolve(s) for s in specs]

    rows: list[CompareRow] = []
    for index, (name, source, cfg, path, dataset) in enumerate(targets):
        _emit(on_event, event="compare_model", name=name, index=index, total=len(targets))
        try:
            model = build_model_from_config(cfg)
        except ValueError as e:  # e.g. an inconsistent custom layer list
            raise ConfigError(f"{name}: cannot build the model ({e})") from None
        shape = [cfg.in_channels, cfg.input_size, cfg.input_size]
        caps = cfg.arch == "capsnet"
        gflops = count_flops(model, shape)
        all_passes = count_flops(model, shape, all_passes=True) if caps else None
        groups = parameter_counts(model)
        del model
        accuracy, accuracy_source = _checkpoint_accuracy(path) if path else (None, None)
        ref_acc, ref_source = reference_accuracy(cfg, dataset)
        row = CompareRow(
            name=name,
            source=source,
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
        if speed:
            _add_speed(
                row, cfg, batch_size=batch_size, iters=iters, device=device, on_event=on_event
            )
        if evaluate and path is not None:
            _add_evaluation(row, path, data_dir=data_dir, device=device, on_event=on_event)
        rows.append(row)

    ref = next((r for r in rows if r.arch == "resnet18"), None)
    footer = [_footer_line(r, ref) for r in rows if ref is not None and r is not ref]
    return CompareReport(rows=rows, reference=ref.name if ref else None, footer=footer)


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
    from capsctl.engine import evaluate_checkpoint

    result, _ = evaluate_checkpoint(
        path, data_dir=data_dir, split="test", device=device, on_event=on_event
    )
    row.accuracy = float(result.accuracy)
    row.accuracy_source = f"--eval test ({result.dataset}, {result.count:,} images)"
