"""Tests for preset files, models given by registered name or ``base:``, and round trips."""

from __future__ import annotations

import ast
import dataclasses
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import capsctl
from capsctl import checkpoint, registry
from capsctl.config import (
    Preset,
    apply_overrides,
    dump_yaml,
    list_presets,
    load_preset,
    model_from_mapping,
    preset_dirs,
    preset_from_dict,
    preset_from_yaml,
    preset_to_dict,
    resolve_config,
)
from capsctl.config import presets as presets_module
from capsctl.errors import ConfigError
from capsctl.models.spec import CapsLayerSpec, ModelConfig

ROOT = Path(__file__).resolve().parents[1]

TINY = ModelConfig(
    num_classes=10,
    backbone="simple",
    primary_types=8,
    primary_dim=16,
    layers=[CapsLayerSpec(kind="conv", types=8, pose_dim=16), CapsLayerSpec(kind="fc", types=8)],
)
VEC = ModelConfig(class_pose="vector", class_pose_dim=10)

VALID_YAML = """\
name: demo
description: A small demo preset
model: {base: tiny, iterations: 3}
data: {dataset: cifar100, val_size: 0}
train: {epochs: 10, lr: 1e-3, optimizer: adamw, milestones: [3, 6]}
log: {tensorboard: true}
"""


@pytest.fixture
def tiny_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry holds exactly the models ``tiny`` and ``vec`` during the test."""
    entries = {
        "tiny": registry.Entry("tiny", "a tiny capsule net", lambda: TINY),
        "vec": registry.Entry("vec", "vector class poses", lambda: VEC),
    }
    monkeypatch.setattr(registry, "_REGISTRY", entries)


def write(folder: Path, text: str, name: str = "demo.yaml") -> Path:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


def parse(raw: dict, overrides: list[str] | tuple[str, ...] = ()) -> Preset:
    return preset_from_dict(apply_overrides(raw, overrides))


# --------------------------------------------------------------------------------------------
# Model references
# --------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("tiny_registry")
def test_model_by_name_and_base() -> None:
    assert preset_from_dict({"model": "tiny"}).model == TINY
    preset = preset_from_dict({"model": {"base": "tiny", "iterations": 5}})
    assert preset.model == TINY.replace(iterations=5)


@pytest.mark.usefixtures("tiny_registry")
def test_model_string_plus_deep_override_expands_first() -> None:
    preset = parse({"model": "tiny"}, ["model.layers[0].kernel=5", "model.num_classes=100"])
    assert preset.model.layers[0].kernel == 5
    assert preset.model.layers[1] == TINY.layers[1]
    assert preset.model.num_classes == 100
    # the base can itself be overridden
    assert parse({"model": "tiny"}, ["model.base=vec"]).model == VEC
    assert parse({"model": "tiny"}, ["model=vec"]).model == VEC
    assert TINY.layers[0].kernel == 3  # the registered configuration is not modified


@pytest.mark.usefixtures("tiny_registry")
def test_model_from_mapping_and_resolve_config() -> None:
    cfg = model_from_mapping({"base": "tiny", "dropout": 0.1})
    assert cfg == dataclasses.replace(TINY, dropout=0.1)
    with pytest.raises(ConfigError, match=r"^spec.dropout: must be in \[0, 1\)"):
        model_from_mapping({"dropout": 2.0}, "spec")
    assert resolve_config("tiny", num_classes=3) == dataclasses.replace(TINY, num_classes=3)
    assert resolve_config({"base": "vec"}) == VEC
    assert resolve_config(TINY) == TINY and resolve_config(TINY) is not TINY


@pytest.mark.usefixtures("tiny_registry")
def test_unknown_model_names_model_and_registered_names() -> None:
    with pytest.raises(
        ConfigError, match=r"^model: unknown model 'huge'; registered models: tiny, vec$"
    ):
        preset_from_dict({"model": "huge"})
    with pytest.raises(ConfigError, match=r"^model.base: unknown model 'huge'"):
        preset_from_dict({"model": {"base": "huge"}})
    with pytest.raises(ConfigError, match=r"^model.base: expected a registered model name, got 3"):
        preset_from_dict({"model": {"base": 3}})


def test_real_registered_models_resolve() -> None:
    preset = preset_from_dict({"model": {"base": "mnist-caps", "iterations": 4}})
    assert preset.model == registry.get_config("mnist-caps").replace(iterations=4)
    with pytest.raises(ConfigError, match=r"^model: unknown model 'nope'; registered models: .*"):
        preset_from_dict({"model": "nope"})


def test_registry_never_imports_config_and_config_hides_no_imports() -> None:
    """One direction only: capsctl.config uses capsctl.registry, never the other way round."""
    tree = ast.parse((ROOT / "capsctl" / "registry.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert not (node.module or "").startswith("capsctl.config"), node.module
            assert not (node.module == "capsctl" and any(a.name == "config" for a in node.names))
        if isinstance(node, ast.Import):
            assert not any(a.name.startswith("capsctl.config") for a in node.names)
    for path in (ROOT / "capsctl" / "config").glob("*.py"):
        assert "importlib" not in path.read_text(encoding="utf-8"), path.name


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def test_name_defaults_to_file_stem(tmp_path: Path) -> None:
    assert load_preset(str(write(tmp_path, "train: {epochs: 2}\n", "quick.yaml"))).name == "quick"
    assert load_preset(str(write(tmp_path, "description: d\n", "named.yml"))).name == "named"


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "---\n"])
def test_an_empty_preset_file_is_an_error(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text, "empty.yaml")
    with pytest.raises(ConfigError) as info:
        load_preset(str(path))
    message = str(info.value)
    assert message.startswith(f"{path}: the preset is empty") and "\n" not in message
    assert "name, model, data and train" in message
    with pytest.raises(ConfigError, match="<string>: the preset is empty"):
        preset_from_yaml(text)


def test_train_refuses_an_empty_preset_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from capsctl.cli import main

    path = write(tmp_path, "", "empty.yaml")
    with pytest.raises(SystemExit) as info:
        main(["train", "--preset", str(path), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"{path}: the preset is empty" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


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


def test_non_utf8_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"^{path}: not a UTF-8 text file"):
        load_preset(str(path))


def test_preset_dirs_include_the_source_presets_folder() -> None:
    source = Path(capsctl.__file__).resolve().parent.parent / "presets"
    assert source.is_dir()  # the tests run from a source checkout
    assert source in preset_dirs()
    assert all(folder.name == "presets" for folder in preset_dirs())
    assert "cifar10-caps" in dict(list_presets())


def test_list_and_load_presets_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    write(first, "description: Fast smoke test\ntrain: {epochs: 1}\n", "smoke.yaml")
    write(second, "description: shadowed\n", "smoke.yaml")
    write(second, "description: The paper recipe\n", "paper.yml")
    write(second, "description: [unclosed\n", "broken.yaml")
    write(second, "not a preset", "notes.txt")
    monkeypatch.setattr(presets_module, "preset_dirs", lambda: [first, second])
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


@pytest.mark.usefixtures("tiny_registry")
def test_round_trip_dict_and_yaml(tmp_path: Path) -> None:
    preset = load_preset(str(write(tmp_path, VALID_YAML)))
    assert preset.model == TINY.replace(iterations=3) and preset.log.tensorboard
    data = preset_to_dict(preset)
    assert preset_from_dict(data) == preset
    assert preset_from_yaml(dump_yaml(preset)) == preset
    path = write(tmp_path, dump_yaml(preset), "dumped.yaml")
    assert load_preset(str(path)) == preset


def test_dump_quotes_strings_that_look_like_numbers() -> None:
    preset = Preset(name="1e5", description="ünïcödé: yes")
    assert "'1e5'" in dump_yaml(preset) or '"1e5"' in dump_yaml(preset)
    assert preset_from_yaml(dump_yaml(preset)) == preset


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
