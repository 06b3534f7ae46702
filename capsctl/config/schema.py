"""The preset schema: dataclasses for data, augmentation, training and logging, and their checks.

Every dataclass here defines ``validate(self, path)``, which checks value ranges and raises a
:class:`~capsctl.errors.ConfigError` ``"<dotted path>: <what is wrong>"``. The model
dataclasses live in :mod:`capsctl.models.spec`; their range checks are here, in
:data:`VALIDATORS`. :func:`capsctl.config.convert.from_dict` runs both kinds of check.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from capsctl.data.catalog import NORMALIZATION, dataset_info
from capsctl.errors import CapsctlError, ConfigError
from capsctl.models.spec import WIDTH_BACKBONES, CapsLayerSpec, ModelConfig
from capsctl.numbers import MAX_BATCH, MAX_EPOCHS, MAX_ITERATIONS, MAX_LR, MAX_SECONDS

__all__ = [
    "LIMITS",
    "VALIDATORS",
    "AugmentConfig",
    "DataConfig",
    "LogConfig",
    "Preset",
    "TrainConfig",
    "check",
    "check_limit",
    "join_path",
]


def check(ok: bool, path: str, message: str) -> None:
    """Raise a :class:`ConfigError` ``"<path>: <message>"`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{path}: {message}")


def join_path(path: str, name: str) -> str:
    """``path.name``, or ``name`` at the top level (``path == ""``)."""
    return f"{path}.{name}" if path else name


def _is_square(n: int) -> bool:
    return n >= 1 and math.isqrt(n) ** 2 == n


#: Largest accepted sizes: far above any model or batch capsctl trains, low enough that a typo
#: or a forged checkpoint's stored preset is refused before it sizes an allocation or a loop.
LIMITS: dict[str, int] = {
    "num_classes": 100_000,
    "in_channels": 64,
    "input_size": 1024,
    "crop_padding": 1024,
    "primary_types": 4096,
    "primary_dim": 1024,
    "primary_kernel": 64,
    "primary_stride": 64,
    "backbone_width": 16384,
    "types": 4096,
    "pose_dim": 1024,
    "class_pose_dim": 1024,
    "kernel": 64,
    "stride": 64,
    "layers": 64,
    "iterations": MAX_ITERATIONS,
    "batch_size": MAX_BATCH,
    "eval_batch_size": MAX_BATCH,
}


def check_limit(value: int, path: str, name: str) -> None:
    """ConfigError ``"<path>.<name>: must be <= <limit>"`` when ``value`` exceeds
    :data:`LIMITS` [name]."""
    limit = LIMITS[name]
    check(value <= limit, join_path(path, name), f"must be <= {limit}, got {value}")


@dataclass
class AugmentConfig:
    """Training-time augmentation: random crop with ``crop_padding`` pixels, horizontal flips;
    and at validation and test, ``test_flip``: the outputs on each image and on its mirror
    image are averaged (test-time augmentation)."""

    crop_padding: int = 4
    hflip: bool = True
    test_flip: bool = False

    def validate(self, path: str) -> None:
        """Check value ranges; ``path`` is this object's dotted path."""
        check(
            self.crop_padding >= 0,
            join_path(path, "crop_padding"),
            f"must be >= 0 (0 disables cropping), got {self.crop_padding}",
        )
        check_limit(self.crop_padding, path, "crop_padding")


@dataclass
class DataConfig:
    """Which data set to use and how to prepare it.

    ``dataset``: ``cifar10``, ``cifar100``, ``mnist``, ``fashion-mnist``,
    ``fashion-mnist-quickstart`` or ``imagefolder:<path>``. ``test_file`` picks one test file
    in npz folders holding several. ``val_size`` images are held out from the training set
    (seeded); 0 means no validation split. ``normalization`` names an entry of
    ``capsctl.data.NORMALIZATION`` (or a dataset, standing for its normalization). Names are
    checked against ``capsctl.data.catalog``.
    """

    dataset: str = "cifar10"
    data_dir: str | None = None
    test_file: str | None = None
    val_size: int = 5000
    normalization: str = "cifar10"
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    download: bool = True

    def validate(self, path: str) -> None:
        """Check value ranges and names; ``path`` is this object's dotted path."""
        check(bool(self.dataset.strip()), join_path(path, "dataset"), "must not be empty")
        if self.dataset.startswith("imagefolder:"):
            check(
                bool(self.dataset[len("imagefolder:") :].strip()),
                join_path(path, "dataset"),
                "imagefolder needs a folder, e.g. imagefolder:/data/images",
            )
        check(
            self.val_size >= 0,
            join_path(path, "val_size"),
            f"must be >= 0 (0 = no validation split), got {self.val_size}",
        )
        self._check_catalog_names(path)

    def _check_catalog_names(self, path: str) -> None:
        """``dataset`` and ``normalization`` must be known to ``capsctl.data.catalog``."""
        try:
            dataset_info(self.dataset)
        except CapsctlError as e:
            raise ConfigError(f"{join_path(path, 'dataset')}: {e}") from None
        if self.normalization in NORMALIZATION:
            return
        try:  # a dataset name stands for that dataset's normalization
            dataset_info(self.normalization)
        except CapsctlError:
            raise ConfigError(
                f"{join_path(path, 'normalization')}: unknown normalization "
                f"{self.normalization!r}; expected one of {', '.join(NORMALIZATION)} "
                "or a dataset name"
            ) from None


@dataclass
class TrainConfig:
    """Optimisation settings. The defaults are the CIFAR recipe of the capsule-network paper
    (Tsai et al., "Capsules with Inverted Dot-Product Attention Routing", ICLR 2020,
    arXiv:2002.04764).

    ``time_limit`` (seconds) is the whole run's wall-time budget: the schedule advances by
    steps or by the clock, whichever is further, and training stops mid-epoch in time for the
    final validation and test (capsctl/training/budget.py);
    ``steps_per_epoch`` caps the batches per epoch (smoke tests, quick runs);
    ``final_test: false`` ends the run without touching the test set (a learning-rate tuning
    run, judged on its validation split: capsctl/suites/tuning.py);
    ``amp``: bf16 autocast (``true``), float32 (``false``), or bf16 where the device trains
    faster in it (``auto``, the default: a CPU with AMX, a GPU with bf16; not a CPU with
    AVX-512 BF16 alone, where bf16 trains slower; capsctl/devices.py).
    """

    # Keys that older versions wrote and that are ignored when read: ``workers`` never had an
    # effect (batches are gathered and augmented on the device inside the training process).
    RETIRED_FIELDS: ClassVar[tuple[str, ...]] = ("workers",)

    epochs: int = 350
    batch_size: int = 128
    eval_batch_size: int = 100
    optimizer: Literal["sgd", "adamw"] = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-4
    schedule: Literal["multistep", "cosine", "onecycle", "constant"] = "multistep"
    milestones: list[int] = field(default_factory=lambda: [150, 250])
    gamma: float = 0.1
    warmup_epochs: float = 0.0
    label_smoothing: float = 0.0
    loss: Literal["auto", "cross_entropy", "bce", "margin", "spread"] = "auto"
    grad_clip: float | None = None
    ema_decay: float | None = None
    amp: bool | Literal["auto"] = "auto"
    channels_last: bool = False
    compile: bool = False
    seed: int = 0
    deterministic: bool = False
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    sync_bn: bool = False
    time_limit: float | None = None
    steps_per_epoch: int | None = None
    final_test: bool = True

    def validate(self, path: str) -> None:
        """Check value ranges; ``path`` is this object's dotted path."""
        self._check_sizes(path)
        self._check_optimizer(path)
        self._check_schedule(path)
        self._check_limits(path)
        self._check_flag_bounds(path)

    def _check_sizes(self, path: str) -> None:
        for name in ("epochs", "batch_size", "eval_batch_size"):
            value = getattr(self, name)
            check(value >= 1, join_path(path, name), f"must be >= 1, got {value}")
        check_limit(self.batch_size, path, "batch_size")
        check_limit(self.eval_batch_size, path, "eval_batch_size")

    def _check_flag_bounds(self, path: str) -> None:
        """The upper bounds of the flags --epochs, --lr and --time-limit (capsctl/numbers.py)."""
        for name, most in (("epochs", MAX_EPOCHS), ("lr", MAX_LR), ("time_limit", MAX_SECONDS)):
            value = getattr(self, name)
            if value is not None:
                check(value <= most, join_path(path, name), f"must be <= {most}, got {value}")

    def _check_optimizer(self, path: str) -> None:
        check(self.lr > 0, join_path(path, "lr"), f"must be > 0, got {self.lr}")
        check(
            0 <= self.momentum < 1,
            join_path(path, "momentum"),
            f"must be in [0, 1), got {self.momentum}",
        )
        check(
            self.weight_decay >= 0,
            join_path(path, "weight_decay"),
            f"must be >= 0, got {self.weight_decay}",
        )
        check(
            0 <= self.label_smoothing < 1,
            join_path(path, "label_smoothing"),
            f"must be in [0, 1), got {self.label_smoothing}",
        )
        if self.grad_clip is not None:
            check(
                self.grad_clip > 0,
                join_path(path, "grad_clip"),
                f"must be > 0 (null disables clipping), got {self.grad_clip}",
            )
        if self.ema_decay is not None:
            check(
                0 < self.ema_decay < 1,
                join_path(path, "ema_decay"),
                f"must be in (0, 1) (null disables EMA), got {self.ema_decay}",
            )

    def _check_schedule(self, path: str) -> None:
        for i, milestone in enumerate(self.milestones):
            check(
                milestone >= 1,
                f"{join_path(path, 'milestones')}[{i}]",
                f"must be >= 1, got {milestone}",
            )
        for i in range(1, len(self.milestones)):
            check(
                self.milestones[i] > self.milestones[i - 1],
                join_path(path, "milestones"),
                f"must be strictly increasing, got {self.milestones}",
            )
        check(self.gamma > 0, join_path(path, "gamma"), f"must be > 0, got {self.gamma}")
        check(
            self.warmup_epochs >= 0,
            join_path(path, "warmup_epochs"),
            f"must be >= 0, got {self.warmup_epochs}",
        )

    def _check_limits(self, path: str) -> None:
        check(
            0 <= self.seed < 2**32,
            join_path(path, "seed"),
            f"must be in [0, 2**32), got {self.seed}",
        )
        if self.time_limit is not None:
            check(
                self.time_limit > 0,
                join_path(path, "time_limit"),
                f"must be > 0 seconds (null = no limit), got {self.time_limit}",
            )
        if self.steps_per_epoch is not None:
            check(
                self.steps_per_epoch >= 1,
                join_path(path, "steps_per_epoch"),
                f"must be >= 1 (null = whole epochs), got {self.steps_per_epoch}",
            )


@dataclass
class LogConfig:
    """What a run records besides its run folder's own files.

    ``tensorboard``: also write the per-epoch scalars as TensorBoard event files into the run
    folder (needs ``pip install 'capsctl[tensorboard]'``). ``curves``: draw ``curves.png`` into
    the run folder at the end (skipped without matplotlib).
    """

    tensorboard: bool = False
    curves: bool = True


@dataclass
class Preset:
    """A complete, validated experiment description."""

    name: str = ""
    description: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)


def validate_layer(spec: CapsLayerSpec, path: str) -> None:
    """Range checks of one capsule layer; matrix poses need a square ``pose_dim``."""
    for name in ("types", "pose_dim", "kernel", "stride"):
        value = getattr(spec, name)
        check(value >= 1, join_path(path, name), f"must be >= 1, got {value}")
        check_limit(value, path, name)
    if spec.pose == "matrix":
        check(
            _is_square(spec.pose_dim),
            join_path(path, "pose_dim"),
            f"must be a perfect square (4, 9, 16, ...) for matrix poses, got {spec.pose_dim}; "
            "change it or use pose: vector",
        )


def validate_model(cfg: ModelConfig, path: str) -> None:
    """Range checks of a model configuration (its layers are checked by :func:`validate_layer`)."""
    sizes = ("num_classes", "in_channels", "input_size", "primary_types", "primary_dim")
    for name in (*sizes, "primary_kernel", "primary_stride"):
        value = getattr(cfg, name)
        check(value >= 1, join_path(path, name), f"must be >= 1, got {value}")
        check_limit(value, path, name)
    if cfg.backbone_width is not None:
        check(
            cfg.backbone in WIDTH_BACKBONES,
            join_path(path, "backbone_width"),
            f"only the {', '.join(WIDTH_BACKBONES)} backbone has a width; use null with "
            f"backbone {cfg.backbone!r}",
        )
        value = cfg.backbone_width
        check(value >= 1, join_path(path, "backbone_width"), f"must be >= 1, got {value}")
        check_limit(value, path, "backbone_width")
    check_limit(len(cfg.layers), path, "layers")
    check(0 <= cfg.dropout < 1, join_path(path, "dropout"), f"must be in [0, 1), got {cfg.dropout}")
    if cfg.class_pose_dim is None:
        return
    check(
        cfg.class_pose_dim >= 1,
        join_path(path, "class_pose_dim"),
        f"must be >= 1 (null = the last layer's pose_dim), got {cfg.class_pose_dim}",
    )
    check_limit(cfg.class_pose_dim, path, "class_pose_dim")
    if cfg.class_pose == "matrix":
        check(
            _is_square(cfg.class_pose_dim),
            join_path(path, "class_pose_dim"),
            "must be a perfect square (4, 9, 16, ...) for matrix poses, "
            f"got {cfg.class_pose_dim}; change it or use class_pose: vector",
        )


#: Range checks for dataclasses defined elsewhere (called as ``check(obj, path)``). Our own
#: dataclasses define a ``validate(self, path)`` method instead; both are honoured.
VALIDATORS: dict[type, Callable[[Any, str], None]] = {
    CapsLayerSpec: validate_layer,
    ModelConfig: validate_model,
}
