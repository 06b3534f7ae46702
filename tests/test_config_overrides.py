"""Tests for ``dotted.path=value`` overrides (capsctl.config.overrides) and YAML 1.2 numbers."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capsctl.config import (
    Preset,
    TrainConfig,
    apply_overrides,
    load_preset,
    preset_from_dict,
    preset_to_dict,
)
from capsctl.config.yaml_io import load_yaml
from capsctl.errors import ConfigError


def parse(raw: dict, overrides: list[str]) -> Preset:
    return preset_from_dict(apply_overrides(raw, overrides))


def default_raw() -> dict:
    return preset_to_dict(Preset())


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


def test_a_single_string_is_one_override() -> None:
    assert apply_overrides({}, "train.lr=0.5") == {"train": {"lr": 0.5}}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.lr", "override 'train.lr': expected dotted.path=value"),
        ("=3", "override '=3': '' is not a dotted path"),
        ("train..lr=1", "is not a dotted path"),
        ("train.lr.x=1", "override 'train.lr.x=1': train.lr is not a mapping"),
        ("model.layers[3].kernel=5", "index 3 is out of range (model.layers has 0 items)"),
        ("train[0]=1", "override 'train[0]=1': train is not a list"),
        ("data.extra[0]=1", "override 'data.extra[0]=1': data.extra is not a list; set the whole"),
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
    assert "\n" not in str(info.value)


def test_overrides_through_load_preset(tmp_path: Path) -> None:
    path = tmp_path / "demo.yaml"
    path.write_text("model:\n  layers: [{kind: conv}, {kind: fc, types: 10}]\n", encoding="utf-8")
    preset = load_preset(str(path), ["train.epochs=2", "model.layers[1].types=7"])
    assert preset.train.epochs == 2 and preset.model.layers[1].types == 7


def test_yaml_reads_exponent_floats_and_keeps_other_strings() -> None:
    assert load_yaml("[1e-3, 5E+4, -2e2, 1.5e1, 1e, e5, 1_0e1]") == [
        0.001,
        50000.0,
        -200.0,
        15.0,
        "1e",
        "e5",
        100.0,
    ]


# --------------------------------------------------------------------------------------------
# Property tests
# --------------------------------------------------------------------------------------------

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
        assert load_yaml(text) == value  # numbers are read back exactly
    try:
        preset = parse(default_raw(), [f"train.{field}={text}"])
    except ConfigError:
        return
    parsed = load_yaml(text)
    got = getattr(preset.train, field)
    assert got == parsed and type(got) in (type(parsed), float)
    assert not isinstance(parsed, bool)


@pytest.mark.parametrize("preset", ["quickstart", "cifar10-caps-fast"])
@pytest.mark.parametrize("router", ["idpa", "dynamic", "em", "self"])
@pytest.mark.parametrize("how", ["model.router={}", "model.router.name={}"])
def test_any_router_on_a_capsule_preset_with_its_own_defaults(
    preset: str, router: str, how: str
) -> None:
    """``--router NAME`` (``--set model.router=NAME``) and ``--set model.router.name=NAME``
    switch a preset's model to that router with the router's own defaults (no parameter of the
    preset's router carried over), and the model trains one step."""
    import torch

    from capsctl.config.model_refs import build_model
    from capsctl.layers.routers import ROUTERS

    p = load_preset(preset, [how.format(router)])
    defaults = dataclasses.asdict(ROUTERS[router].Params())
    assert p.model.router == {"name": router, **defaults}
    torch.manual_seed(0)
    net = build_model(p.model).train()
    size, channels = p.model.input_size, p.model.in_channels
    logits = net(torch.randn(2, channels, size, size))
    logits.float().sum().backward()
    assert torch.isfinite(logits).all()
    assert any(q.grad is not None and q.grad.abs().sum() > 0 for q in net.parameters())


def test_a_router_switch_then_its_parameters() -> None:
    """Parameters set after the switch reach the new router; naming the router the model has
    keeps its parameters."""
    p = load_preset("quickstart", ["model.router.name=dynamic", "model.router.iterations=5"])
    assert p.model.router == {"name": "dynamic", "iterations": 5}
    same = load_preset("quickstart", ["model.router.iterations=4", "model.router.name=idpa"])
    assert same.model.router["iterations"] == 4 and same.model.router["schedule"] == "concurrent"
