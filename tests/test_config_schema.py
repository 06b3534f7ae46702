"""Tests for capsctl.config's schema and strict converter: dotted-path errors, defaults, hooks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capsctl.config import (
    AugmentConfig,
    DataConfig,
    Preset,
    TrainConfig,
    apply_overrides,
    dump_yaml,
    from_dict,
    load_preset,
    preset_from_dict,
    preset_from_yaml,
    preset_to_dict,
)
from capsctl.errors import ConfigError, UsageError
from capsctl.models.spec import CapsLayerSpec

VALID_YAML = """\
name: demo
description: A small demo preset
model:
  arch: capsnet
  num_classes: 100
  backbone: simple
  layers:
    - {kind: conv, types: 16, pose_dim: 16, kernel: 3, stride: 2}
    - kind: fc
      types: 10
      pose_dim: 9
      pose: matrix
  class_pose_dim: 4
  iterations: 3
data:
  dataset: cifar100
  val_size: 0
  augment: {crop_padding: 2}
train:
  epochs: 10
  lr: 1e-3
  optimizer: adamw
  milestones: [3, 6]
  grad_clip: 5
  ema_decay: 0.999
"""


def parse(overrides: list[str]) -> Preset:
    """The default preset with ``overrides`` applied, validated."""
    return preset_from_dict(apply_overrides(preset_to_dict(Preset()), overrides))


def test_valid_nested_parse(tmp_path: Path) -> None:
    path = tmp_path / "demo.yaml"
    path.write_text(VALID_YAML, encoding="utf-8")
    preset = load_preset(str(path))
    assert preset.name == "demo"
    assert preset.description == "A small demo preset"
    assert preset.model.num_classes == 100
    assert preset.model.layers == [
        CapsLayerSpec(kind="conv", types=16, pose_dim=16, kernel=3, stride=2),
        CapsLayerSpec(kind="fc", types=10, pose_dim=9, pose="matrix"),
    ]
    assert preset.model.class_pose_dim == 4
    assert preset.data == DataConfig(dataset="cifar100", val_size=0, augment=AugmentConfig(2))
    train = preset.train
    assert train.lr == 1e-3 and isinstance(train.lr, float)  # YAML 1.1 would give "1e-3"
    assert train.grad_clip == 5.0 and isinstance(train.grad_clip, float)  # int accepted for float
    assert (train.optimizer, train.milestones, train.ema_decay) == ("adamw", [3, 6], 0.999)
    assert train.batch_size == 128  # defaults fill missing fields


def test_defaults_are_the_cifar_recipe() -> None:
    t = TrainConfig()
    assert (t.epochs, t.batch_size, t.lr, t.momentum, t.weight_decay) == (350, 128, 0.1, 0.9, 5e-4)
    assert (t.schedule, t.milestones, t.gamma) == ("multistep", [150, 250], 0.1)
    d = DataConfig()
    assert (d.dataset, d.val_size, d.augment.crop_padding, d.augment.hflip) == (
        "cifar10",
        5000,
        4,
        True,
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        # unknown key nested in a list
        (
            "model.layers=[{kind: conv}, {kind: fc, kernal: 3}]",
            "model.layers[1].kernal: unknown field; expected one of kind, types, pose_dim, kernel",
        ),
        ("train.learning_rate=0.1", "train.learning_rate: unknown field; expected one of epochs"),
        ("colour=red", "colour: unknown field; expected one of name, description, model"),
        # wrong types
        ("train.lr=abc", "train.lr: expected a number, got 'abc'"),
        ("train.milestones=[10, x]", "train.milestones[1]: expected an integer, got 'x'"),
        ("train.milestones=5", "train.milestones: expected a list of integers, got 5"),
        ("train.grad_clip=[1]", "train.grad_clip: expected a number or null, got [1]"),
        ("data.augment=3", "data.augment: expected a mapping, got 3"),
        ("data.dataset=5", "data.dataset: expected a string, got 5"),
        ("train.amp=1", "train.amp: expected true or false or 'auto', got 1"),
        ("train.epochs=2.5", "train.epochs: expected an integer, got 2.5"),
        # bool for int
        ("train.epochs=true", "train.epochs: expected an integer, got true"),
        ("model.layers=[{types: false}]", "model.layers[0].types: expected an integer, got false"),
        ("train.lr=true", "train.lr: expected a number, got true"),
        # Literal violations
        ("train.optimizer=adam", "train.optimizer: expected one of 'sgd', 'adamw', got 'adam'"),
        (
            "model.layers=[{pose: tensor}]",
            "model.layers[0].pose: expected one of 'matrix', 'vector'",
        ),
        (
            "model.arch=vgg",
            "model.arch: expected one of 'capsnet', 'cnn', 'resnet18'",
        ),
        # out of range
        ("train.lr=-0.1", "train.lr: must be > 0"),
        ("train.lr=0", "train.lr: must be > 0"),
        ("train.lr=.inf", "train.lr: expected a finite number"),
        ("train.lr=100000000000000000000000000000000001", "cannot be represented exactly"),
        ("train.epochs=0", "train.epochs: must be >= 1"),
        ("train.batch_size=0", "train.batch_size: must be >= 1"),
        ("train.eval_batch_size=0", "train.eval_batch_size: must be >= 1"),
        ("train.momentum=1", "train.momentum: must be in [0, 1)"),
        ("train.weight_decay=-1", "train.weight_decay: must be >= 0"),
        ("train.label_smoothing=1", "train.label_smoothing: must be in [0, 1)"),
        ("train.grad_clip=0", "train.grad_clip: must be > 0 (null disables clipping)"),
        ("train.ema_decay=1.0", "train.ema_decay: must be in (0, 1)"),
        ("train.milestones=[20, 10]", "train.milestones: must be strictly increasing"),
        ("train.milestones=[0]", "train.milestones[0]: must be >= 1"),
        ("train.gamma=0", "train.gamma: must be > 0"),
        ("train.warmup_epochs=-1", "train.warmup_epochs: must be >= 0"),
        ("train.seed=-1", "train.seed: must be in [0, 2**32)"),
        ("train.time_limit=0", "train.time_limit: must be > 0 seconds"),
        ("train.steps_per_epoch=0", "train.steps_per_epoch: must be >= 1"),
        ("model.dropout=1.0", "model.dropout: must be in [0, 1)"),
        ("model.iterations=0", "model.router.iterations: must be >= 1"),
        ("model.router.iterations=0", "model.router.iterations: must be >= 1"),
        (
            "model.router.name=capsule",
            "model.router.name: unknown routing algorithm 'capsule'; use one of idpa, dynamic, "
            "em, self",
        ),
        ("model.router={iterations: 2}", "model.router.name: missing; use one of idpa"),
        (
            "model.router.lambda_inf=0.1",
            "model.router.lambda_inf: unknown field; expected one of iterations, schedule",
        ),
        (
            "model.router={name: em, assignment: all}",
            "model.router.assignment: expected one of 'parents', 'window'",
        ),
        ("model.router={name: em, lambda_inf: 0}", "model.router.lambda_inf: must be > 0"),
        ("model.router={name: dynamic, schedule: concurrent}", "model.router.schedule: unknown"),
        ("model.router=3", "model.router: expected a mapping"),
        ("model.num_classes=0", "model.num_classes: must be >= 1"),
        ("model.layers=[{}, {stride: 0}]", "model.layers[1].stride: must be >= 1"),
        ("model.class_pose_dim=0", "model.class_pose_dim: must be >= 1"),
        ("model.primary_kernel=0", "model.primary_kernel: must be >= 1"),
        ("model.primary_stride=65", "model.primary_stride: must be <= 64"),
        (
            "model.backbone_width=256",
            "model.backbone_width: only the simple backbone has a width; use null",
        ),
        ("model={base: mnist-caps, backbone_width: 0}", "model.backbone_width: must be >= 1"),
        ("data.val_size=-5", "data.val_size: must be >= 0"),
        ("data.dataset=' '", "data.dataset: must not be empty"),
        ("data.augment.crop_padding=-1", "data.augment.crop_padding: must be >= 0"),
        ("data.dataset='imagefolder:'", "data.dataset: imagefolder needs a folder"),
        # matrix poses need a perfect-square dimension
        ("model.layers=[{pose_dim: 12}]", "model.layers[0].pose_dim: must be a perfect square"),
        ("model.class_pose_dim=8", "model.class_pose_dim: must be a perfect square"),
    ],
)
def test_errors_name_the_dotted_path(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse([override])
    assert message in str(info.value)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, UsageError) and info.value.exit_code == 2


def test_vector_poses_need_no_square() -> None:
    preset = parse(
        [
            "model.layers=[{pose: vector, pose_dim: 12}]",
            "model.class_pose=vector",
            "model.class_pose_dim=10",
        ]
    )
    assert preset.model.layers[0].pose_dim == 12 and preset.model.class_pose_dim == 10


def test_unknown_field_suggests_a_name() -> None:
    with pytest.raises(ConfigError, match=r"did you mean kernel\?"):
        from_dict(CapsLayerSpec, {"kernal": 3}, "model.layers[0]")


def test_from_dict_rejects_non_mapping_top_level() -> None:
    with pytest.raises(ConfigError, match="train: expected a mapping, got"):
        from_dict(TrainConfig, [1, 2], "train")
    with pytest.raises(ConfigError, match="^top level: expected a mapping, got 3$"):
        from_dict(TrainConfig, 3)


def test_missing_required_field_is_named() -> None:
    @dataclasses.dataclass
    class Needs:
        x: int

    with pytest.raises(ConfigError, match=r"^outer.x: missing required field; add it$"):
        from_dict(Needs, {}, "outer")


def test_retired_keys_are_ignored() -> None:
    assert from_dict(TrainConfig, {"workers": 4, "epochs": 2}, "train") == TrainConfig(epochs=2)
    with pytest.raises(ConfigError, match="train.worker: unknown field"):
        from_dict(TrainConfig, {"worker": 4}, "train")


def test_dataset_and_normalization_names_are_checked() -> None:
    preset = parse(["data.dataset=fashion-mnist-quickstart", "data.normalization=mnist"])
    assert (preset.data.dataset, preset.data.normalization) == ("fashion-mnist-quickstart", "mnist")
    assert parse(["data.dataset='imagefolder:/x'"]).data.dataset == "imagefolder:/x"
    assert parse(["data.normalization=cifar100"]).data.normalization == "cifar100"
    with pytest.raises(ConfigError, match=r"^data.dataset: unknown dataset 'svhn'; choose one of"):
        parse(["data.dataset=svhn"])
    with pytest.raises(
        ConfigError, match=r"^data.normalization: unknown normalization 'imagenet'; expected one of"
    ):
        parse(["data.normalization=imagenet"])


def test_validate_hook_without_path_is_called() -> None:
    @dataclasses.dataclass
    class Hooked:
        x: int = 0

        def validate(self) -> None:
            if self.x < 0:
                raise ConfigError("x: must be >= 0")

    assert from_dict(Hooked, {"x": 1}).x == 1
    with pytest.raises(ConfigError, match="x: must be >= 0"):
        from_dict(Hooked, {"x": -1})


def test_dict_annotations_convert_keys_and_values() -> None:
    @dataclasses.dataclass
    class Table:
        counts: dict[str, int] = dataclasses.field(default_factory=dict)

    assert from_dict(Table, {"counts": {"a": 1}}).counts == {"a": 1}
    with pytest.raises(ConfigError, match=r"^counts.a: expected an integer, got 'x'$"):
        from_dict(Table, {"counts": {"a": "x"}})


# --------------------------------------------------------------------------------------------
# Property tests
# --------------------------------------------------------------------------------------------

unit_open = st.floats(min_value=0.0, max_value=1.0, exclude_max=True, allow_nan=False)
positive = st.floats(min_value=1e-12, max_value=1e6, allow_nan=False)
train_configs = st.builds(
    TrainConfig,
    epochs=st.integers(1, 10_000),
    batch_size=st.integers(1, 4096),
    eval_batch_size=st.integers(1, 4096),
    optimizer=st.sampled_from(["sgd", "adamw"]),
    lr=st.floats(min_value=1e-12, max_value=10, allow_nan=False),
    momentum=unit_open,
    nesterov=st.booleans(),
    weight_decay=st.floats(min_value=0, max_value=1, allow_nan=False),
    schedule=st.sampled_from(["multistep", "cosine", "onecycle", "constant"]),
    milestones=st.lists(st.integers(1, 10_000), max_size=5, unique=True).map(sorted),
    gamma=positive,
    warmup_epochs=st.floats(min_value=0, max_value=100, allow_nan=False),
    label_smoothing=unit_open,
    grad_clip=st.none() | positive,
    ema_decay=st.none() | st.floats(min_value=1e-6, max_value=1 - 1e-9, allow_nan=False),
    amp=st.booleans(),
    channels_last=st.booleans(),
    compile=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    deterministic=st.booleans(),
    device=st.sampled_from(["auto", "cpu", "cuda", "mps"]),
    time_limit=st.none() | positive,
    steps_per_epoch=st.none() | st.integers(1, 10**6),
)


@settings(max_examples=50, deadline=None)
@given(train_configs)
def test_property_train_config_yaml_round_trip(train: TrainConfig) -> None:
    preset = Preset(name="p", train=train)
    assert preset_from_yaml(dump_yaml(preset)) == preset
    assert preset_from_dict(preset_to_dict(preset)) == preset


@pytest.mark.parametrize(
    "field",
    ["train.lr", "train.epochs", "train.batch_size", "train.eval_batch_size", "train.momentum",
     "train.weight_decay", "train.label_smoothing", "train.grad_clip", "train.ema_decay",
     "train.gamma", "train.warmup_epochs", "train.seed", "train.time_limit",
     "train.steps_per_epoch", "train.milestones[0]", "model.router.iterations", "model.dropout",
     "data.val_size", "data.augment.crop_padding"],
)  # fmt: skip
@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "-1"])
def test_no_numeric_field_takes_nan_inf_or_a_negative(field: str, value: str) -> None:
    """``--set`` numbers are checked by the schema (capsctl/config/convert.py refuses nan and
    inf for every number, the fields' checks negatives), one line naming the field."""
    with pytest.raises(ConfigError) as info:
        parse([f"{field}={value}"])
    message = str(info.value)
    assert message.startswith(field.replace("[0]", "")) and "\n" not in message, message


@pytest.mark.parametrize(
    "override",
    ["train.epochs=1000000", "train.batch_size=100000000", "train.eval_batch_size=100000000",
     "train.lr=1e30", "train.time_limit=1e30"],
)  # fmt: skip
def test_fields_with_a_flag_have_the_flags_upper_bound(override: str) -> None:
    """``--set train.epochs=N`` is held to the bound of ``--epochs N`` (capsctl/numbers.py)."""
    with pytest.raises(ConfigError, match=rf"^{override.split('=')[0]}: must be <= "):
        parse([override])
