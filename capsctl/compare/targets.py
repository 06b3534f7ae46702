"""What ``compare`` accepts: registered models, aliases, presets, preset files, checkpoints.

:func:`find_target` turns one name or path into a :class:`Target`: the row's name, where it
came from, its model configuration, the checkpoint (file or model folder) and the dataset it
is trained and tested on. :func:`stored_accuracy` reads a checkpoint's recorded accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capsctl.errors import UsageError, did_you_mean, some_names
from capsctl.models.spec import ModelConfig

__all__ = [
    "ALIASES",
    "SUITES",
    "Target",
    "dataset_key",
    "find_target",
    "resolve_target",
    "stored_accuracy",
    "suite_targets",
]

#: Short names accepted besides registered models and presets -> registered model name.
#: ``resnet18`` is the model of the ``cifar10-resnet18`` preset (the registered ``resnet18``).
ALIASES: dict[str, str] = {"caps": "cifar10-caps", "resnet18": "resnet18"}

#: Named sets of targets for ``capsctl compare --suite``.
SUITES: dict[str, list[str]] = {
    # Tsai et al. 2020, Table 1: routing procedures under the same backbones, a CNN of the same
    # layers and widths, and ResNet-18, on CIFAR-10 and CIFAR-100; plus self-routing (Hahn et
    # al., NeurIPS 2019) under the same backbones.
    "paper": [
        f"{ds}-{method}{bb}"
        for ds in ("cifar10", "cifar100")
        for bb in ("-simple", "")
        for method in ("caps", "dynamic", "em", "self", "cnn")
    ]
    + ["resnet18"],
    "paper-cifar10": [
        f"cifar10-{method}{bb}"
        for bb in ("-simple", "")
        for method in ("caps", "dynamic", "em", "self", "cnn")
    ]
    + ["resnet18"],
}

_CHECKPOINT_SUFFIXES = (".safetensors",)
_PRESET_SUFFIXES = (".yaml", ".yml")
#: Test files that are the standard test split (``data.test_file``).
_STANDARD_TEST_FILES = (None, "", "test", "test.npz")


@dataclass(frozen=True)
class Target:
    """One compared model.

    ``source``: ``"model"`` (registered), ``"preset"`` or ``"checkpoint"`` (a ``.safetensors``
    file or a model folder, then ``path``). ``dataset``: what the model is trained and tested
    on (``"cifar10"``, ``"cifar10[test-jpeg]"`` for another test file; None for a registered
    model, which names no dataset, or when unknown).
    """

    name: str
    source: str
    config: ModelConfig
    path: Path | None
    dataset: str | None


def _unknown(text: str, models: list[str], presets: list[str]) -> UsageError:
    """Unknown ``text``: the closest name, and where to find them all (not every name)."""
    hint = did_you_mean([*models, *presets, *ALIASES], text)
    return UsageError(
        f"unknown model {text!r}{hint}; give a model (capsctl models), a preset (capsctl "
        f"presets), {' or '.join(ALIASES)}, a .yaml, a .safetensors or a model folder"
    )


def dataset_key(data: Any) -> str | None:
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


def _checkpoint_target(name: str, path: Path) -> Target:
    """A checkpoint file or model folder: configuration and dataset from its metadata."""
    from capsctl.checkpoint import model_config, read_metadata

    meta = read_metadata(path)
    config = model_config(path, meta)
    preset = meta.get("preset")
    dataset = dataset_key(preset.get("data")) if isinstance(preset, dict) else None
    return Target(name, "checkpoint", config, path, dataset)


def _preset_target(spec: str | Path, fallback_name: str) -> Target:
    from capsctl.config import load_preset

    preset = load_preset(spec)
    name = preset.name or fallback_name
    return Target(name, "preset", preset.model, None, dataset_key(preset.data))


def find_target(spec: str) -> Target:
    """The :class:`Target` named by ``spec``.

    Tried in order: a model folder (``config.json`` inside) or a run folder of ``capsctl
    train`` (its ``best.safetensors``, :func:`capsctl.checkpoint.resolve_checkpoint`), an
    existing file (``.yaml``/``.yml``: a preset; anything else: a capsctl checkpoint), an alias
    (:data:`ALIASES`), a registered model, a preset name. A checkpoint's name is ``spec`` as
    given. Raises UsageError naming what is accepted when nothing matches.
    """
    from capsctl.checkpoint import resolve_checkpoint
    from capsctl.config import list_presets
    from capsctl.registry import get_config, list_models

    text = str(spec).strip()
    if not text:
        raise UsageError(
            "empty model name; pass a model, preset, alias, .yaml, .safetensors or model folder"
        )
    path = Path(text).expanduser()
    if path.is_dir():  # a model folder (export --format hf) or a run folder (capsctl train)
        found = resolve_checkpoint(path)  # as every command reads a folder
        if found != path or (path / "config.json").is_file():
            return _checkpoint_target(text, found)
    if path.is_file():
        if path.suffix.lower() in _PRESET_SUFFIXES:
            return _preset_target(path, path.stem)
        return _checkpoint_target(text, path)
    if path.suffix.lower() in _CHECKPOINT_SUFFIXES + _PRESET_SUFFIXES:
        if path.exists():
            raise UsageError(
                f"{text}: not a regular file (a named pipe, socket or device); pass a "
                "checkpoint, preset or model folder"
            )
        raise UsageError(f"{text} does not exist; check the path")
    if text in ALIASES:
        return Target(ALIASES[text], "model", get_config(ALIASES[text]), None, None)
    shipped = resolve_checkpoint(text)  # a shipped name (capsctl weights)
    if shipped != path:
        return _checkpoint_target(text, shipped)
    models = list_models()
    if text in models:
        return Target(text, "model", get_config(text), None, None)
    presets = [n for n, _ in list_presets()]
    if text in presets:
        return _preset_target(text, text)
    raise _unknown(text, models, presets)


def resolve_target(spec: str) -> tuple[str, str, ModelConfig, Path | None]:
    """``(name, source, config, checkpoint path or None)`` of :func:`find_target`."""
    target = find_target(spec)
    return target.name, target.source, target.config, target.path


def stored_accuracy(path: Path) -> tuple[float | None, str | None]:
    """``(accuracy, accuracy_source)`` recorded in a checkpoint: its test result if it has
    one, else its validation accuracy; ``(None, None)`` when it records neither."""
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


def suite_targets(suite: str | None, models: list[str]) -> list[str]:
    """The targets of ``capsctl compare``: a named set's (:data:`SUITES`) or a ``capsctl
    suite``'s name or file (one target standing for its members), followed by ``models``."""
    from capsctl.errors import UsageError

    targets = list(models)
    if suite is not None:
        if suite in SUITES:
            targets = SUITES[suite] + targets
        else:
            from capsctl.suites import list_suites

            known = [*SUITES, *(n for n, _ in list_suites())]
            if suite not in known and not Path(suite).is_file():
                names = some_names(known, suite, "capsctl suite list")
                raise UsageError(f"--suite {suite}: unknown; choose one of {names}")
            targets = [suite, *targets]
    if not targets:
        raise UsageError("name models to compare (see capsctl models), or --suite paper")
    return targets
