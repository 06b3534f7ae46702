"""Shared pytest fixtures and helpers: the CLI runner (:func:`run_cli`, imported by the tests
with ``from conftest import run_cli``), one tiny trained run for the whole session
(:func:`tiny_trained_run`), tiny untrained checkpoints, the data folder, the routing backend."""

from __future__ import annotations

import os

# Triton's interpreter runs the Triton kernels on the CPU (tests/layers/backend/test_triton_*.py);
# it must be asked for before anything imports Triton (torch._dynamo does), so here, first.
os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402

import pytest  # noqa: E402
from tiny import tiny_args  # noqa: E402

#: The repository's root folder.
ROOT = Path(__file__).resolve().parents[1]

#: Steps per epoch of the session's tiny trained run (one epoch, batch 16).
TINY_RUN_STEPS = 20


def require_native() -> None:
    """Skip a test of the compiled CPU loops where they are not built; fail instead where
    ``CAPSCTL_REQUIRE_NATIVE=1`` says they must be (CI)."""
    from capsctl.layers.backend import native

    status = native.native_status()
    if not status.startswith("on"):
        if os.environ.get("CAPSCTL_REQUIRE_NATIVE") == "1":
            pytest.fail(f"CAPSCTL_REQUIRE_NATIVE=1 but the compiled loops are {status}")
        pytest.skip(f"compiled routing loops unavailable: {status}")


def run_cli(capsys: pytest.CaptureFixture[str], args: Sequence[str]) -> tuple[int, str, str]:
    """Run ``capsctl <args>`` in this process: its exit code, stdout and stderr."""
    from capsctl.cli import main

    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` loaded as the module ``name`` (registered in ``sys.modules``, where
    dataclasses and the scripts' own imports of each other look it up)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def fake_finished_run(
    folder: Path,
    seconds: float,
    tests: dict[str, tuple[float, int]],
    *,
    checkpoints: bool = True,
) -> Path:
    """A finished suite pair's folder without training: results (``seconds`` of wall time, two
    epochs at 100 and 300 images/s), test scores ``{test: (accuracy, images)}``, provenance,
    metrics and (dummy) checkpoints."""
    import json

    folder.mkdir(parents=True)
    history = [{"epoch": 1, "images_per_s": 100.0}, {"epoch": 2, "images_per_s": 300.0}]
    res = {"test": {"accuracy": 0.5}, "seconds": seconds, "epochs_done": 2, "history": history}
    (folder / "results.json").write_text(json.dumps(res))
    doc = {"tests": {k: {"accuracy": a, "count": n} for k, (a, n) in tests.items()}}
    (folder / "tests.json").write_text(json.dumps(doc))
    trained = {"trained_by": [{"cpu": "Test CPU", "cores": 4, "commit": "abc"}]}
    (folder / "provenance.json").write_text(json.dumps(trained))
    (folder / "metrics.jsonl").write_text('{"epoch": 1}\n{"epoch": 2}\n')
    if checkpoints:
        (folder / "best.safetensors").write_bytes(b"weights")
        (folder / "last.safetensors").write_bytes(b"weights and optimizer")
    return folder


@pytest.fixture(scope="session")
def tiny_trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run folder of one tiny capsule net trained once per session on the embedded
    Fashion-MNIST subset (the quickstart preset, :func:`tiny.tiny_args`, 20 steps of 16 images,
    one epoch): ``best.safetensors``, ``last.safetensors``, ``metrics.jsonl``,
    ``results.json``... Shared by every test that needs a trained checkpoint: read it, or copy
    it before writing (``shutil.copytree``)."""
    from capsctl.cli import main

    out = tmp_path_factory.mktemp("tiny-run")
    args = ["train", "--preset", "quickstart", *tiny_args(TINY_RUN_STEPS), "--epochs", "1"]
    main([*args, "--out", str(out), "--overwrite", "--json"])
    return out


@pytest.fixture(scope="session")
def data_root() -> Path:
    """The folder of real datasets from ``$CAPSCTL_DATA`` (CI: ``../shared/data``), or skip."""
    value = os.environ.get("CAPSCTL_DATA", "")
    if not value or not Path(value).is_dir():
        pytest.skip("CAPSCTL_DATA not set or its folder is missing")
    return Path(value)


@pytest.fixture(autouse=True)
def _run_in_an_empty_folder(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every test runs in a fresh empty working folder: nothing a test writes by default (such
    as ``runs/<preset>``) lands in the checkout, and nothing left there can change a result."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture(autouse=True)
def _library_logging_as_found() -> Iterator[None]:
    """The ``capsctl`` logger as it was before each test: a command line run in the process
    (:func:`run_cli`) gives it a stderr handler and stops it propagating, which would hide its
    records from every later test's ``caplog``."""
    import logging

    log = logging.getLogger("capsctl")
    handlers, level, propagate = list(log.handlers), log.level, log.propagate
    yield
    log.handlers[:] = handlers
    log.setLevel(level)
    log.propagate = propagate


@pytest.fixture
def eager_routing() -> Iterator[None]:
    """Run the routed and weighted passes as torch code (not the compiled loops of
    capsctl/layers/backend/native.py), for tests of the chunked passes' own tiles and threads."""
    from capsctl.layers import dispatch

    with dispatch.use("chunked"):
        yield


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """A writer of untrained tiny capsule-net checkpoints for the embedded Fashion-MNIST subset
    (28x28 gray, 10 classes; ``classes`` renames them; ``dataset`` names another 28x28 gray
    10-class dataset such as mnist), made in well under a second:
    ``tiny_checkpoint(path=None, classes=None, dataset=None) -> path``."""
    import torch

    from capsctl.checkpoint import model_tensors, save_checkpoint
    from capsctl.config import Preset, preset_to_dict, resolve_config
    from capsctl.data.catalog import FASHION_MNIST_CLASSES
    from capsctl.models import build_model_from_config

    def write(
        path: Path | None = None,
        classes: Sequence[str] | None = None,
        dataset: str | None = None,
    ) -> Path:
        path = tmp_path / "tiny.safetensors" if path is None else path
        cfg = resolve_config(
            {
                "base": "mnist-caps",
                "primary_types": 4,
                "primary_dim": 4,
                "layers": [{"kind": "conv", "types": 4, "pose_dim": 4, "kernel": 3, "stride": 2}],
                "iterations": 2,
            }
        )
        torch.manual_seed(0)
        model = build_model_from_config(cfg)
        preset = Preset(name="tiny", model=cfg)
        preset.data.dataset = dataset or "fashion-mnist-quickstart"
        preset.data.normalization = "fashion-mnist"
        preset.data.val_size = 200
        metadata = {
            "preset": preset_to_dict(preset),
            "classes": list(classes or FASHION_MNIST_CLASSES),
            "normalization": {"name": "fashion-mnist", "mean": [0.286], "std": [0.353]},
            "input_size": cfg.input_size,
            "in_channels": 1,
            "epoch": 1,
        }
        save_checkpoint(path, model_tensors(model), metadata)
        return path

    return write
