"""Model folders in the Hugging Face layout: export ``hf``, ``from_pretrained``, the model card."""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import run_cli
from safetensors.torch import load_file, save_file

import capsctl
from capsctl.checkpoint import (
    capture_rng_state,
    load_checkpoint,
    model_tensors,
    pack_training_state,
    read_header,
    read_metadata,
    save_checkpoint,
)
from capsctl.cli import main
from capsctl.config import Preset, preset_to_dict, resolve_config
from capsctl.errors import CapsctlError, CheckpointError, UsageError
from capsctl.export import export_checkpoint
from capsctl.models import build_model_from_config

CLASSES = ["zero", "one", "two"]
SIZE = 12
TEST_RESULT = {
    "split": "test",
    "dataset": "mnist",
    "count": 10000,
    "loss": 0.5,
    "accuracy": 0.98765,
    "top5": 1.0,
    "metric": "top-1",
}
HAS_ONNX = all(importlib.util.find_spec(p) for p in ("onnx", "onnxscript", "onnxruntime"))


def tiny_config():
    return resolve_config(
        {
            "base": "mnist-caps",
            "input_size": SIZE,
            "num_classes": len(CLASSES),
            "primary_types": 4,
            "primary_dim": 4,
            "layers": [{"kind": "conv", "types": 4, "pose_dim": 4, "kernel": 3, "stride": 1}],
            "iterations": 2,
        }
    )


def write_checkpoint(path: Path, *, test: bool = True) -> Path:
    """A tiny capsule net checkpoint with training state, like the trainer's last/best files."""
    cfg = tiny_config()
    torch.manual_seed(0)
    model = build_model_from_config(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 1, SIZE, SIZE)).sum().backward()
    opt.step()
    preset = Preset(name="tiny", model=cfg)
    preset.data.dataset = "mnist"
    metadata: dict[str, Any] = {
        "preset": preset_to_dict(preset),
        "classes": CLASSES,
        "normalization": {"name": "mnist", "mean": [0.5], "std": [0.25]},
        "input_size": SIZE,
        "in_channels": 1,
        "dataset": "mnist",
        "epoch": 3,
        "metrics": {"val_accuracy": 0.75},
    }
    if test:
        metadata["test"] = TEST_RESULT
        metadata["test_name"] = "mnist"
    tensors = model_tensors(model)
    extra, meta = pack_training_state(opt.state_dict(), None, None, capture_rng_state())
    tensors.update(extra)
    metadata.update(meta)
    save_checkpoint(path, tensors, metadata)
    return path


def images(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randn(n, 1, SIZE, SIZE, generator=torch.Generator().manual_seed(seed))


def logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def front_matter(card: str) -> dict[str, Any]:
    assert card.startswith("---\n")
    head, _, _ = card[4:].partition("\n---\n")
    return yaml.safe_load(head)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("hf")
    ckpt = write_checkpoint(folder / "tiny.safetensors")
    result = export_checkpoint(ckpt, "hf", folder / "tiny-caps")
    assert result.path == folder / "tiny-caps" and result.format == "hf"
    return ckpt, result.path


def copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# --------------------------------------------------------------------------------------------
# Export and load back
# --------------------------------------------------------------------------------------------


def test_export_hf_then_from_pretrained_gives_identical_logits(exported) -> None:
    ckpt, folder = exported
    model = capsctl.from_pretrained(folder)
    assert not model.training
    reference, _ = load_checkpoint(ckpt)
    for n in (1, 5):
        x = images(n, seed=n)
        assert torch.equal(logits(model, x), logits(reference, x))
    assert model.pretrained_cfg["input_size"] == [1, SIZE, SIZE]
    assert model.pretrained_cfg["label_names"] == CLASSES


def test_folder_holds_three_files_and_weights_only(exported) -> None:
    ckpt, folder = exported
    assert sorted(p.name for p in folder.iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
    ]
    assert sorted(p.name for p in folder.parent.iterdir()) == ["tiny-caps", "tiny.safetensors"]
    header, raw = read_header(folder / "model.safetensors")
    assert raw.keys() == {"format", "capsctl_config"} and raw["format"] == "pt"
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    assert json.loads(raw["capsctl_config"]) == config  # the weights' record of config.json
    stored = load_file(str(folder / "model.safetensors"))
    expected = {
        k[len("model.") :]: v for k, v in load_file(str(ckpt)).items() if k.startswith("model.")
    }
    assert stored.keys() == expected.keys() == set(header)  # no optimizer/RNG state, no prefix
    assert all(torch.equal(stored[k], expected[k]) for k in expected)


def test_config_json_uses_timm_keys(exported) -> None:
    ckpt, folder = exported
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    meta = read_metadata(ckpt)
    assert config["architecture"] == "capsnet"  # not exactly a registered model
    assert config["num_classes"] == 3
    assert config["input_size"] == [1, 12, 12]
    assert config["mean"] == [0.5] and config["std"] == [0.25]
    assert config["label_names"] == ["zero", "one", "two"]
    assert config["model_config"] == meta["preset"]["model"]
    assert config["preset"] == meta["preset"]
    assert config["capsctl_version"] == capsctl.__version__
    assert config["test"]["split"] == "test" and config["test"]["dataset"] == "mnist"
    assert config["test"]["accuracy"] == 0.98765 and config["test_name"] == "mnist"
    assert "training_state" not in config


def test_registered_model_is_named_architecture(tmp_path: Path) -> None:
    cfg = resolve_config("mnist-caps")
    torch.manual_seed(0)
    model = build_model_from_config(cfg)
    meta = {
        "preset": preset_to_dict(Preset(name="m", model=cfg)),
        "classes": [str(i) for i in range(10)],
    }
    save_checkpoint(tmp_path / "m.safetensors", model_tensors(model), meta)
    export_checkpoint(tmp_path / "m.safetensors", "hf")  # the default: m-hf, in the current folder
    config = json.loads((Path("m-hf") / "config.json").read_text())
    assert config["architecture"] == "mnist-caps"
    assert config["input_size"] == [1, 28, 28]


def test_folder_reads_as_the_checkpoint_without_training_state(exported) -> None:
    ckpt, folder = exported
    meta = read_metadata(ckpt)
    del meta["training_state"]
    assert read_metadata(folder) == meta
    _, loaded_meta = load_checkpoint(folder)
    assert loaded_meta == meta


def test_safetensors_export_of_a_folder(exported, tmp_path: Path) -> None:
    ckpt, folder = exported
    result = export_checkpoint(folder, "safetensors", tmp_path / "release.safetensors")
    assert result.max_abs_diff == 0.0
    x = images(4)
    model, _ = load_checkpoint(result.path)
    reference, _ = load_checkpoint(ckpt)
    assert torch.equal(logits(model, x), logits(reference, x))


# --------------------------------------------------------------------------------------------
# Model card
# --------------------------------------------------------------------------------------------


def test_model_card_front_matter_holds_the_results(exported) -> None:
    ckpt, folder = exported
    card = (folder / "README.md").read_text(encoding="utf-8")
    front = front_matter(card)
    assert front["library_name"] == "capsctl"
    assert front["license"] == "mit"
    assert "capsule-network" in front["tags"] and "image-classification" in front["tags"]
    assert front["datasets"] == ["ylecun/mnist"]
    assert front["metrics"] == ["accuracy"]
    (entry,) = front["model-index"]
    assert entry["name"] == "tiny-caps"
    (result,) = entry["results"]
    assert result["task"]["type"] == "image-classification"
    assert result["dataset"] == {"name": "MNIST", "type": "ylecun/mnist", "split": "test"}
    (metric,) = result["metrics"]
    assert metric["type"] == "accuracy" and metric["value"] == 98.77
    assert metric["name"] == "Top-1 accuracy (%)"


def test_model_card_parses_as_the_hub_reads_it(exported) -> None:
    hub = pytest.importorskip("huggingface_hub")
    _, folder = exported
    card = hub.ModelCard.load(folder / "README.md")  # a local file: no network
    assert card.data.library_name == "capsctl" and card.data.model_name == "tiny-caps"
    (result,) = card.data.eval_results
    assert (result.task_type, result.dataset_type, result.dataset_split) == (
        "image-classification",
        "ylecun/mnist",
        "test",
    )
    assert (result.metric_type, result.metric_value) == ("accuracy", 98.77)


def test_model_card_body(exported) -> None:
    ckpt, folder = exported
    card = (folder / "README.md").read_text(encoding="utf-8")
    model, _ = load_checkpoint(ckpt)
    n_params = sum(p.numel() for p in model.parameters())
    assert "arXiv:2002.04764" in card and "ICLR 2020" in card
    assert f"| parameters | {n_params:,} " in card
    from capsctl.compare import count_flops

    assert f"| GFLOPs per image | {count_flops(model, (1, SIZE, SIZE)):.4g} |" in card
    assert "2 x multiply-accumulates" in card
    assert (
        "**top-1 accuracy 98.77%, top-5 100.00%** on the test split of MNIST: 10,000 images" in card
    )
    assert "best validation accuracy (epoch 3, 75.00%" in card
    assert 'capsctl.from_pretrained("tiny-caps")' in card and "capsctl eval tiny-caps" in card
    assert "## Licence" in card and "`mit`" in card


def test_model_card_without_test_result(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "plain.safetensors", test=False)
    result = export_checkpoint(ckpt, "hf", tmp_path / "plain-hf")
    card = (result.path / "README.md").read_text(encoding="utf-8")
    front = front_matter(card)
    assert "model-index" not in front and front["library_name"] == "capsctl"
    assert "Not evaluated: the checkpoint holds no test result" in card


# --------------------------------------------------------------------------------------------
# Strict loading and damaged folders
# --------------------------------------------------------------------------------------------


def test_missing_tensor_is_refused_by_name(exported, tmp_path: Path) -> None:
    _, folder = exported
    broken = copy_folder(folder, tmp_path / "broken")
    tensors = load_file(str(broken / "model.safetensors"))
    victim = sorted(tensors)[0]
    del tensors[victim]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    for load in (capsctl.from_pretrained, load_checkpoint):
        with pytest.raises(CheckpointError) as info:
            load(broken)
        message = str(info.value)
        assert f"missing tensor {victim!r}" in message and "\n" not in message
        assert str(broken / "model.safetensors") in message


def test_extra_tensor_is_refused_by_name(exported, tmp_path: Path) -> None:
    _, folder = exported
    broken = copy_folder(folder, tmp_path / "broken")
    tensors = load_file(str(broken / "model.safetensors"))
    tensors["bogus.weight"] = torch.ones(2)
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="unexpected tensor 'bogus.weight'"):
        capsctl.from_pretrained(broken)


def test_incomplete_or_foreign_folders(exported, tmp_path: Path) -> None:
    _, folder = exported
    no_config = copy_folder(folder, tmp_path / "no-config")
    (no_config / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        read_metadata(no_config)
    no_weights = copy_folder(folder, tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors is missing"):
        capsctl.from_pretrained(no_weights)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="is a folder, not a checkpoint file"):
        read_metadata(tmp_path / "empty")
    bad = copy_folder(folder, tmp_path / "bad")
    weights = bad / "model.safetensors"  # exported before the record: config.json is read
    save_file(load_file(str(weights)), str(weights), metadata={"format": "pt"})
    config = json.loads((bad / "config.json").read_text())
    config["input_size"] = [1, 12]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config.json: input_size is \[1, 12\]"):
        read_metadata(bad)
    del config["model_config"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="has no model_config"):
        read_metadata(bad)


#: Edits of config.json that contradict the weights' record, by the key the error names.
CONTRADICTIONS = {
    "label_names": lambda c: c.update(label_names=list(reversed(c["label_names"]))),
    "mean": lambda c: c.update(mean=[0.9]),
    "std": lambda c: c.update(std=[2.0]),
    "num_classes": lambda c: c.update(num_classes=4),
    "model_config.router.iterations": lambda c: c["model_config"]["router"].update(iterations=3),
    "preset.data.normalization": lambda c: c["preset"]["data"].update(normalization="none"),
    "test.accuracy": lambda c: c["test"].update(accuracy=0.999),
}


@pytest.mark.parametrize("key", list(CONTRADICTIONS))
def test_a_config_json_contradicting_its_weights_is_the_same_error_everywhere(
    exported, tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str
) -> None:
    """The weights' record is the source of truth; predict used edited labels and
    normalization where eval did not (issue 37, M5)."""
    from PIL import Image

    _, folder = exported
    edited = copy_folder(folder, tmp_path / "edited")
    config = json.loads((edited / "config.json").read_text(encoding="utf-8"))
    CONTRADICTIONS[key](config)
    (edited / "config.json").write_text(json.dumps(config), encoding="utf-8")
    image = tmp_path / "x.png"
    Image.new("L", (SIZE, SIZE), 128).save(image)
    commands = [
        ["predict", str(edited), str(image), "--device", "cpu"],
        ["eval", str(edited), "--device", "cpu"],
        ["compare", str(edited)],
        ["export", str(edited), "--format", "safetensors", "--out", str(tmp_path / "x.st")],
    ]
    errors = set()
    for args in commands:
        code, _, err = run_cli(capsys, args)
        assert code == 1 and len(err.strip().splitlines()) == 1, (args, err)
        errors.add(err.strip())
    assert len(errors) == 1, errors  # one line, the same from every command
    message = errors.pop()
    assert f"{edited / 'config.json'}: {key} differs from the copy recorded in" in message
    with pytest.raises(CheckpointError) as info:
        capsctl.from_pretrained(edited)
    assert str(info.value) in message


def test_extra_keys_in_config_json_are_ignored(exported, tmp_path: Path) -> None:
    _, folder = exported
    edited = copy_folder(folder, tmp_path / "edited")
    config = json.loads((edited / "config.json").read_text(encoding="utf-8"))
    config["tags"] = ["capsules"]
    (edited / "config.json").write_text(json.dumps(config), encoding="utf-8")
    assert read_metadata(edited) == read_metadata(folder)


def test_a_folder_exported_before_the_record_reads_config_json(exported, tmp_path: Path) -> None:
    _, folder = exported
    old = copy_folder(folder, tmp_path / "old")
    weights = old / "model.safetensors"
    save_file(load_file(str(weights)), str(weights), metadata={"format": "pt"})
    assert read_metadata(old) == read_metadata(folder)
    config = json.loads((old / "config.json").read_text(encoding="utf-8"))
    config["num_classes"] = 4  # contradicts model_config, which the model is built from
    (old / "config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(CheckpointError, match="config.json: num_classes is 4, not model_config"):
        read_metadata(old)


# --------------------------------------------------------------------------------------------
# Writing the folder
# --------------------------------------------------------------------------------------------


def test_existing_folders(exported, tmp_path: Path) -> None:
    ckpt, _ = exported
    empty = tmp_path / "empty"
    empty.mkdir()
    export_checkpoint(ckpt, "hf", empty)
    assert (empty / "config.json").is_file()

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("keep me")
    with pytest.raises(CapsctlError, match="exists and is not empty") as info:
        export_checkpoint(ckpt, "hf", taken)
    assert str(taken) in str(info.value)
    assert [p.name for p in taken.iterdir()] == ["notes.txt"]
    with pytest.raises(UsageError, match="is not an exported model folder"):
        export_checkpoint(ckpt, "hf", taken, overwrite=True)  # not a model folder: kept
    assert [p.name for p in taken.iterdir()] == ["notes.txt"]

    export_checkpoint(ckpt, "hf", empty, overwrite=True)  # an earlier model folder: replaced
    assert sorted(p.name for p in empty.iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "taken"]  # no temp folders


def test_failed_replace_keeps_the_old_folder(
    exported, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    ckpt, _ = exported
    taken = export_checkpoint(ckpt, "hf", tmp_path / "taken").path  # an earlier export
    before = {p.name: p.read_bytes() for p in taken.iterdir()}
    real = os.rename

    def fail_publish(src: Any, dst: Any) -> None:
        if Path(dst) == taken and Path(src).name.endswith(".tmp"):
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(os, "rename", fail_publish)
    with pytest.raises(CapsctlError, match="No space left on device; nothing was changed"):
        export_checkpoint(ckpt, "hf", taken, overwrite=True)
    assert {p.name: p.read_bytes() for p in taken.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]


def test_overwrite_never_replaces_the_folder_holding_the_checkpoint(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "run" / "best.safetensors", test=False)
    with pytest.raises(UsageError, match="holds the checkpoint"):
        export_checkpoint(ckpt, "hf", tmp_path / "run", overwrite=True)
    assert ckpt.is_file()


def test_parity_failure_writes_nothing(
    exported, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import capsctl.export.hf as hf_export

    ckpt, _ = exported
    real = hf_export._weights_bytes

    def perturbed(state: dict[str, torch.Tensor], *args: Any) -> bytes:
        name = next(k for k, v in state.items() if v.is_floating_point() and v.numel() > 1)
        return real({**state, name: state[name] * 1.5}, *args)

    monkeypatch.setattr(hf_export, "_weights_bytes", perturbed)
    with pytest.raises(CapsctlError, match=r"hf export does not match PyTorch"):
        export_checkpoint(ckpt, "hf", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------
# The command line on a folder
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_folder(
    tiny_trained_run: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """A real (tiny) training run on the bundled Fashion-MNIST subset (the session's, see
    tests/conftest.py) and the model folder to export it to with the CLI."""
    folder = tmp_path_factory.mktemp("exported") / "quickstart-caps"
    return tiny_trained_run / "best.safetensors", folder


def test_cli_export_hf_and_eval_the_folder(
    trained_folder, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, folder = trained_folder
    code, out, err = run_cli(capsys, ["export", str(ckpt), "--format", "hf", "--out", str(folder)])
    assert code == 0, err
    assert f"wrote model folder {folder} (model.safetensors, config.json, README.md" in out
    assert "max |folder - checkpoint| = 0.00e+00" in out

    stored = read_metadata(ckpt)["test"]
    code, out, err = run_cli(capsys, ["eval", str(folder), "--json", "--device", "cpu"])
    assert code == 0, err
    doc = json.loads(out)
    assert doc["count"] == stored["count"] == 2000
    assert doc["accuracy"] == stored["accuracy"]  # same weights, same test split

    front = front_matter((folder / "README.md").read_text(encoding="utf-8"))
    value = front["model-index"][0]["results"][0]["metrics"][0]["value"]
    assert value == round(100 * stored["accuracy"], 2)


@pytest.mark.skipif(not HAS_ONNX, reason="needs capsctl[export] (onnx, onnxscript, onnxruntime)")
def test_cli_export_onnx_from_a_folder(
    exported, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, folder = exported
    out = tmp_path / "model.onnx"
    # the tiny model takes 12x12 images, so the parity check runs on random ones, not MNIST's
    empty = tmp_path / "no-data"
    empty.mkdir()
    code, _, err = run_cli(
        capsys,
        [
            *("export", str(folder), "--format", "onnx", "--out", str(out), "--check-images", "2"),
            *("--data-dir", str(empty)),
        ],
    )
    assert code == 0, err
    info = json.loads((tmp_path / "model.onnx.json").read_text())
    assert info["classes"] == CLASSES and info["parity"]["max_abs_diff"] <= 1e-4


# --------------------------------------------------------------------------------------------
# Hub ids (never the network)
# --------------------------------------------------------------------------------------------

REVISION = "0123456789abcdef0123456789abcdef01234567"


def fill_hub_cache(cache: Path, repo_id: str, folder: Path) -> Path:
    """The huggingface_hub cache layout: models--org--name/{refs/main, snapshots/<rev>/...}."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "README.md"):
        shutil.copy(folder / name, snapshot / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the test tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def offline_hub(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    """HF_HUB_OFFLINE=1 and HF_HUB_CACHE (huggingface_hub reads them at import: patch both)."""
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))


def test_hub_id_resolves_offline_through_the_cache(
    exported, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_network: None
) -> None:
    ckpt, folder = exported
    cache = tmp_path / "hub-cache"
    snapshot = fill_hub_cache(cache, "capsctl-org/tiny-caps", folder)
    offline_hub(monkeypatch, cache)
    monkeypatch.chdir(tmp_path)  # "capsctl-org/tiny-caps" is no local path here

    model = capsctl.from_pretrained("capsctl-org/tiny-caps")
    reference, _ = load_checkpoint(ckpt)
    x = images(3)
    assert torch.equal(logits(model, x), logits(reference, x))
    assert model.pretrained_cfg["label_names"] == CLASSES

    from capsctl.hub import resolve_pretrained

    path = resolve_pretrained(
        "capsctl-org/tiny-caps", revision=REVISION, cache_dir=cache, local_files_only=True
    )
    assert path.resolve() == snapshot.resolve()


def test_hub_id_not_in_the_cache_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_network: None
) -> None:
    offline_hub(monkeypatch, tmp_path / "empty-cache")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError) as info:
        capsctl.from_pretrained("capsctl-org/not-cached")
    message = str(info.value)
    assert message.startswith(
        "capsctl-org/not-cached: config.json is not in the Hugging Face cache"
    )
    assert "\n" not in message


def test_hub_id_without_huggingface_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CapsctlError) as info:
        capsctl.from_pretrained("capsctl-org/tiny-caps")
    assert str(info.value) == (
        "'capsctl-org/tiny-caps' is not a local path; loading it from the Hugging Face Hub "
        "needs huggingface_hub: pip install 'capsctl[hub]'"
    )


@pytest.fixture
def hub_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The Hub ids from_pretrained asked the Hub for (it never gets there in tests)."""
    import capsctl.hub

    calls: list[str] = []

    def from_hub(repo_id: str, **kwargs: Any) -> Path:
        calls.append(repo_id)
        raise CheckpointError(f"{repo_id}: the Hub was asked")

    monkeypatch.setattr(capsctl.hub, "_from_hub", from_hub)
    return calls


@pytest.mark.parametrize(
    "name",
    [
        "./my-model/",
        "./my-model",
        "my-model/",
        "runs/x",  # runs/ is a local folder here
        "runs/x/best.safetensors",
        "org/name.safetensors",
        "~/capsctl-no-such-model",
        "../elsewhere/model",
        "a/b/c",
    ],
)
def test_a_missing_local_path_is_never_a_hub_id(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hub_calls: list[str]
) -> None:
    """from_pretrained('./my-model/') asked the Hub (issue 37, L5)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "runs").mkdir()
    with pytest.raises(CheckpointError) as info:
        capsctl.from_pretrained(name)
    assert str(info.value).startswith(f"no such file or folder: {name}"), info.value
    assert "\n" not in str(info.value) and hub_calls == []


def test_only_an_owner_name_id_goes_to_the_hub(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hub_calls: list[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="the Hub was asked"):
        capsctl.from_pretrained("capsctl-org/tiny-caps")
    assert hub_calls == ["capsctl-org/tiny-caps"]


def test_missing_local_path(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="^no such file or folder: .*nope; pass a model"):
        capsctl.from_pretrained(tmp_path / "nope")
    with pytest.raises(UsageError, match="applies to Hub ids only"):
        capsctl.from_pretrained(tmp_path, revision="main")


def test_cli_hf_export_into_a_taken_folder_needs_overwrite(
    tiny_checkpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tiny_checkpoint()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("keep me")
    args = ["export", str(ckpt), "--format", "hf", "--out", str(taken)]
    with pytest.raises(SystemExit) as info:
        main(args)
    err = capsys.readouterr().err
    assert info.value.code == 1 and str(taken) in err and "--overwrite" in err
    assert [p.name for p in taken.iterdir()] == ["notes.txt"]
    with pytest.raises(SystemExit) as info:  # not a model folder: kept even with --overwrite
        main([*args, "--overwrite"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "not an exported model folder" in err
    assert [p.name for p in taken.iterdir()] == ["notes.txt"]
    (taken / "notes.txt").unlink()
    main([*args, "--json"])
    main([*args, "--overwrite", "--json"])  # an earlier model folder: replaced
    assert (taken / "config.json").is_file()


def test_model_card_names_the_backbone_width_and_the_primary_convolution() -> None:
    from capsctl.export.card import model_card

    full = resolve_config("multimnist-caps-full").to_dict()
    card = model_card({"preset": {"model": full}}, name="m", params={"total": 1}, gflops=None)
    assert "| backbone | simple, 1024 channels |" in card
    assert "| primary capsules | 16 types, pose dim 64, 3x3 conv of stride 2 |" in card
    plain = resolve_config("multimnist-caps").to_dict()
    card = model_card({"preset": {"model": plain}}, name="m", params={"total": 1}, gflops=None)
    assert "| backbone | simple |" in card
    assert "| primary capsules | 16 types, pose dim 16 |" in card
