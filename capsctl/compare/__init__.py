"""Side-by-side comparison of models: parameters, FLOPs, accuracy, and optionally speed.

:func:`compare` takes registered model names, preset names, aliases (``caps``, ``resnet18``),
``.yaml`` preset files, ``.safetensors`` checkpoints and model folders and returns a
:class:`CompareReport`: one :class:`CompareRow` per target and, when a ResNet-18 is among them,
the :class:`ReferenceRatios` of every other row to it.

- :mod:`capsctl.compare.targets`: what a name or path stands for (:func:`find_target`);
- :mod:`capsctl.compare.flops`: GFLOPs of one forward pass (:func:`count_flops`);
- :mod:`capsctl.compare.published`: published accuracies with their sources (:data:`PUBLISHED`);
- :mod:`capsctl.compare.report`: rows, ratios, JSON and CSV;
- :mod:`capsctl.compare.comparison`: :func:`compare` itself.
"""

from capsctl.compare.comparison import compare
from capsctl.compare.flops import FLOPS_NOTE, count_flops
from capsctl.compare.published import (
    PUBLISHED,
    PublishedResult,
    published_result,
    reference_accuracy,
)
from capsctl.compare.report import (
    CSV_COLUMNS,
    PARAMS_ABOUT_EQUAL,
    CompareReport,
    CompareRow,
    ReferenceRatios,
    reference_ratios,
)
from capsctl.compare.targets import (
    ALIASES,
    SUITES,
    Target,
    find_target,
    resolve_target,
    suite_targets,
)

__all__ = [
    "ALIASES",
    "CSV_COLUMNS",
    "FLOPS_NOTE",
    "PARAMS_ABOUT_EQUAL",
    "PUBLISHED",
    "SUITES",
    "suite_targets",
    "CompareReport",
    "CompareRow",
    "PublishedResult",
    "ReferenceRatios",
    "Target",
    "compare",
    "count_flops",
    "find_target",
    "published_result",
    "reference_accuracy",
    "reference_ratios",
    "resolve_target",
]
