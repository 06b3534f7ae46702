"""Tests for capsctl.config: strict parsing, overrides, preset files, round trips."""

from __future__ import annotations

import dataclasses
import math
import sys
import tempfile
import types
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capsctl import checkpoint, config
from capsctl.config import (
    DataConfig,
    Preset,
    TrainConfig,
    apply_overrides,
    dump_yaml,
    from_dict,
    list_presets,
    load_preset,
    preset_from_dict,
    preset_from_yaml,
    preset_to_dict,
)
from capsctl.errors import ConfigError, UsageError
from capsctl.models.spec import CapsLayerSpec, ModelConfig

TINY = ModelConfig(
    num_classes=10,
    backbone="simple",
    primary_types=8,
    primary_dim=16,
    layers=[CapsLayerSpec(kind="conv", types=8, pose_dim=16), CapsLayerSpec(kind="fc", types=8)],
)
MODELS = {"tiny": TINY, "vec": ModelConfig(class_pose="vector", class_pose_dim=10)}

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


def write(tmp_path: Path, text: str, name: str = "demo.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def parse(raw: dict, overrides: list[str] | tuple[str, ...] = ()) -> Preset:
    return preset_from_dict(
        apply_overrides(raw, overrides, resolve_model=MODELS), resolve_model=MODELS
    )


def default_raw() -> dict:
    return preset_to_dict(Preset())


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------


def test_valid_nested_parse(tmp_path: Path) -> None:
    preset = load_preset(str(write(tmp_path, VALID_YAML)))
    assert preset.name == "demo"
    assert preset.description == "A small demo preset"
    assert preset.model.num_classes == 100
    assert preset.model.layers == [
        CapsLayerSpec(kind="conv", types=16, pose_dim=16, kernel=3, stride=2),
        CapsLayerSpec(kind="fc", types=10, pose_dim=9, pose="matrix"),
    ]
    assert preset.model.class_pose_dim == 4
    assert preset.data == DataConfig(
        dataset="cifar100", val_size=0, augment=config.AugmentConfig(2)
    )
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


def test_name_defaults_to_file_stem(tmp_path: Path) -> None:
    assert load_preset(str(write(tmp_path, "train: {epochs: 2}\n", "quick.yaml"))).name == "quick"
    assert load_preset(str(write(tmp_path, "", "empty.yml"))).name == "empty"


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
        ("train.amp=1", "train.amp: expected true or false, got 1"),
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
            "model.arch: expected one of 'capsnet', 'capsnet-dynamic', 'capsnet-em', 'cnn', "
            "'resnet18'",
        ),
        # out of range
        ("train.lr=-0.1", "train.lr: must be > 0"),
        ("train.lr=0", "train.lr: must be > 0"),
        ("train.lr=.inf", "train.lr: expected a finite number"),
        ("train.epochs=0", "train.epochs: must be >= 1"),
        ("train.batch_size=0", "train.batch_size: must be >= 1"),
        ("train.label_smoothing=1", "train.label_smoothing: must be in [0, 1)"),
        ("train.ema_decay=1.0", "train.ema_decay: must be in (0, 1)"),
        ("train.milestones=[20, 10]", "train.milestones: must be strictly increasing"),
        ("train.seed=-1", "train.seed: must be in [0, 2**32)"),
        ("model.dropout=1.0", "model.dropout: must be in [0, 1)"),
        ("model.iterations=0", "model.iterations: must be >= 1"),
        ("model.layers=[{}, {stride: 0}]", "model.layers[1].stride: must be >= 1"),
        ("data.val_size=-5", "data.val_size: must be >= 0"),
        ("data.augment.crop_padding=-1", "data.augment.crop_padding: must be >= 0"),
        ("data.dataset='imagefolder:'", "data.dataset: imagefolder needs a folder"),
        # matrix poses need a perfect-square dimension
        ("model.layers=[{pose_dim: 12}]", "model.layers[0].pose_dim: must be a perfect square"),
        ("model.class_pose_dim=8", "model.class_pose_dim: must be a perfect square"),
    ],
)
def test_errors_name_the_dotted_path(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(default_raw(), [override])
    assert message in str(info.value)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, UsageError) and info.value.exit_code == 2


def test_vector_poses_need_no_square() -> None:
    preset = parse(
        default_raw(),
        [
            "model.layers=[{pose: vector, pose_dim: 12}]",
            "model.class_pose=vector",
            "model.class_pose_dim=10",
        ],
    )
    assert preset.model.layers[0].pose_dim == 12 and preset.model.class_pose_dim == 10


def test_unknown_field_suggests_a_name() -> None:
    with pytest.raises(ConfigError, match=r"did you mean kernel\?"):
        from_dict(CapsLayerSpec, {"kernal": 3}, "model.layers[0]")


def test_from_dict_rejects_non_mapping_top_level() -> None:
    with pytest.raises(ConfigError, match="train: expected a mapping, got"):
        from_dict(TrainConfig, [1, 2], "train")


def test_dataset_and_normalization_names_are_checked() -> None:
    preset = parse(
        default_raw(), ["data.dataset=fashion-mnist-quickstart", "data.normalization=mnist"]
    )
    assert (preset.data.dataset, preset.data.normalization) == ("fashion-mnist-quickstart", "mnist")
    assert parse(default_raw(), ["data.dataset='imagefolder:/x'"]).data.dataset == "imagefolder:/x"
    assert parse(default_raw(), ["data.normalization=cifar100"]).data.normalization == "cifar100"
    with pytest.raises(ConfigError, match=r"^data.dataset: unknown dataset 'svhn'; choose one of"):
        parse(default_raw(), ["data.dataset=svhn"])
    with pytest.raises(
        ConfigError, match=r"^data.normalization: unknown normalization 'imagenet'; expected one of"
    ):
        parse(default_raw(), ["data.normalization=imagenet"])


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


# --------------------------------------------------------------------------------------------
# Model references
# --------------------------------------------------------------------------------------------


def test_model_by_name_and_base() -> None:
    assert preset_from_dict({"model": "tiny"}, resolve_model=MODELS).model == TINY
    preset = preset_from_dict(
        {"model": {"base": "tiny", "iterations": 5}}, resolve_model=MODELS.get
    )
    assert preset.model == dataclasses.replace(TINY, iterations=5)


def test_model_string_plus_deep_override_expands_first() -> None:
    preset = parse({"model": "tiny"}, ["model.layers[0].kernel=5", "model.num_classes=100"])
    assert preset.model.layers[0].kernel == 5
    assert preset.model.layers[1] == TINY.layers[1]
    assert preset.model.num_classes == 100
    # the base can itself be overridden
    assert parse({"model": "tiny"}, ["model.base=vec"]).model == MODELS["vec"]
    assert parse({"model": "tiny"}, ["model=vec"]).model == MODELS["vec"]


def test_model_from_mapping() -> None:
    cfg = config.model_from_mapping({"base": "tiny", "dropout": 0.1}, resolve_model=MODELS)
    assert cfg == dataclasses.replace(TINY, dropout=0.1)
    with pytest.raises(ConfigError, match=r"^spec.dropout: must be in \[0, 1\)"):
        config.model_from_mapping({"dropout": 2.0}, "spec")


def test_unknown_model_names_model_and_known_names() -> None:
    with pytest.raises(
        ConfigError, match=r"^model: unknown model 'huge'; known models: tiny, vec$"
    ):
        preset_from_dict({"model": "huge"}, resolve_model=MODELS)
    with pytest.raises(ConfigError, match=r"^model.base: unknown model 'huge'"):
        preset_from_dict({"model": {"base": "huge"}}, resolve_model=MODELS)


def test_default_resolver_uses_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    def get_config(name: str) -> ModelConfig:
        return {"tiny": TINY}[name]

    fake = types.SimpleNamespace(get_config=get_config, list_models=lambda: ["tiny", "other"])
    monkeypatch.setitem(sys.modules, "capsctl.registry", fake)
    assert preset_from_dict({"model": "tiny"}).model == TINY
    with pytest.raises(
        ConfigError, match=r"model: unknown model 'nope'; known models: other, tiny"
    ):
        preset_from_dict({"model": "nope"})


# --------------------------------------------------------------------------------------------
# Overrides
# --------------------------------------------------------------------------------------------


def test_overrides_scalars_lists_indexes_null() -> None:
    raw = default_raw()
    raw["model"]["layers"] = [{"kind": "conv"}, {"kind": "fc", "types": 10}]
    raw["data"]["test_file"] = "test_batch.npz"
    preset = parse(
        raw,
        [
            "train.lr=0.05",
            "train.milestones=[10,20]",
            "model.layers[0].kernel=5",
            "model.layers[1].pose=vector",
            "data.test_file=null",
            "train.optimizer=adamw",
            "train.amp=true",
            "name=custom",
            "description=two words = fine",
        ],
    )
    assert preset.train.lr == 0.05 and preset.train.milestones == [10, 20]
    assert preset.model.layers[0].kernel == 5 and preset.model.layers[1].pose == "vector"
    assert preset.data.test_file is None
    assert (preset.train.optimizer, preset.train.amp, preset.name) == ("adamw", True, "custom")
    assert preset.description == "two words = fine"
    assert raw["train"]["lr"] == 0.1  # the input is not modified


def test_overrides_create_missing_sections() -> None:
    assert parse({}, ["data.augment.hflip=false"]).data.augment.hflip is False


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.lr", "override 'train.lr': expected dotted.path=value"),
        ("=3", "override '=3': '' is not a dotted path"),
        ("train..lr=1", "is not a dotted path"),
        ("train.lr.x=1", "override 'train.lr.x=1': train.lr is not a mapping"),
        ("model.layers[3].kernel=5", "index 3 is out of range (model.layers has 0 items)"),
        ("train[0]=1", "override 'train[0]=1': train is not a list"),
        (
            "train.milestones=[1, 2",
            "override 'train.milestones=[1, 2': the value is not valid YAML",
        ),
    ],
)
def test_malformed_overrides(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(default_raw(), [override])
    assert message in str(info.value)


def test_overrides_through_load_preset(tmp_path: Path) -> None:
    path = write(tmp_path, VALID_YAML)
    preset = load_preset(str(path), ["train.epochs=2", "model.layers[1].types=7"])
    assert preset.train.epochs == 2 and preset.model.layers[1].types == 7


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "name: x\ntrain:\n  lr: [0.1\n  epochs: 3\n", "broken.yaml")
    with pytest.raises(ConfigError) as info:
        load_preset(str(path))
    message = str(info.value)
    assert message.startswith(f"{path}:") and "invalid YAML" in message and "\n" not in message
    line = int(message[len(str(path)) + 1 :].split(":")[0])
    assert 3 <= line <= 5


def test_duplicate_keys_are_errors(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  lr: 0.1\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3: invalid YAML \(duplicate key 'lr'"):
        load_preset(str(path))


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="expected a mapping of preset fields"):
        load_preset(str(write(tmp_path, "- 1\n- 2\n")))


def test_unsafe_yaml_tags_are_rejected(tmp_path: Path) -> None:
    path = write(tmp_path, "name: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_preset(str(path))


def test_preset_dirs_include_the_source_presets_folder() -> None:
    source = Path(config.__file__).resolve().parent.parent / "presets"
    if source.is_dir():
        assert source in config.preset_dirs()


def test_list_and_load_presets_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    write(first, "description: Fast smoke test\ntrain: {epochs: 1}\n", "smoke.yaml")
    write(second, "description: shadowed\n", "smoke.yaml")
    write(second, "description: The paper recipe\n", "paper.yml")
    write(second, "description: [unclosed\n", "broken.yaml")
    write(second, "not a preset", "notes.txt")
    monkeypatch.setattr(config, "preset_dirs", lambda: [first, second])
    listing = dict(list_presets())
    assert listing["smoke"] == "Fast smoke test" and listing["paper"] == "The paper recipe"
    assert listing["broken"].startswith("(invalid:")
    assert list(listing) == ["broken", "paper", "smoke"]
    assert load_preset("smoke").train.epochs == 1
    with pytest.raises(
        ConfigError,
        match=r"unknown preset 'smok' \(did you mean smoke\?\); known presets: broken, paper, smo",
    ):
        load_preset("smok")
    with pytest.raises(ConfigError, match="preset file nowhere/x.yaml does not exist"):
        load_preset("nowhere/x.yaml")


# --------------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------------


def test_round_trip_dict_and_yaml(tmp_path: Path) -> None:
    preset = load_preset(str(write(tmp_path, VALID_YAML)))
    data = preset_to_dict(preset)
    assert preset_from_dict(data) == preset
    assert preset_from_yaml(dump_yaml(preset)) == preset
    path = write(tmp_path, dump_yaml(preset), "dumped.yaml")
    assert load_preset(str(path)) == preset


def test_dump_quotes_strings_that_look_like_numbers() -> None:
    preset = Preset(name="1e5", description="ünïcödé: yes")
    assert preset_from_yaml(dump_yaml(preset)) == preset


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
    lr=positive,
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


NUMERIC_FIELDS = [
    f.name
    for f in dataclasses.fields(TrainConfig)
    if f.type in ("int", "float", "float | None", "int | None")
]
override_values = st.one_of(
    st.integers(-(10**20), 10**20),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=12),
    st.lists(st.integers(0, 5), max_size=3),
)


def _render(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return repr(value) if isinstance(value, (int, float)) else str(value)


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(NUMERIC_FIELDS), override_values)
def test_property_numeric_overrides_validate_or_raise_config_error(
    field: str, value: object
) -> None:
    text = _render(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        assert config._yaml_load(text) == value  # numbers are read back exactly
    try:
        preset = parse(default_raw(), [f"train.{field}={text}"])
    except ConfigError:
        return
    parsed = config._yaml_load(text)
    got = getattr(preset.train, field)
    assert got == parsed and type(got) in (type(parsed), float)
    assert not isinstance(parsed, bool)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(st.text(max_size=10).filter(lambda k: k != "format"), json_values, max_size=5)
)
def test_property_metadata_json_round_trip(metadata: dict) -> None:
    import torch

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "m.safetensors"
        checkpoint.save_checkpoint(path, {"model.w": torch.zeros(2)}, metadata)
        read = checkpoint.read_metadata(path)
    expected = dict(metadata)
    expected.setdefault("capsctl_version", read["capsctl_version"])
    expected.setdefault("torch_version", read["torch_version"])
    assert read == expected
