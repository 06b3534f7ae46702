"""Published test accuracies, each with its source, and the configurations they were measured on.

A compare row gets a published figure only when its configuration is the published one
(:func:`published_result`): same architecture, classes, input, routing and T and, for presets
and checkpoints, the same dataset and standard test split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from capsctl.models.spec import ModelConfig

__all__ = ["PUBLISHED", "PublishedResult", "published_result", "reference_accuracy"]

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
