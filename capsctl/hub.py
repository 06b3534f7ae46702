"""Model folders in the Hugging Face layout, and loading them: :func:`from_pretrained`.

A model folder (``capsctl export CKPT --format hf --out DIR``, :func:`export_model_folder`)
holds three files:

* ``model.safetensors``: the weights only, under the model's ``state_dict()`` names (no
  ``model.`` prefix, no optimizer or RNG state), with the safetensors metadata
  ``{"format": "pt"}`` that other readers expect;
* ``config.json``: the model and its preprocessing as data. The keys timm reads are at the top
  level: ``architecture`` (the registered model name when the configuration is exactly a
  registered one, else the ``arch``), ``num_classes``, ``input_size`` (``[C, H, W]``),
  ``mean``, ``std`` and ``label_names``. Next to them: ``model_config`` (the full
  :class:`~capsctl.models.spec.ModelConfig`, which is what the model is rebuilt from),
  ``preset`` (the resolved preset the model was trained with), ``capsctl_version``,
  ``normalization`` (the normalization's name, when known) and every other metadata entry of
  the checkpoint unchanged (``dataset``, ``epoch``, ``metrics``, ``params``, ``test`` with its
  ``split`` and ``dataset``, ``test_name``, ...), except the training state;
* ``README.md``: a model card (:func:`model_card`) whose YAML front matter holds the test
  result in the Hub's ``model-index`` form.

Every command that takes a checkpoint accepts such a folder:
:func:`capsctl.checkpoint.read_metadata` rebuilds the checkpoint metadata from ``config.json``
(:func:`metadata_from_config`) and :func:`capsctl.checkpoint.load_tensors` returns the weights
under ``model.`` names, so a folder reads like a weights-only checkpoint. Loading is strict:
a tensor missing from ``model.safetensors`` or one the model does not have is an error naming
it.

:func:`from_pretrained` loads a folder, a checkpoint file or, with the optional
``huggingface_hub`` package (``pip install 'capsctl[hub]'``), a Hub id ``org/name`` through
the Hugging Face cache (offline when the files are cached and ``HF_HUB_OFFLINE=1`` or
``local_files_only=True``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from capsctl.atomic import fsync_dir, write_atomic, write_text_atomic
from capsctl.errors import CapsctlError, CheckpointError, UsageError

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import Tensor, nn

    from capsctl.export import EventFn, ExportResult

__all__ = [
    "CARD_NAME",
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "config_from_metadata",
    "export_model_folder",
    "from_pretrained",
    "metadata_from_config",
    "model_card",
    "read_folder_metadata",
    "resolve_pretrained",
]

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
CARD_NAME = "README.md"
#: The files of a model folder, in the order they are listed.
FOLDER_FILES = (WEIGHTS_NAME, CONFIG_NAME, CARD_NAME)
#: Licence written into model cards unless another is given (capsctl's own licence).
DEFAULT_LICENSE = "mit"

_MODEL_PREFIX = "model."
#: Checkpoint metadata entries that a weights-only folder does not carry.
_DROPPED = ("training_state", "partial", "format")
#: Checkpoint metadata entries stored under timm's names (or in ``model_config``) instead.
_RENAMED = ("classes", "normalization", "input_size", "in_channels")
#: config.json keys that are not copied back into the metadata as they are.
_CONFIG_ONLY = (
    "architecture",
    "num_classes",
    "input_size",
    "mean",
    "std",
    "label_names",
    "model_config",
    "normalization",
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_HUB_MISSING = "needs huggingface_hub: pip install 'capsctl[hub]'"

#: capsctl dataset name -> (display name, Hugging Face Hub dataset id or None).
_DATASETS: dict[str, tuple[str, str | None]] = {
    "cifar10": ("CIFAR-10", "uoft-cs/cifar10"),
    "cifar100": ("CIFAR-100", "uoft-cs/cifar100"),
    "mnist": ("MNIST", "ylecun/mnist"),
    "fashion-mnist": ("Fashion-MNIST", "zalando-datasets/fashion_mnist"),
    "fashion-mnist-quickstart": (
        "Fashion-MNIST quickstart subset (shipped with capsctl)",
        None,
    ),
    "diverse-multimnist": ("DiverseMultiMNIST (generated from MNIST)", None),
}

_PAPER = (
    "Y.-H. H. Tsai, N. Srivastava, H. Goh, R. Salakhutdinov, *Capsules with Inverted "
    "Dot-Product Attention Routing*, ICLR 2020, "
    "[arXiv:2002.04764](https://arxiv.org/abs/2002.04764)"
)
_BIBTEX = """@inproceedings{tsai2020capsules,
  title     = {Capsules with Inverted Dot-Product Attention Routing},
  author    = {Tsai, Yao-Hung Hubert and Srivastava, Nitish and Goh, Hanlin and
               Salakhutdinov, Ruslan},
  booktitle = {International Conference on Learning Representations (ICLR)},
  year      = {2020},
  eprint    = {2002.04764},
  archivePrefix = {arXiv}
}"""
_ARCH_TEXT = {
    "capsnet": (
        "a capsule network with inverted dot-product attention routing, in which parent "
        "capsules compete for each child capsule's vote (a softmax over parents of the "
        "agreement between the vote and the parent's pose)"
    ),
    "capsnet-dynamic": (
        "a capsule network with dynamic routing (Sabour, Frosst and Hinton, NeurIPS 2017, "
        "arXiv:1710.09829), one of the routing baselines of the paper below"
    ),
    "capsnet-em": (
        "a capsule network with EM routing (Hinton, Sabour and Frosst, ICLR 2018), one of the "
        "routing baselines of the paper below"
    ),
    "cnn": (
        "a plain convolutional network with the backbone and layer widths of the capsule "
        "network it is compared with (a baseline of the paper below)"
    ),
    "resnet18": (
        "a ResNet-18 (He et al., CVPR 2016, arXiv:1512.03385) with the CIFAR stem, the "
        "convolutional baseline of the paper below"
    ),
}


# --------------------------------------------------------------------------------------------
# config.json <-> checkpoint metadata
# --------------------------------------------------------------------------------------------


def _architecture(raw_model: Mapping[str, Any]) -> str:
    """The registered model name whose configuration is exactly ``raw_model``, else its arch."""
    from capsctl.config import from_dict
    from capsctl.models.spec import ModelConfig
    from capsctl.registry import get_config, list_models

    try:
        config = from_dict(ModelConfig, dict(raw_model), "model_config")
    except CapsctlError:
        return str(raw_model.get("arch", "capsnet"))
    for name in list_models():
        if get_config(name) == config:
            return name
    return config.arch


def config_from_metadata(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The ``config.json`` of a model folder from a checkpoint's metadata (JSON-able)."""
    from capsctl import __version__

    preset = meta.get("preset")
    raw_model = preset.get("model") if isinstance(preset, dict) else None
    if not isinstance(raw_model, dict):
        raise CheckpointError(
            "the checkpoint's metadata has no model configuration (preset.model), so it "
            "cannot be written as a model folder"
        )
    norm = meta.get("normalization") or {}
    channels = int(meta.get("in_channels") or raw_model.get("in_channels") or 3)
    size = int(meta.get("input_size") or raw_model.get("input_size") or 32)
    mean = [float(v) for v in norm.get("mean", [0.0] * channels)]
    std = [float(v) for v in norm.get("std", [1.0] * channels)]
    classes = meta.get("classes")
    num_classes = int(raw_model.get("num_classes") or len(classes or []))
    if not classes:
        classes = [str(i) for i in range(num_classes)]
    config: dict[str, Any] = {
        "architecture": _architecture(raw_model),
        "num_classes": num_classes,
        "input_size": [channels, size, size],
        "mean": mean,
        "std": std,
        "label_names": list(classes),
        "capsctl_version": meta.get("capsctl_version") or __version__,
        "model_config": raw_model,
        "preset": preset,
    }
    if norm.get("name"):
        config["normalization"] = norm["name"]
    for key, value in meta.items():
        if key not in config and key not in _DROPPED and key not in _RENAMED:
            config[key] = value
    return config


def _bad_config(path: Path, key: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: {key} {what}; the folder is damaged or was not written by capsctl: "
        "export it again"
    )


def metadata_from_config(config: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """Inverse of :func:`config_from_metadata`: the checkpoint metadata other commands read.

    ``model_config`` is what the model is rebuilt from (it replaces ``preset.model``);
    ``input_size`` must be ``[C, H, H]``; ``mean``/``std`` one number per channel (or one);
    ``label_names`` one string per class. ``path`` (the ``config.json``) is named in errors.
    """
    raw_model = config.get("model_config")
    if not isinstance(raw_model, dict):
        raise CheckpointError(
            f"{path} has no model_config, so the model cannot be rebuilt; pass a folder "
            "written by capsctl export --format hf"
        )
    size = config.get("input_size")
    if (
        not isinstance(size, list)
        or len(size) != 3
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in size)
        or size[1] != size[2]
    ):
        raise _bad_config(path, "input_size", f"is {size!r}, not [channels, size, size]")
    channels = size[0]
    norm: dict[str, Any] = {}
    if isinstance(config.get("normalization"), str):
        norm["name"] = config["normalization"]
    for key in ("mean", "std"):
        values = config.get(key)
        if (
            not isinstance(values, list)
            or len(values) not in (1, channels)
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        ):
            raise _bad_config(path, key, f"is {values!r}, not {channels} number(s)")
        norm[key] = [float(v) for v in values]
    labels = config.get("label_names")
    num_classes = raw_model.get("num_classes")
    if (
        not isinstance(labels, list)
        or not all(isinstance(v, str) for v in labels)
        or (isinstance(num_classes, int) and len(labels) != num_classes)
    ):
        raise _bad_config(path, "label_names", f"is not a list of {num_classes} class names")
    preset = config.get("preset")
    preset = dict(preset) if isinstance(preset, dict) else {}
    preset["model"] = raw_model
    meta = {k: v for k, v in config.items() if k not in _CONFIG_ONLY}
    meta.update(
        {
            "preset": preset,
            "classes": list(labels),
            "normalization": norm,
            "input_size": size[1],
            "in_channels": channels,
        }
    )
    return meta


# --------------------------------------------------------------------------------------------
# Reading a folder (called by capsctl.checkpoint for folder paths)
# --------------------------------------------------------------------------------------------


def _folder_files(folder: Path) -> tuple[Path, Path]:
    weights, config = folder / WEIGHTS_NAME, folder / CONFIG_NAME
    has_weights, has_config = weights.is_file(), config.is_file()
    if not has_weights and not has_config:
        raise CheckpointError(
            f"{folder} is a folder, not a checkpoint file or a model folder (it has no "
            f"{CONFIG_NAME} and {WEIGHTS_NAME}); pass a .safetensors checkpoint or a folder "
            "written by capsctl export --format hf"
        )
    if not has_config or not has_weights:
        missing = CONFIG_NAME if not has_config else WEIGHTS_NAME
        raise CheckpointError(
            f"{folder} is an incomplete model folder: {missing} is missing; copy or export "
            "the folder again"
        )
    return weights, config


def read_folder_metadata(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint metadata of a model folder (from its ``config.json``; no tensor is read).

    The weights file's header is validated too, so a damaged folder is reported here.
    """
    from capsctl.checkpoint import read_header

    weights, config_path = _folder_files(Path(folder))
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) else "not valid JSON"
        raise CheckpointError(
            f"cannot read {config_path}: {reason}; copy or export the folder again"
        ) from None
    if not isinstance(config, dict):
        raise _bad_config(config_path, "the file", "is not a JSON object")
    read_header(weights)
    return metadata_from_config(config, config_path)


def load_folder_tensors(
    folder: str | os.PathLike[str], device: str | torch.device = "cpu"
) -> dict[str, Tensor]:
    """The weights of a model folder under checkpoint names (``model.<state_dict key>``)."""
    from capsctl.checkpoint import load_tensors

    weights, _ = _folder_files(Path(folder))
    return {_MODEL_PREFIX + k: v for k, v in load_tensors(weights, device).items()}


def check_folder_state(folder: Path, model: nn.Module, state: Mapping[str, Tensor]) -> None:
    """Strict loading: every tensor of the model present, none extra, every shape right.

    ``state`` holds the tensors of ``model.safetensors`` under their stored names. Raises a
    one-line :class:`CheckpointError` naming the first problems.
    """
    expected = model.state_dict()
    problems = [f"missing tensor {k!r}" for k in expected if k not in state]
    problems += [f"unexpected tensor {k!r}" for k in state if k not in expected]
    problems += [
        f"tensor {k!r} has shape {list(state[k].shape)}, the model needs {list(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if problems:
        shown = ", ".join(problems[:3])
        more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise CheckpointError(
            f"{folder / WEIGHTS_NAME} does not match the model of {CONFIG_NAME} "
            f"({shown}{more}); the folder is inconsistent: export it again"
        )


# --------------------------------------------------------------------------------------------
# Model card
# --------------------------------------------------------------------------------------------


def _dataset_names(name: str) -> tuple[str, str | None]:
    """``(display name, Hub dataset id or None)`` of a capsctl dataset name."""
    from capsctl.data.catalog import base_name

    base = base_name(name)
    variant = name[len(base) :].strip("[]")
    if base.startswith("imagefolder:"):
        return f"image folder {base[len('imagefolder:') :]}", None
    display, hub_id = _DATASETS.get(base, (base, None))
    if variant:
        return f"{display} ({variant})", None
    return display, hub_id


def _test_result(meta: Mapping[str, Any]) -> dict[str, Any] | None:
    test = meta.get("test")
    if isinstance(test, dict) and isinstance(test.get("accuracy"), (int, float)):
        return test
    return None


def _metric_name(test: Mapping[str, Any]) -> str:
    """``top-1``, or the name of the evaluation's metric (e.g. a multi-label exact match)."""
    return str(test.get("metric") or "top-1")


def _pct(value: float) -> str:
    return f"{100 * value:.2f}%"


def _layers_text(raw_model: Mapping[str, Any]) -> str:
    layers = raw_model.get("layers") or []
    if not layers:
        return "none"
    parts = []
    for spec in layers:
        kind = spec.get("kind", "?")
        shape = f", {spec.get('kernel')}x{spec.get('kernel')} stride {spec.get('stride')}"
        parts.append(
            f"{kind} ({spec.get('types')} types, pose dim {spec.get('pose_dim')}"
            f"{shape if kind == 'conv' else ''})"
        )
    return "; ".join(parts)


def _front_matter(
    meta: Mapping[str, Any], name: str, license: str, test: Mapping[str, Any] | None
) -> dict[str, Any]:
    arch = str((meta.get("preset") or {}).get("model", {}).get("arch", "capsnet"))
    tags = ["image-classification", "capsctl", "pytorch", "safetensors"]
    if arch.startswith("capsnet"):
        tags.insert(1, "capsule-network")
    if arch == "capsnet":
        tags.insert(2, "inverted-dot-product-attention-routing")
    front: dict[str, Any] = {
        "library_name": "capsctl",
        "license": license,
        "pipeline_tag": "image-classification",
        "tags": tags,
    }
    _, train_id = _dataset_names(str(meta.get("dataset") or ""))
    if train_id:
        front["datasets"] = [train_id]
    front["metrics"] = ["accuracy"]
    if test is not None:
        test_dataset = str(test.get("dataset") or meta.get("dataset") or "unknown")
        display, hub_id = _dataset_names(test_dataset)
        metric = _metric_name(test)
        front["model-index"] = [
            {
                "name": name,
                "results": [
                    {
                        "task": {"type": "image-classification", "name": "Image Classification"},
                        "dataset": {
                            "name": display,
                            "type": hub_id or test_dataset,
                            "split": str(test.get("split") or "test"),
                        },
                        "metrics": [
                            {
                                "type": "accuracy",
                                "value": round(100 * float(test["accuracy"]), 2),
                                "name": f"{metric[:1].upper()}{metric[1:]} accuracy (%)",
                                "verified": False,
                            }
                        ],
                    }
                ],
            }
        ]
    return front


def model_card(
    meta: Mapping[str, Any],
    *,
    name: str,
    params: Mapping[str, int],
    gflops: float | None,
    license: str = DEFAULT_LICENSE,
    repo_id: str | None = None,
) -> str:
    """The ``README.md`` of a model folder: YAML front matter (``model-index``) and the card.

    ``meta``: the checkpoint metadata; ``name``: the model's name (title, ``model-index``);
    ``params``: :func:`capsctl.models.parameter_counts`; ``gflops``: GFLOPs per image
    (:func:`capsctl.compare.count_flops`: 2 x multiply-accumulates); ``license``: the licence
    id written to the front matter; ``repo_id``: the name to load it by in the usage example
    (default ``name``). The accuracy is the checkpoint's stored test result (written at the end
    of training); without one the card says the model was not evaluated.
    """
    import yaml

    test = _test_result(meta)
    front = _front_matter(meta, name, license, test)
    preset = meta.get("preset") or {}
    raw_model = preset.get("model") or {}
    data = preset.get("data") or {}
    arch = str(raw_model.get("arch", "capsnet"))
    dataset = str(meta.get("dataset") or data.get("dataset") or "unknown")
    display, _ = _dataset_names(dataset)
    norm = meta.get("normalization") or {}
    channels = meta.get("in_channels") or raw_model.get("in_channels")
    size = meta.get("input_size") or raw_model.get("input_size")
    classes = list(meta.get("classes") or [])
    load_as = repo_id or name
    described = _ARCH_TEXT.get(arch, f"a `{arch}` model")
    registered = _architecture(raw_model)
    architecture = f"`{arch}`" if registered == arch else f"`{registered}` (arch `{arch}`)"
    folder = "DIR" if repo_id else name

    lines = ["---", yaml.safe_dump(front, sort_keys=False, allow_unicode=True).rstrip(), "---"]
    lines += [
        "",
        f"# {name}",
        "",
        f"An image classifier trained with capsctl on {display}. It is {described}.",
        "",
        f"Paper: {_PAPER}.",
        "",
        "## Model",
        "",
        "| | |",
        "|---|---|",
        f"| architecture | {architecture} |",
    ]
    if arch != "resnet18":
        lines += [
            f"| backbone | {raw_model.get('backbone')} |",
            f"| primary capsules | {raw_model.get('primary_types')} types, pose dim "
            f"{raw_model.get('primary_dim')} |",
            f"| capsule layers | {_layers_text(raw_model)} |",
        ]
    if arch.startswith("capsnet"):
        lines.append(
            f"| routing | {raw_model.get('iterations')} iterations, {raw_model.get('routing')} |"
        )
    total = params.get("total")
    split = ""
    if params.get("capsules"):
        split = f" ({params.get('backbone', 0):,} backbone, {params['capsules']:,} capsules)"
    flops = "not measured" if gflops is None else f"{gflops:.4g}"
    lines += [
        f"| parameters | {total:,}{split} |" if isinstance(total, int) else "| parameters | - |",
        f"| GFLOPs per image | {flops} |",
        f"| input | {channels} x {size} x {size} |",
        f"| classes | {len(classes)} |",
        "",
        "GFLOPs count one forward pass of one image as 2 x multiply-accumulates, convolutions "
        "and matrix products only (`torch.utils.flop_counter`, as `capsctl compare` reports "
        "them); elementwise operations are not counted.",
        "",
        "## Evaluation",
        "",
    ]
    if test is None:
        lines += [
            "Not evaluated: the checkpoint holds no test result. Measure it with "
            f"`capsctl eval {folder}`.",
        ]
    else:
        metric = _metric_name(test)
        count = test.get("count")
        images = f"{count:,} images" if isinstance(count, int) else "all images"
        test_display, _ = _dataset_names(str(test.get("dataset") or dataset))
        top5 = test.get("top5")
        extra = ""
        if metric == "top-1" and isinstance(top5, (int, float)):
            extra = f", top-5 {_pct(float(top5))}"
        metrics = meta.get("metrics") if isinstance(meta.get("metrics"), dict) else {}
        val = metrics.get("val_accuracy")
        selection = (
            f"the weights of the epoch with the best validation accuracy (epoch "
            f"{meta.get('epoch')}, {_pct(float(val))} on {data.get('val_size', '?'):,} images "
            "held out from the training set)"
            if isinstance(val, (int, float)) and isinstance(data.get("val_size"), int)
            else f"the weights saved at epoch {meta.get('epoch')}"
        )
        lines += [
            f"**{metric} accuracy {_pct(float(test['accuracy']))}{extra}** on the "
            f"{test.get('split', 'test')} split of {test_display}: {images}.",
            "",
            f"Measured by capsctl at the end of training: {selection} were evaluated once on "
            "the whole test split, which was used neither for training nor for choosing the "
            f"epoch. Single crop at {size} x {size}, no test-time augmentation. Reproduce it "
            f"with `capsctl eval {folder}`.",
        ]
    mean, std = norm.get("mean"), norm.get("std")
    lines += [
        "",
        "## Preprocessing",
        "",
        f"Images of {channels} x {size} x {size} pixels, scaled to [0, 1], then normalized "
        f"per channel with mean {mean} and std {std}. Classes (logit order): "
        + ", ".join(f"`{c}`" for c in classes)
        + ".",
        "",
        "## How to use",
        "",
        "```python",
        "import capsctl",
        "",
        f'model = capsctl.from_pretrained("{load_as}")  # in eval mode',
        "cfg = model.pretrained_cfg  # input_size, mean, std, label_names, test result",
        "logits = model(images)  # images: float [batch, C, H, W], normalized as above",
        "```",
        "",
        "A Hub id (`org/name`) needs `pip install 'capsctl[hub]'` and is cached by "
        "`huggingface_hub` (offline with `HF_HUB_OFFLINE=1` once cached). Every capsctl "
        "command that takes a checkpoint also takes a local copy of this folder"
        + (" (`DIR`)" if repo_id else "")
        + ":",
        "",
        "```bash",
        f"capsctl eval {folder}",
        f"capsctl inspect-routing {folder}",
        f"capsctl export {folder} --format onnx",
        "```",
        "",
        "Files: `model.safetensors` (weights only), `config.json` (architecture, "
        "preprocessing, class names, the full model configuration and training preset).",
        "",
        "## Licence",
        "",
        f"The weights are released under the `{license}` licence. capsctl is MIT-licensed; the "
        f"training data ({display}) keeps its own terms.",
        "",
        "## Citation",
        "",
        "```bibtex",
        _BIBTEX,
        "```",
        "",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------


def _weights_bytes(state: Mapping[str, Tensor], path: Path) -> bytes:
    from safetensors import SafetensorError
    from safetensors.torch import save

    from capsctl.checkpoint import _prepare_tensors

    try:
        return save(_prepare_tensors(state, path), metadata={"format": "pt"})
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"could not write {path}: {e}") from None


def _check_output_folder(out: Path, ckpt: Path, overwrite: bool) -> None:
    from capsctl.export import _check_writable_folder

    if out.resolve() == ckpt.resolve():
        raise UsageError(
            f"the export would overwrite the checkpoint {ckpt}; pick another output folder"
        )
    if out.exists() and not out.is_dir():
        raise CapsctlError(
            f"cannot write the model folder {out}: it exists and is not a folder; pick another "
            "output folder"
        )
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise CapsctlError(
                f"cannot write the model folder {out}: it exists and is not empty; remove it "
                "or pick another output folder"
            )
        if ckpt.resolve().is_relative_to(out.resolve()):
            raise UsageError(
                f"the export would replace {out}, which holds the checkpoint {ckpt}; pick "
                "another output folder"
            )
    _check_writable_folder(out)


def _publish_folder(tmp: Path, out: Path) -> None:
    """Move the finished folder ``tmp`` to ``out`` (an existing ``out`` is replaced)."""
    old: Path | None = None
    emptied = False
    try:
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
            emptied = True
        elif out.exists():
            old = out.with_name(f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.old")
            os.rename(out, old)
        os.rename(tmp, out)
    except OSError as e:
        with contextlib.suppress(OSError):
            if old is not None and not out.exists():
                os.rename(old, out)
            elif emptied and not out.exists():
                out.mkdir()
        raise CapsctlError(
            f"cannot write the model folder {out}: {e.strerror or e}; nothing was changed"
        ) from None
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export_model_folder(
    ckpt: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    *,
    check_images: Tensor | None = None,
    check_description: str | None = None,
    overwrite: bool = False,
    license: str = DEFAULT_LICENSE,
    name: str | None = None,
    repo_id: str | None = None,
    on_event: EventFn = None,
) -> ExportResult:
    """Write checkpoint ``ckpt`` as a model folder ``out`` and check that it loads back exactly.

    ``out`` (default ``<folder>/<stem>-hf`` beside the checkpoint) is created as a whole: the
    files are written into a temporary folder next to it, the folder is loaded back with
    :func:`capsctl.checkpoint.load_checkpoint` and its logits on the check images (as in
    :func:`capsctl.export.export_checkpoint`) must equal the checkpoint's exactly, and only then
    is it renamed into place. An existing empty folder is filled; a non-empty one is refused
    unless ``overwrite`` (then it is replaced). ``license``, ``name`` (default: the folder's
    name) and ``repo_id`` (default: ``name``) go into the model card.
    """
    import torch

    from capsctl.checkpoint import load_checkpoint, load_tensors, read_metadata
    from capsctl.compare import count_flops
    from capsctl.export import (
        ExportResult,
        _check_inputs,
        _emit,
        _fail_parity,
        _max_diff,
        _parity_batches,
        default_output_path,
    )
    from capsctl.models import parameter_counts

    ckpt = Path(ckpt)
    meta = read_metadata(ckpt)
    out = default_output_path(ckpt, "hf") if out is None else Path(out)
    _check_output_folder(out, ckpt, overwrite)

    _emit(on_event, "export_load", checkpoint=str(ckpt), format="hf")
    model, meta = load_checkpoint(ckpt)
    config = config_from_metadata(meta)
    channels, size = config["input_size"][0], config["input_size"][1]
    images, checked_on = _check_inputs(check_images, channels, size, check_description)
    batches = _parity_batches(images)
    with torch.no_grad():
        refs = [model(b) for b in batches]
    state = {
        k[len(_MODEL_PREFIX) :]: v
        for k, v in load_tensors(ckpt).items()
        if k.startswith(_MODEL_PREFIX)
    }
    params = parameter_counts(model)
    gflops = count_flops(model, (channels, size, size))
    card_name = name or out.name
    card = model_card(
        meta, name=card_name, params=params, gflops=gflops, license=license, repo_id=repo_id
    )

    _emit(on_event, "export_build", format="hf", path=str(out))
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    start = time.perf_counter()
    try:
        tmp.mkdir()
        write_atomic(tmp / WEIGHTS_NAME, _weights_bytes(state, out / WEIGHTS_NAME))
        text = json.dumps(config, indent=2, ensure_ascii=False, default=str) + "\n"
        write_text_atomic(tmp / CONFIG_NAME, text)
        write_text_atomic(tmp / CARD_NAME, card)
        seconds = time.perf_counter() - start
        start = time.perf_counter()
        loaded, _ = load_checkpoint(tmp)
        with torch.no_grad():
            outs = [loaded(b) for b in batches]
        diff = _max_diff(outs, refs)
        check_s = time.perf_counter() - start
        batch_sizes = [int(b.shape[0]) for b in batches]
        _emit(
            on_event,
            "export_check",
            format="hf",
            max_abs_diff=diff,
            batch_sizes=batch_sizes,
            checked_on=checked_on,
        )
        if not diff <= 0.0:  # also catches NaN
            raise _fail_parity("hf", diff, 0.0, checked_on)
        _publish_folder(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    size_bytes = sum((out / f).stat().st_size for f in FOLDER_FILES)
    _emit(
        on_event, "export_done", format="hf", path=str(out), size_bytes=size_bytes, seconds=seconds
    )
    return ExportResult(
        path=out,
        format="hf",
        sidecar=out / CONFIG_NAME,
        max_abs_diff=diff,
        checked_on=checked_on,
        size_bytes=size_bytes,
        batch_sizes=batch_sizes,
        seconds=seconds,
        check_seconds=check_s,
        files=list(FOLDER_FILES),
    )


# --------------------------------------------------------------------------------------------
# Loading: from_pretrained
# --------------------------------------------------------------------------------------------


def _from_hub(
    repo_id: str,
    *,
    revision: str | None,
    cache_dir: str | os.PathLike[str] | None,
    local_files_only: bool | None,
) -> Path:
    from capsctl import __version__

    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.utils import (
            EntryNotFoundError,
            GatedRepoError,
            HfHubHTTPError,
            HFValidationError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise CapsctlError(
            f"{repo_id!r} is not a local path; loading it from the Hugging Face Hub {_HUB_MISSING}"
        ) from None
    at = f"{repo_id}@{revision}" if revision else repo_id
    files = []
    for filename in (CONFIG_NAME, WEIGHTS_NAME):
        try:
            files.append(
                Path(
                    hf_hub_download(
                        repo_id,
                        filename,
                        revision=revision,
                        cache_dir=cache_dir,
                        local_files_only=bool(local_files_only),
                        library_name="capsctl",
                        library_version=__version__,
                    )
                )
            )
        except LocalEntryNotFoundError:
            raise CheckpointError(
                f"{at}: {filename} is not in the Hugging Face cache and downloading is off or "
                "failed (HF_HUB_OFFLINE / local_files_only / no network); connect once to "
                "download it, or pass a local folder"
            ) from None
        except GatedRepoError:
            raise CheckpointError(
                f"{at} is gated on the Hugging Face Hub; accept its terms on the Hub and log "
                "in (hf auth login)"
            ) from None
        except RepositoryNotFoundError:
            raise CheckpointError(
                f"{at}: no such model on the Hugging Face Hub (or it is private: log in with "
                "hf auth login); check the id"
            ) from None
        except RevisionNotFoundError:
            raise CheckpointError(
                f"{at}: the Hub model has no revision {revision!r}; check the revision"
            ) from None
        except EntryNotFoundError:
            raise CheckpointError(
                f"{at} has no {filename}, so it is not a capsctl model folder; pass a model "
                "exported with capsctl export --format hf"
            ) from None
        except HFValidationError as e:
            raise UsageError(f"{repo_id!r} is not a valid Hub id ({e}); use org/name") from None
        except (HfHubHTTPError, OSError) as e:
            text = " ".join(str(e).split())
            raise CheckpointError(
                f"cannot fetch {filename} of {at} from the Hugging Face Hub ({text}); retry, or "
                "set HF_HUB_OFFLINE=1 to use the cache"
            ) from None
    if files[0].parent != files[1].parent:  # pragma: no cover - same revision, same snapshot
        raise CheckpointError(f"{at}: the cached files belong to different revisions; retry")
    return files[0].parent


def resolve_pretrained(
    name_or_path: str | os.PathLike[str],
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    local_files_only: bool | None = None,
) -> Path:
    """The local path of a model: an existing folder or file as it is, a Hub id via the cache.

    A string ``org/name`` that is not an existing path is fetched with ``huggingface_hub``
    (``config.json`` and ``model.safetensors`` of ``revision``, default the main branch) into
    its cache (``cache_dir``, default ``HF_HUB_CACHE``); with ``local_files_only=True`` or
    ``HF_HUB_OFFLINE=1`` only the cache is used. Returns the snapshot folder.
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        if revision is not None:
            raise UsageError(
                f"revision={revision!r} applies to Hub ids only, and {path} is a local path"
            )
        return path
    text = str(name_or_path)
    if not _HUB_ID.match(text):
        raise CheckpointError(
            f"{text} does not exist; pass a model folder, a .safetensors checkpoint or a Hub "
            "id like org/name"
        )
    return _from_hub(
        text, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only
    )


def from_pretrained(
    name_or_path: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    local_files_only: bool | None = None,
) -> nn.Module:
    """Load a model, ready for inference, like ``timm.create_model(..., pretrained=True)``.

    ``name_or_path``: a model folder (``capsctl export --format hf``), a capsctl
    ``.safetensors`` checkpoint, or a Hugging Face Hub id ``org/name`` (needs
    ``pip install 'capsctl[hub]'``; see :func:`resolve_pretrained` for ``revision``,
    ``cache_dir`` and ``local_files_only``). Returns the model on ``device`` in eval mode;
    ``model.pretrained_cfg`` is the folder's ``config.json`` as a dict (timm's attribute name:
    ``input_size`` ``[C, H, W]``, ``mean``, ``std``, ``label_names``, ``model_config``,
    ``test``, ...). The checkpoint metadata as the other capsctl functions use it comes with
    ``capsctl.load_checkpoint(path)``, which returns ``(model, metadata)``.

    Loading is strict: a missing or unexpected tensor raises
    :class:`~capsctl.errors.CheckpointError` naming it.
    """
    from capsctl.checkpoint import load_checkpoint

    path = resolve_pretrained(
        name_or_path, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only
    )
    model, meta = load_checkpoint(path, device=device)
    model.pretrained_cfg = config_from_metadata(meta)
    return model
