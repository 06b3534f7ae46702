"""The ``capsctl`` command line: each command parses its options, makes one library call and
hands the result to a view (:mod:`capsctl.views`).

=====================  ===========================  ==========================================
command                module                       library call
=====================  ===========================  ==========================================
train                  :mod:`capsctl.cli.train`     :func:`capsctl.training.train_from_preset`
eval, predict          :mod:`capsctl.cli.evaluate`  ``evaluate_checkpoint``, ``predict_images``
models, presets        :mod:`capsctl.cli.catalog`   ``model_summaries``, ``list_presets``
bench, compare         :mod:`capsctl.cli.measure`   ``run_bench``, ``compare``
export, inspect, plot  :mod:`capsctl.cli.artifacts` ``export_checkpoint``, ``inspect_checkpoint``,
                                                    ``plot_runs``
suite                  :mod:`capsctl.cli.suite`     ``run_suite``, ``report_suite``
=====================  ===========================  ==========================================
"""

from __future__ import annotations

# Command modules register their commands on import, in the order ``--help`` lists them.
# isort: off
from capsctl.cli import train  # noqa: F401
from capsctl.cli import evaluate  # noqa: F401
from capsctl.cli import artifacts  # noqa: F401
from capsctl.cli import measure  # noqa: F401
from capsctl.cli import catalog  # noqa: F401
from capsctl.cli import suite  # noqa: F401
from capsctl.cli import robustness  # noqa: F401

# isort: on
from capsctl.cli.app import app, main

__all__ = ["app", "main"]
