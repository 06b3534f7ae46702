"""Tests for capsctl.checkpoint: safetensors files, validation, atomic writes, training state."""

from __future__ import annotations

import errno
import json
import pickle
import random
import struct
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import capsctl
import capsctl.models
from capsctl.checkpoint import (
    capture_rng_state,
    load_checkpoint,
    load_tensors,
    model_tensors,
    pack_training_state,
    read_header,
    read_metadata,
    restore_rng_state,
    save_checkpoint,
    strip_training_state,
    unpack_training_state,
)
from capsctl.checkpoint import format as checkpoint_format
from capsctl.config import Preset, preset_to_dict
from capsctl.errors import CheckpointError
from capsctl.models.spec import ModelConfig


def fake_build(cfg: ModelConfig) -> nn.Module:
    """A small stand-in for capsctl.models.build_model_from_config."""
    return nn.Sequential(
        nn.Linear(cfg.in_channels * 4, 8),
        nn.BatchNorm1d(8),
        nn.Dropout(cfg.dropout),
        nn.Linear(8, cfg.num_classes),
    )


@pytest.fixture(autouse=True)
def fake_models(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(capsctl.models, "build_model_from_config", fake_build, raising=False)


def make_metadata(cfg: ModelConfig | None = None) -> dict[str, Any]:
    preset = Preset(name="tiny", model=cfg or ModelConfig(num_classes=3, in_channels=1))
    return {
        "preset": preset_to_dict(preset),
        "epoch": 7,
        "metrics": {"val_acc": 0.875, "loss": [1.5, 0.25]},
        "classes": ["cat", "dog", "ému"],
        "normalization": {"mean": [0.5], "std": [0.25]},
        "input_size": 32,  # the model's (ModelConfig default); checked when read
        "dataset_fingerprint": "abc123",
    }


def trained_model(cfg: ModelConfig) -> nn.Module:
    torch.manual_seed(0)
    model = fake_build(cfg)
    model.train()
    model(torch.randn(16, cfg.in_channels * 4))  # moves BatchNorm running stats
    return model


def saved(tmp_path: Path, name: str = "ckpt.safetensors") -> Path:
    meta = make_metadata()
    cfg = ModelConfig(**{**meta["preset"]["model"], "layers": []})
    path = tmp_path / name
    save_checkpoint(path, model_tensors(trained_model(cfg)), meta)
    return path


# --------------------------------------------------------------------------------------------
# Round trip
# --------------------------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path: Path) -> None:
    cfg = ModelConfig(num_classes=3, in_channels=1)
    model = trained_model(cfg)
    meta = make_metadata(cfg)
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, model_tensors(model), meta)

    loaded, read = capsctl.load_checkpoint(path)
    assert not loaded.training
    for (k1, v1), (k2, v2) in zip(
        model.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert k1 == k2 and torch.equal(v1, v2)
    assert read == {
        **meta,
        "capsctl_version": capsctl.__version__,
        "torch_version": torch.__version__,
    }
    x = torch.randn(5, 4)
    model.eval()
    assert torch.equal(model(x), loaded(x))

    infos, raw = read_header(path)
    assert raw["format"] == "capsctl"
    assert json.loads(raw["epoch"]) == 7
    assert infos["model.0.weight"]["shape"] == [8, 4]


def test_tensors_are_stored_detached_contiguous_and_unshared(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4).requires_grad_()
    tensors = {
        "model.a": base,
        "model.a_t": base.t(),  # non-contiguous view sharing storage
        "model.row": base[1],  # a view sharing storage
        "model.same": base,  # the very same tensor twice
        "model.empty": torch.zeros(0),
        "model.empty2": torch.zeros(0, 3),
        "model.scalar": torch.tensor(3, dtype=torch.int64),
        "model.flags": torch.tensor([True, False]),
        "model.half": torch.ones(2, dtype=torch.bfloat16),
    }
    path = tmp_path / "t.safetensors"
    save_checkpoint(path, tensors, {})
    loaded = load_tensors(path)
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor.detach()) and loaded[name].dtype == tensor.dtype


def test_bad_metadata_is_rejected_before_writing(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    with pytest.raises(CheckpointError, match="metadata 'x' is not JSON-serializable"):
        save_checkpoint(path, {}, {"x": object()})
    with pytest.raises(CheckpointError, match="'format' is reserved"):
        save_checkpoint(path, {}, {"format": "pt"})
    assert not path.exists()


def test_save_creates_the_folder(tmp_path: Path) -> None:
    path = tmp_path / "runs" / "a" / "last.safetensors"
    save_checkpoint(path, {"model.w": torch.ones(1)}, {"epoch": 1})
    assert read_metadata(path)["epoch"] == 1


# --------------------------------------------------------------------------------------------
# Atomic writes
# --------------------------------------------------------------------------------------------


def _full_disk(file: Any, data: bytes) -> None:
    file.write(data[: len(data) // 2])
    file.flush()
    raise OSError(errno.ENOSPC, "No space left on device")


def test_failed_write_keeps_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "last.safetensors"
    save_checkpoint(path, {"model.w": torch.ones(1000)}, {"epoch": 1})
    before = path.read_bytes()
    monkeypatch.setattr(checkpoint_format, "_write_all", _full_disk)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(path, {"model.w": torch.zeros(1000)}, {"epoch": 2})
    assert str(info.value) == (
        f"could not write {path}: No space left on device; the previous file is unchanged"
    )
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.safetensors"]
    assert read_metadata(path)["epoch"] == 1


def test_failed_first_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpoint_format, "_write_all", _full_disk)
    with pytest.raises(CheckpointError, match="No space left on device"):
        save_checkpoint(tmp_path / "new.safetensors", {"model.w": torch.ones(10)}, {})
    assert list(tmp_path.iterdir()) == []


def test_failed_rename_keeps_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "last.safetensors"
    save_checkpoint(path, {"model.w": torch.ones(3)}, {"epoch": 1})
    before = path.read_bytes()

    def broken_replace(src: Any, dst: Any) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(checkpoint_format.os, "replace", broken_replace)
    with pytest.raises(CheckpointError, match="previous file is unchanged"):
        save_checkpoint(path, {"model.w": torch.zeros(3)}, {"epoch": 2})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["last.safetensors"]


# --------------------------------------------------------------------------------------------
# Corrupt and foreign files
# --------------------------------------------------------------------------------------------


def _raw_safetensors(header: dict[str, Any], data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _valid_bytes(tmp_path: Path) -> bytes:
    return saved(tmp_path, "valid.safetensors").read_bytes()


CORRUPT: dict[str, Callable[[Path], bytes]] = {
    "empty": lambda tmp: b"",
    "shorter than 8 bytes": lambda tmp: b"\x01\x02\x03",
    "truncated data": lambda tmp: _valid_bytes(tmp)[:-10],
    "truncated header": lambda tmp: _valid_bytes(tmp)[:40],
    "trailing bytes": lambda tmp: _valid_bytes(tmp) + b"garbage!",
    "random bytes": lambda tmp: random.Random(0).randbytes(4096),
    "header length too large": lambda tmp: struct.pack("<Q", 2**40) + b"{}" + b"\0" * 64,
    "header length past the end": lambda tmp: struct.pack("<Q", 500) + b"{}      ",
    "header not JSON": lambda tmp: struct.pack("<Q", 8) + b"not json",
    "header not an object": lambda tmp: struct.pack("<Q", 8) + b"[1, 2]  ",
    "entry without offsets": lambda tmp: _raw_safetensors(
        {"a": {"dtype": "F32", "shape": [1]}}, b"\0" * 4
    ),
    "unknown dtype": lambda tmp: _raw_safetensors(
        {"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4
    ),
    "size does not match shape": lambda tmp: _raw_safetensors(
        {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4
    ),
    "offsets outside the file": lambda tmp: _raw_safetensors(
        {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8
    ),
    "overlapping offsets": lambda tmp: _raw_safetensors(
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        },
        b"\0" * 12,
    ),
    "gap between tensors": lambda tmp: _raw_safetensors(
        {
            "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
        },
        b"\0" * 12,
    ),
    "metadata not strings": lambda tmp: _raw_safetensors({"__metadata__": {"format": 1}}, b""),
}


@pytest.mark.parametrize("case", list(CORRUPT))
@pytest.mark.parametrize("reader", [read_header, read_metadata, load_tensors, load_checkpoint])
def test_corrupt_files_raise_checkpoint_error(
    tmp_path: Path, case: str, reader: Callable[[Path], Any]
) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(CORRUPT[case](tmp_path))
    with pytest.raises(CheckpointError) as info:
        reader(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    assert "not a valid safetensors file" in message


def test_pickle_files_are_never_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    zipped = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, zipped)
    legacy = tmp_path / "legacy.pth"
    legacy.write_bytes(pickle.dumps({"w": [1.0, 2.0]}, protocol=4))

    def no_unpickling(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("unpickling attempted")

    monkeypatch.setattr(pickle, "load", no_unpickling)
    monkeypatch.setattr(pickle, "loads", no_unpickling)
    monkeypatch.setattr(torch, "load", no_unpickling)
    for path in (zipped, legacy):
        for reader in (read_header, read_metadata, load_tensors, load_checkpoint):
            with pytest.raises(CheckpointError, match="never loads pickles") as info:
                reader(path)
            assert str(path) in str(info.value)


def test_foreign_safetensors_file(tmp_path: Path) -> None:
    path = tmp_path / "hf.safetensors"
    save_file({"w": torch.ones(2)}, str(path), metadata={"format": "pt"})
    assert read_header(path)[1] == {"format": "pt"}
    assert torch.equal(load_tensors(path)["w"], torch.ones(2))
    for reader in (read_metadata, load_checkpoint):
        with pytest.raises(
            CheckpointError, match="was not written by capsctl \\(no capsctl metadata\\)"
        ):
            reader(path)


def test_missing_file_and_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        read_metadata(tmp_path / "nope.safetensors")
    with pytest.raises(CheckpointError, match="is a folder"):
        read_metadata(tmp_path)


# --------------------------------------------------------------------------------------------
# Metadata / tensor consistency
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "detail"),
    [
        (lambda t: t.pop("model.3.bias"), "missing model.3.bias"),
        (lambda t: t.update({"model.9.weight": torch.ones(1)}), "unexpected model.9.weight"),
        (
            lambda t: t.update({"model.3.bias": torch.ones(5)}),
            "model.3.bias has shape (5,), the model needs (3,)",
        ),
    ],
)
def test_metadata_tensor_mismatch(
    tmp_path: Path, change: Callable[[dict], Any], detail: str
) -> None:
    meta = make_metadata()
    tensors = model_tensors(fake_build(ModelConfig(num_classes=3, in_channels=1)))
    change(tensors)
    path = tmp_path / "m.safetensors"
    save_checkpoint(path, tensors, meta)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert f"{path}: its metadata does not match its tensors (" in str(info.value)
    assert detail in str(info.value)


def test_metadata_without_model_config(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_checkpoint(path, {"model.w": torch.ones(1)}, {"epoch": 1})
    with pytest.raises(CheckpointError, match="no model configuration"):
        load_checkpoint(path)
    save_checkpoint(path, {"model.w": torch.ones(1)}, {"preset": {"model": {"arch": "vgg"}}})
    with pytest.raises(CheckpointError, match="stored model configuration is invalid"):
        load_checkpoint(path)


# --------------------------------------------------------------------------------------------
# Training state
# --------------------------------------------------------------------------------------------


def round_trip(
    tmp_path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> tuple[dict, dict]:
    path = tmp_path / "state.safetensors"
    save_checkpoint(path, tensors, meta)
    return load_tensors(path), read_metadata(path)


def _net() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 4, generator=gen), torch.randint(0, 2, (8,), generator=gen)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd-momentum": lambda p: torch.optim.SGD(
        p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4
    ),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.05),
    "adamw-amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_round_trip_gives_identical_steps(tmp_path: Path, name: str) -> None:
    model = _net()
    optimizer = OPTIMIZERS[name](model.parameters())
    for i in range(3):
        _step(model, optimizer, i)
    tensors, meta = pack_training_state(optimizer.state_dict(), None, None, {})
    assert any(k.startswith("optim.") for k in tensors)
    tensors, meta = round_trip(tmp_path, {**model_tensors(model), **tensors}, meta)

    resumed = _net()
    resumed.load_state_dict(
        {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
    )
    resumed_optimizer = OPTIMIZERS[name](resumed.parameters())
    optimizer_state, scheduler_state, ema_state, rng = unpack_training_state(tensors, meta)
    assert (scheduler_state, ema_state, rng) == (None, None, {})
    assert list(optimizer_state["state"]) == list(optimizer.state_dict()["state"])  # int keys
    assert optimizer_state["param_groups"] == optimizer.state_dict()["param_groups"]  # tuples too
    resumed_optimizer.load_state_dict(optimizer_state)

    for i in range(3, 6):
        _step(model, optimizer, i)
        _step(resumed, resumed_optimizer, i)
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def _linear_warmup_cosine(opt: torch.optim.Optimizer) -> Any:
    sched = torch.optim.lr_scheduler
    return sched.SequentialLR(
        opt,
        [
            sched.LinearLR(opt, start_factor=0.1, total_iters=4),
            sched.CosineAnnealingLR(opt, T_max=10),
        ],
        milestones=[4],
    )


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "multistep": lambda o: torch.optim.lr_scheduler.MultiStepLR(
        o, milestones=[2, 5, 8, 8], gamma=0.5
    ),
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1.0, total_steps=20),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=7, eta_min=1e-3),
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 0.9**e),
    "sequential": _linear_warmup_cosine,
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_scheduler_round_trip_gives_identical_lrs(tmp_path: Path, name: str) -> None:
    def fresh() -> tuple[torch.optim.Optimizer, Any]:
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
        return opt, SCHEDULERS[name](opt)

    optimizer, scheduler = fresh()
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    tensors, meta = pack_training_state(optimizer.state_dict(), scheduler.state_dict(), None, {})
    tensors, meta = round_trip(tmp_path, tensors, meta)
    optimizer_state, scheduler_state, _, _ = unpack_training_state(tensors, meta)
    if name == "multistep":
        assert isinstance(scheduler_state["milestones"], Counter)
        assert scheduler_state["milestones"] == Counter({2: 1, 5: 1, 8: 2})

    resumed_optimizer, resumed = fresh()
    resumed_optimizer.load_state_dict(optimizer_state)
    resumed.load_state_dict(scheduler_state)
    expected, got = [], []
    for _ in range(10):
        optimizer.step()
        scheduler.step()
        expected.append(scheduler.get_last_lr())
        resumed_optimizer.step()
        resumed.step()
        got.append(resumed.get_last_lr())
    assert got == expected
    assert resumed_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]


def test_rng_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(7)
    random.gauss(0, 1)  # leaves a cached gaussian in Python's state
    np.random.standard_normal()  # and in numpy's
    state = capture_rng_state()
    expected = (
        torch.rand(5),
        random.random(),
        random.gauss(0, 1),
        np.random.rand(3),
        np.random.standard_normal(),
    )

    tensors, meta = pack_training_state({"state": {}, "param_groups": []}, None, None, state)
    tensors, meta = round_trip(tmp_path, tensors, meta)
    torch.manual_seed(999)
    random.seed(999)
    np.random.seed(999)
    restore_rng_state(unpack_training_state(tensors, meta)[3])
    got = (
        torch.rand(5),
        random.random(),
        random.gauss(0, 1),
        np.random.rand(3),
        np.random.standard_normal(),
    )
    assert torch.equal(got[0], expected[0])
    assert got[1:3] == expected[1:3]
    assert np.array_equal(got[3], expected[3]) and got[4] == expected[4]


def test_generic_structures_round_trip_exactly(tmp_path: Path) -> None:
    structure = {
        "state": {0: {"step": torch.tensor(3.0), "buf": torch.ones(2)}, 7: {}},
        "ints_and_floats": {1: 2.5, 2.5: -1, False: None},
        "tuple": (1, (2.0, "x"), [None, False]),
        "counter": Counter({3: 2, 10: 1}),
        "ordered": OrderedDict([("b", 1), ("a", 2)]),
        "tag_like": {"__tensor__": "not a tensor", "other": 1},
        "single_tag_like": {"__tuple__": [1, 2]},
        "nan": float("nan"),
        "ndarray": np.arange(6, dtype=np.uint32).reshape(2, 3),
        "npscalar": np.float32(1.5),
        "same_name": {"0": torch.zeros(1), 0: torch.ones(1)},
    }
    tensors, meta = pack_training_state(
        structure, {"sched": torch.arange(3)}, {"w": torch.ones(2)}, {}
    )
    tensors, meta = round_trip(tmp_path, tensors, meta)
    back, sched, ema, _ = unpack_training_state(tensors, meta)
    assert torch.equal(back["state"][0]["step"], torch.tensor(3.0)) and back["state"][7] == {}
    assert back["ints_and_floats"] == {1: 2.5, 2.5: -1, False: None}
    assert [type(k) for k in back["ints_and_floats"]] == [int, float, bool]
    assert back["tuple"] == (1, (2.0, "x"), [None, False])
    assert type(back["counter"]) is Counter and back["counter"] == structure["counter"]
    assert type(back["ordered"]) is OrderedDict and list(back["ordered"]) == ["b", "a"]
    assert back["tag_like"] == structure["tag_like"]
    assert back["single_tag_like"] == {"__tuple__": [1, 2]}
    assert back["nan"] != back["nan"]
    assert back["ndarray"].dtype == np.uint32 and np.array_equal(
        back["ndarray"], structure["ndarray"]
    )
    assert back["npscalar"] == np.float32(1.5) and back["npscalar"].dtype == np.float32
    assert torch.equal(back["same_name"]["0"], torch.zeros(1))
    assert torch.equal(back["same_name"][0], torch.ones(1))
    assert torch.equal(sched["sched"], torch.arange(3)) and torch.equal(ema["w"], torch.ones(2))


def test_unsupported_values_are_reported() -> None:
    with pytest.raises(CheckpointError, match="cannot store function at optim.hook"):
        pack_training_state({"hook": lambda: None}, None, None, {})


def test_unpack_without_training_state() -> None:
    with pytest.raises(CheckpointError, match="no training state"):
        unpack_training_state({}, {"epoch": 1})


def test_full_resume_matches_uninterrupted_training(tmp_path: Path) -> None:
    """Model + optimizer + scheduler + RNG saved mid-run and restored reproduce the run."""

    def setup() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, opt, torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3, 6])

    def train_epoch(model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> None:
        model.train()
        x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()

    model, opt, sched = setup()
    for _ in range(8):
        train_epoch(model, opt, sched)
    reference = [p.detach().clone() for p in model.parameters()]

    model, opt, sched = setup()
    for _ in range(4):
        train_epoch(model, opt, sched)
    state_tensors, state_meta = pack_training_state(
        opt.state_dict(), sched.state_dict(), None, capture_rng_state()
    )
    path = tmp_path / "last.safetensors"
    save_checkpoint(
        path,
        {**model_tensors(model), **state_tensors},
        {**state_meta, "epoch": 4},  # no preset: these tensors are not a capsctl model
    )
    for _ in range(3):  # disturb everything
        train_epoch(model, opt, sched)

    model, opt, sched = setup()
    tensors, meta = load_tensors(path), read_metadata(path)
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    optimizer_state, scheduler_state, _, rng = unpack_training_state(tensors, meta)
    opt.load_state_dict(optimizer_state)
    sched.load_state_dict(scheduler_state)
    restore_rng_state(rng)
    for _ in range(meta["epoch"], 8):
        train_epoch(model, opt, sched)
    for a, b in zip(reference, model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_strip_training_state(tmp_path: Path) -> None:
    cfg = ModelConfig(num_classes=3, in_channels=1)
    model = trained_model(cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 4)).sum().backward()
    optimizer.step()
    ema = {k: v.clone() for k, v in model.state_dict().items()}
    tensors, state_meta = pack_training_state(
        optimizer.state_dict(), None, ema, capture_rng_state()
    )
    full = tmp_path / "last.safetensors"
    meta = make_metadata(cfg)
    save_checkpoint(full, {**model_tensors(model), **tensors}, {**meta, **state_meta})
    assert {k.split(".")[0] for k in read_header(full)[0]} == {"model", "optim", "ema", "rng"}

    light = tmp_path / "best.safetensors"
    strip_training_state(full, light)
    infos, _ = read_header(light)
    assert set(infos) == set(model_tensors(model))
    stripped = read_metadata(light)
    assert "training_state" not in stripped
    assert stripped == {k: v for k, v in read_metadata(full).items() if k != "training_state"}
    assert light.stat().st_size < full.stat().st_size
    loaded, _ = load_checkpoint(light)
    for a, b in zip(model.state_dict().values(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(CheckpointError, match="no training state"):
        unpack_training_state(load_tensors(light), stripped)
    strip_training_state(full, full)  # in place
    assert read_header(full)[0].keys() == infos.keys()
