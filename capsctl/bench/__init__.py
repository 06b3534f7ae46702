"""Speed and memory benchmark of models, measured one after another in one process.

:func:`run_bench` builds each model, times training steps and inference passes on synthetic,
seeded inputs, and records the peak memory while the model was measured. It returns one
:class:`BenchRow` per model; speed ratios are relative to ``resnet18`` when it is among the
models. Nothing is printed: progress goes to an optional ``on_event`` callback
(:mod:`capsctl.events`).

- :mod:`capsctl.bench.measure`: :func:`run_bench` and the timing of one model;
- :mod:`capsctl.bench.memory`: peak resident memory (:class:`RssSampler`) and how it is measured;
- :mod:`capsctl.bench.results`: :class:`BenchRow`, ratios, JSON and timm-style CSV.
"""

from capsctl.bench.measure import ROUTING_MODES, ModelSpec, run_bench
from capsctl.bench.memory import RssSampler, current_rss_bytes, release_memory
from capsctl.bench.results import (
    BENCH_CSV_COLUMNS,
    REFERENCE_MODEL,
    BenchRow,
    add_ratios,
    rows_to_csv,
    rows_to_json,
)

__all__ = [
    "BENCH_CSV_COLUMNS",
    "REFERENCE_MODEL",
    "ROUTING_MODES",
    "BenchRow",
    "ModelSpec",
    "RssSampler",
    "add_ratios",
    "current_rss_bytes",
    "release_memory",
    "rows_to_csv",
    "rows_to_json",
    "run_bench",
]
