"""The model card (``README.md``) of a model folder: YAML front matter and the card text.

The front matter holds the test result in the Hugging Face Hub's ``model-index`` form; the
body describes the model, how it was evaluated, its preprocessing and how to load it. Paper:
Tsai, Srivastava, Goh and Salakhutdinov, "Capsules with Inverted Dot-Product Attention
Routing", ICLR 2020, arXiv:2002.04764.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import Any

from capsctl.checkpoint.folder import architecture_name

__all__ = ["DEFAULT_LICENSE", "model_card"]

#: Licence written into model cards unless another is given (capsctl's own licence).
DEFAULT_LICENSE = "mit"

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
    "cnn": (
        "a plain convolutional network with the backbone and layer widths of the capsule "
        "network it is compared with (a baseline of the paper below)"
    ),
    "resnet18": (
        "a ResNet-18 (He et al., CVPR 2016, arXiv:1512.03385) with the CIFAR stem, the "
        "convolutional baseline of the paper below"
    ),
}


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


def _upgraded(raw_model: Any) -> dict[str, Any]:
    """The model mapping of a checkpoint, in today's layout (older files too)."""
    from capsctl.models.spec import ModelConfig

    return ModelConfig.upgrade_mapping(raw_model) if isinstance(raw_model, Mapping) else {}


def _router(raw_model: Mapping[str, Any]) -> Any:
    """The routing algorithm class of a capsule network's mapping, else None."""
    from capsctl.layers.routers import ROUTERS

    if raw_model.get("arch", "capsnet") != "capsnet":
        return None
    router = raw_model.get("router")
    name = router.get("name", "idpa") if isinstance(router, Mapping) else "idpa"
    return ROUTERS.get(str(name))


def _described(raw_model: Mapping[str, Any]) -> str:
    arch = str(raw_model.get("arch", "capsnet"))
    algo = _router(raw_model)
    if algo is not None:
        return f"a capsule network with {algo.summary}"
    return _ARCH_TEXT.get(arch, f"a `{arch}` model")


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
    algo = _router(_upgraded((meta.get("preset") or {}).get("model") or {}))
    tags = ["image-classification", "capsctl", "pytorch", "safetensors"]
    if algo is not None:
        tags[1:1] = ["capsule-network", algo.title.lower().replace(" ", "-")]
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


def _model_table(
    raw_model: Mapping[str, Any],
    params: Mapping[str, int],
    gflops: float | None,
    channels: Any,
    size: Any,
    classes: list[str],
) -> list[str]:
    """The ``## Model`` section: architecture, capsule layers, routing, size and cost."""
    arch = str(raw_model.get("arch", "capsnet"))
    registered = architecture_name(raw_model)
    architecture = f"`{arch}`" if registered == arch else f"`{registered}` (arch `{arch}`)"
    lines = ["## Model", "", "| | |", "|---|---|", f"| architecture | {architecture} |"]
    if arch != "resnet18":
        width = raw_model.get("backbone_width")
        k, stride = raw_model.get("primary_kernel", 1), raw_model.get("primary_stride", 1)
        conv = f", {k}x{k} conv of stride {stride}" if (k, stride) != (1, 1) else ""
        lines += [
            f"| backbone | {raw_model.get('backbone')}"
            f"{f', {width} channels' if width is not None else ''} |",
            f"| primary capsules | {raw_model.get('primary_types')} types, pose dim "
            f"{raw_model.get('primary_dim')}{conv} |",
            f"| capsule layers | {_layers_text(raw_model)} |",
        ]
    algo = _router(raw_model)
    if algo is not None:
        router = dict(raw_model.get("router") or {})
        settings = ", ".join(f"{k} {v}" for k, v in router.items() if k != "name")
        lines.append(f"| routing | {algo.title}{': ' + settings if settings else ''} |")
    total = params.get("total")
    split = ""
    if params.get("capsules"):
        split = f" ({params.get('backbone', 0):,} backbone, {params['capsules']:,} capsules)"
    flops = "not measured" if gflops is None else f"{gflops:.4g}"
    return lines + [
        f"| parameters | {total:,}{split} |" if isinstance(total, int) else "| parameters | - |",
        f"| GFLOPs per image | {flops} |",
        f"| input | {channels} x {size} x {size} |",
        f"| classes | {len(classes)} |",
        "",
        "GFLOPs count one forward pass of one image as 2 x multiply-accumulates, convolutions "
        "and matrix products only (`torch.utils.flop_counter`, as `capsctl compare` reports "
        "them); elementwise operations are not counted.",
    ]


def _evaluation(
    meta: Mapping[str, Any], test: Mapping[str, Any] | None, dataset: str, size: Any, folder: str
) -> list[str]:
    """The ``## Evaluation`` section: the stored test result and how it was measured."""
    lines = ["## Evaluation", ""]
    if test is None:
        return lines + [
            "Not evaluated: the checkpoint holds no test result. Measure it with "
            f"`capsctl eval {folder}`.",
        ]
    data = (meta.get("preset") or {}).get("data") or {}
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
    return lines + [
        f"**{metric} accuracy {_pct(float(test['accuracy']))}{extra}** on the "
        f"{test.get('split', 'test')} split of {test_display}: {images}.",
        "",
        f"Measured by capsctl at the end of training: {selection} were evaluated once on "
        "the whole test split, which was used neither for training nor for choosing the "
        f"epoch. Single crop at {size} x {size}, no test-time augmentation. Reproduce it "
        f"with `capsctl eval {folder}`.",
    ]


def _preprocessing(
    norm: Mapping[str, Any], channels: Any, size: Any, classes: list[str]
) -> list[str]:
    """The ``## Preprocessing`` section: input size, normalization, class order."""
    return [
        "## Preprocessing",
        "",
        f"Images of {channels} x {size} x {size} pixels, scaled to [0, 1], then normalized "
        f"per channel with mean {norm.get('mean')} and std {norm.get('std')}. Classes (logit "
        "order): " + ", ".join(f"`{c}`" for c in classes) + ".",
    ]


def _usage(load_as: str, folder: str, local_copy: bool) -> list[str]:
    """The ``## How to use`` section: Python and command-line examples."""
    return [
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
        + (" (`DIR`)" if local_copy else "")
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
    ]


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
    (:func:`capsctl.compare.flops.count_flops`: 2 x multiply-accumulates); ``license``: the
    licence id written to the front matter; ``repo_id``: the name to load it by in the usage
    example (default ``name``). The accuracy is the checkpoint's stored test result (written
    at the end of training); without one the card says the model was not evaluated.
    """
    import yaml

    test = _test_result(meta)
    front = _front_matter(meta, name, license, test)
    preset = meta.get("preset") or {}
    raw_model = _upgraded(preset.get("model") or {})
    dataset = str(meta.get("dataset") or (preset.get("data") or {}).get("dataset") or "unknown")
    display, _ = _dataset_names(dataset)
    channels = meta.get("in_channels") or raw_model.get("in_channels")
    size = meta.get("input_size") or raw_model.get("input_size")
    classes = list(meta.get("classes") or [])
    described = _described(raw_model)
    folder = "DIR" if repo_id else shlex.quote(name)  # a word of the card's shell commands
    sections = [
        ["---", yaml.safe_dump(front, sort_keys=False, allow_unicode=True).rstrip(), "---"],
        [f"# {name}"],
        [f"An image classifier trained with capsctl on {display}. It is {described}."],
        [f"Paper: {_PAPER}."],
        _model_table(raw_model, params, gflops, channels, size, classes),
        _evaluation(meta, test, dataset, size, folder),
        _preprocessing(meta.get("normalization") or {}, channels, size, classes),
        _usage(repo_id or name, folder, local_copy=bool(repo_id)),
        ["## Licence"],
        [
            f"The weights are released under the `{license}` licence. capsctl is MIT-licensed; "
            f"the training data ({display}) keeps its own terms."
        ],
        ["## Citation"],
        ["```bibtex", _BIBTEX, "```"],
    ]
    return "\n\n".join("\n".join(lines) for lines in sections) + "\n"
