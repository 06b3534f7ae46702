"""Tests for capsctl.export: ONNX, torch.export (.pt2) and weights-only release files."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from capsctl import __version__
from capsctl.checkpoint import (
    capture_rng_state,
    load_checkpoint,
    model_tensors,
    pack_training_state,
    read_header,
    read_metadata,
    save_checkpoint,
)
from capsctl.config import Preset, preset_to_dict, resolve_config
from capsctl.errors import CapsctlError, UsageError
from capsctl.export import ExportResult, default_output_path, export_checkpoint
from capsctl.models import build_model_from_config
from capsctl.outputs import EXPORT_SIDECAR, ONNX

CLASSES = ["zero", "one", "two"]
SIZE = 12

HAS_ONNX = all(importlib.util.find_spec(p) for p in ("onnx", "onnxscript", "onnxruntime"))


def tiny_config(**changes: Any):
    spec = {
        "base": "mnist-caps",
        "input_size": SIZE,
        "num_classes": len(CLASSES),
        "primary_types": 4,
        "primary_dim": 4,
        "layers": [{"kind": "conv", "types": 4, "pose_dim": 4, "kernel": 3, "stride": 1}],
        "iterations": 2,
        **changes,
    }
    return resolve_config(spec)


def write_tiny_checkpoint(
    path: Path, *, training_state: bool = True, dataset: str | None = None, **changes: Any
) -> Path:
    """A tiny capsule network checkpoint, with optimizer/RNG state like the trainer's."""
    cfg = tiny_config(**changes)
    torch.manual_seed(0)
    model = build_model_from_config(cfg)
    tensors = model_tensors(model)
    preset = Preset(name="tiny", model=cfg)
    if dataset is not None:
        preset.data.dataset = dataset
    metadata: dict[str, Any] = {
        "preset": preset_to_dict(preset),
        "classes": CLASSES,
        "normalization": {"mean": [0.5], "std": [0.25]},
        "input_size": cfg.input_size,
        "in_channels": 1,
        "epoch": 3,
        "metrics": {"val_acc": 0.5},
    }
    if training_state:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(2, 1, cfg.input_size, cfg.input_size)).sum().backward()
        opt.step()
        tensors = model_tensors(model)
        extra, meta = pack_training_state(opt.state_dict(), None, None, capture_rng_state())
        tensors.update(extra)
        metadata.update(meta)
    save_checkpoint(path, tensors, metadata)
    return path


def eager(ckpt: Path, images: torch.Tensor) -> torch.Tensor:
    model, _ = load_checkpoint(ckpt)
    with torch.no_grad():
        return model(images)


def images(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randn(n, 1, SIZE, SIZE, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def onnx_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ExportResult, str, list]:
    if not HAS_ONNX:
        pytest.skip(
            "onnx, onnxscript or onnxruntime is not installed (pip install 'capsctl[export]')"
        )
    folder = tmp_path_factory.mktemp("onnx")
    ckpt = write_tiny_checkpoint(folder / "tiny.safetensors")
    events: list[dict[str, Any]] = []
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = export_checkpoint(ckpt, "onnx", folder / "tiny.onnx", on_event=events.append)
    return ckpt, result, printed.getvalue(), events


# --------------------------------------------------------------------------------------------
# ONNX
# --------------------------------------------------------------------------------------------


def test_onnx_parity_at_two_batch_sizes(onnx_export) -> None:
    ckpt, result, printed, events = onnx_export
    assert result.path == ckpt.with_name("tiny.onnx")
    assert default_output_path(ckpt, "onnx") == Path("tiny.onnx")  # the current folder
    assert ONNX.holds(result.path) and EXPORT_SIDECAR.holds(result.sidecar)  # --overwrite's
    assert result.format == "onnx"
    assert result.max_abs_diff is not None and result.max_abs_diff <= 1e-4
    assert result.checked_on == "4 synthetic images"
    assert result.batch_sizes == [4, 5]  # neither is the export example's batch (2)
    assert result.size_bytes == result.path.stat().st_size > 0
    assert printed == ""
    assert [e["event"] for e in events][0] == "export_load"
    assert events[-1]["event"] == "export_done"


def test_onnx_runs_any_batch_size_in_onnxruntime(onnx_export) -> None:
    import onnxruntime as ort

    ckpt, result, _, _ = onnx_export
    session = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["images"]
    for n in (1, 3, 7):
        x = images(n, seed=n)
        out = session.run(None, {"images": x.numpy()})[0]
        assert out.shape == (n, len(CLASSES))
        assert (torch.from_numpy(out) - eager(ckpt, x)).abs().max().item() <= 1e-4


def test_onnx_file_is_self_contained(onnx_export) -> None:
    import onnx
    from onnx.external_data_helper import uses_external_data

    ckpt, result, _, _ = onnx_export
    proto = onnx.load(str(result.path), load_external_data=False)
    assert proto.graph.initializer
    assert not any(uses_external_data(t) for t in proto.graph.initializer)
    names = sorted(p.name for p in ckpt.parent.iterdir())
    assert names == ["tiny.onnx", "tiny.onnx.json", "tiny.safetensors"]  # no data, no temp files


def test_onnx_sidecar(onnx_export) -> None:
    ckpt, result, _, _ = onnx_export
    assert result.sidecar == result.path.with_name("tiny.onnx.json")
    info = json.loads(result.sidecar.read_text(encoding="utf-8"))
    assert info["format"] == "onnx"
    assert info["file"] == "tiny.onnx"
    assert info["source_checkpoint"] == "tiny.safetensors"
    assert info["capsctl_version"] == __version__
    assert info["input_size"] == SIZE and info["in_channels"] == 1
    assert info["input"]["shape"] == ["batch", 1, SIZE, SIZE]
    assert info["normalization"] == {"mean": [0.5], "std": [0.25]}
    assert info["classes"] == CLASSES
    assert info["parity"]["max_abs_diff"] == result.max_abs_diff
    assert info["parity"]["batch_sizes"] == [4, 5]
    assert info["parity"]["checked_on"] == "4 synthetic images"


# --------------------------------------------------------------------------------------------
# pt2 and release safetensors
# --------------------------------------------------------------------------------------------


def test_pt2_round_trip(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint(tmp_path / "tiny.safetensors", iterations=3, routing="sequential")
    out = tmp_path / "release" / "model.pt2"
    out.parent.mkdir()
    check = images(6)
    result = export_checkpoint(
        ckpt, "pt2", out, check_images=check, check_description="6 test images"
    )
    assert result.path == out and out.is_file()
    assert result.checked_on == "6 test images"
    assert result.batch_sizes == [6, 7]
    assert result.max_abs_diff is not None and result.max_abs_diff <= 1e-4
    program = torch.export.load(str(out)).module()
    for n in (1, 3):
        x = images(n, seed=10 + n)
        with torch.no_grad():
            assert (program(x) - eager(ckpt, x)).abs().max().item() <= 1e-4
    info = json.loads((tmp_path / "release" / "model.pt2.json").read_text())
    assert info["format"] == "pt2"
    assert info["routing"] == {"iterations": 3, "mode": "sequential"}
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.pt2", "model.pt2.json"]


def test_out_folder_gets_the_default_name(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint(tmp_path / "run.safetensors")
    (tmp_path / "dist").mkdir()
    result = export_checkpoint(ckpt, "safetensors", tmp_path / "dist")
    assert result.path == tmp_path / "dist" / "run.release.safetensors"


def test_safetensors_release_strips_training_state(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint(tmp_path / "tiny.safetensors")
    header, _ = read_header(ckpt)
    assert any(k.startswith("optim.") for k in header)
    assert "training_state" in read_metadata(ckpt)

    result = export_checkpoint(ckpt, "safetensors")  # the default: in the current folder
    assert result.path == Path("tiny.release.safetensors")
    assert not (tmp_path / "tiny.release.safetensors").exists()
    assert result.max_abs_diff == 0.0
    header, _ = read_header(result.path)
    assert header and all(k.startswith("model.") for k in header)
    metadata = read_metadata(result.path)
    assert "training_state" not in metadata
    assert metadata["classes"] == CLASSES and metadata["epoch"] == 3
    assert metadata["preset"] == read_metadata(ckpt)["preset"]
    x = images(5)
    assert torch.equal(eager(result.path, x), eager(ckpt, x))
    assert result.size_bytes < ckpt.stat().st_size
    info = json.loads(result.sidecar.read_text())
    assert info["format"] == "safetensors" and info["parity"]["max_abs_diff"] == 0.0


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("plain")
    return write_tiny_checkpoint(folder / "plain.safetensors", training_state=False)


def test_missing_out_folder(plain_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "no" / "such" / "model.pt2"
    with pytest.raises(CapsctlError, match="does not exist") as info:
        export_checkpoint(plain_ckpt, "pt2", out)
    assert str(out) in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "no").exists()


def test_out_folder_is_a_file(plain_ckpt: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "model.safetensors"
    with pytest.raises(CapsctlError, match="not a folder") as info:
        export_checkpoint(plain_ckpt, "safetensors", out)
    assert str(out) in str(info.value)


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root can write to read-only folders"
)
def test_read_only_out_folder(plain_ckpt: Path, tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(CapsctlError, match="not writable") as info:
            export_checkpoint(plain_ckpt, "safetensors", folder / "model.safetensors")
        assert str(folder / "model.safetensors") in str(info.value)
    finally:
        folder.chmod(0o700)


def test_unwritable_out_folder(
    plain_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder that refuses new files (simulated: root ignores permission bits)."""
    folder = tmp_path / "locked"
    folder.mkdir()
    real_open = os.open

    def refuse(path: Any, flags: int, *args: Any) -> int:
        if Path(path).parent == folder and flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(CapsctlError, match="not writable") as info:
        export_checkpoint(plain_ckpt, "pt2", folder / "model.pt2")
    assert str(folder / "model.pt2") in str(info.value)
    assert list(folder.iterdir()) == []


def test_missing_export_extra_is_reported_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec

    def fake(name: str, *args: Any, **kwargs: Any) -> Any:
        return None if name == "onnxruntime" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    # The checkpoint does not even exist: the missing package is reported before any work.
    with pytest.raises(CapsctlError) as info:
        export_checkpoint(tmp_path / "missing.safetensors", "onnx")
    assert type(info.value) is CapsctlError
    assert str(info.value) == (
        "ONNX export needs onnx, onnxscript and onnxruntime: pip install 'capsctl[export]'"
    )


def test_unknown_format(plain_ckpt: Path) -> None:
    with pytest.raises(UsageError, match="unknown export format 'tflite'"):
        export_checkpoint(plain_ckpt, "tflite")


def test_bad_check_images(plain_ckpt: Path) -> None:
    with pytest.raises(UsageError, match=r"\[N>=1, 1, 12, 12\]"):
        export_checkpoint(plain_ckpt, "safetensors", check_images=torch.zeros(2, 3, SIZE, SIZE))


def test_refuses_to_overwrite_the_checkpoint(plain_ckpt: Path) -> None:
    with pytest.raises(UsageError, match="overwrite the checkpoint"):
        export_checkpoint(plain_ckpt, "safetensors", plain_ckpt)


def test_parity_failure_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import capsctl.layers.passes.routed as routing

    ckpt = write_tiny_checkpoint(tmp_path / "tiny.safetensors", training_state=False)
    real = routing.routed_pass_dense

    def wrong(x: torch.Tensor, w: torch.Tensor, p: torch.Tensor, scale: float):
        s, r = real(x, w, p, scale)
        return s.flip(1), r  # swaps the parents (LayerNorm would undo a rescaling)

    monkeypatch.setattr(routing, "routed_pass_dense", wrong)
    with pytest.raises(CapsctlError, match=r"pt2 export does not match PyTorch: max \|diff\| = "):
        export_checkpoint(ckpt, "pt2", tolerance=1e-4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.safetensors"]


# --------------------------------------------------------------------------------------------
# Check images: chosen by export_checkpoint itself
# --------------------------------------------------------------------------------------------

QUICKSTART = "fashion-mnist-quickstart"  # shipped with capsctl: test images are always there


def test_checks_on_the_test_images_of_the_checkpoint(tmp_path: Path) -> None:
    from capsctl.data.samples import sample_images

    ckpt = write_tiny_checkpoint(
        tmp_path / "q.safetensors", training_state=False, dataset=QUICKSTART, input_size=28
    )
    events: list[dict[str, Any]] = []
    result = export_checkpoint(ckpt, "safetensors", check_images=3, on_event=events.append)
    expected = sample_images(read_metadata(ckpt), split="test", indices=[0, 1, 2])
    assert result.checked_on == expected.description
    assert result.checked_on.startswith("3 test images of ")
    assert result.batch_sizes == [3, 4] and result.notes == []
    assert result.max_abs_diff == 0.0 and result.tolerance == 0.0
    assert "warning" not in [e["event"] for e in events]
    assert json.loads(result.sidecar.read_text())["parity"]["checked_on"] == result.checked_on


def test_falls_back_to_random_images_without_test_images(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint(tmp_path / "m.safetensors", training_state=False, dataset="mnist")
    empty = tmp_path / "no-data"
    empty.mkdir()
    events: list[dict[str, Any]] = []
    result = export_checkpoint(
        ckpt, "safetensors", check_images=5, data_dir=str(empty), on_event=events.append
    )
    assert result.checked_on == "4 synthetic images" and result.batch_sizes == [4, 5]
    (note,) = result.notes
    assert note.startswith("checking on random images: the test images are not available (")
    assert "\n" not in note
    warnings = [e for e in events if e["event"] == "warning"]
    assert [w["message"] for w in warnings] == [note]
    assert result.to_dict()["notes"] == [note]


def test_falls_back_when_the_test_images_do_not_fit_the_model(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint(
        tmp_path / "q.safetensors", training_state=False, dataset=QUICKSTART
    )
    result = export_checkpoint(ckpt, "safetensors", check_images=2)
    assert result.checked_on == "4 synthetic images"
    (note,) = result.notes
    assert "1 x 28 x 28 images and the model takes 1 x 12 x 12" in note


def test_no_check_images_means_synthetic_ones(plain_ckpt: Path, tmp_path: Path) -> None:
    result = export_checkpoint(
        plain_ckpt, "safetensors", tmp_path / "r.safetensors", check_images=None
    )
    assert result.checked_on == "4 synthetic images" and result.notes == []


@pytest.mark.parametrize("count", [0, -1])
def test_check_images_must_be_positive(plain_ckpt: Path, tmp_path: Path, count: int) -> None:
    with pytest.raises(UsageError, match="check images must be at least 1"):
        export_checkpoint(plain_ckpt, "safetensors", tmp_path / "r.safetensors", check_images=count)


@pytest.mark.parametrize("fmt", ["safetensors", "hf"])
def test_the_checkpoint_header_is_read_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    import capsctl.checkpoint.format as checkpoint_format

    ckpt = write_tiny_checkpoint(tmp_path / "tiny.safetensors", dataset=QUICKSTART, input_size=28)
    reads: list[Path] = []
    real = checkpoint_format._read_raw_header

    def counted(path: Path) -> tuple[bytes, int]:
        reads.append(Path(path))
        return real(path)

    monkeypatch.setattr(checkpoint_format, "_read_raw_header", counted)
    result = export_checkpoint(ckpt, fmt, tmp_path / "out", check_images=2)
    assert result.checked_on.startswith("2 test images of ")
    assert reads.count(ckpt) == 1


# --------------------------------------------------------------------------------------------
# Existing outputs and the input itself (issue 26, finding 2)
# --------------------------------------------------------------------------------------------


def test_an_existing_output_is_refused_unless_overwrite(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint(tmp_path / "run.safetensors", training_state=False)
    resumable = write_tiny_checkpoint(tmp_path / "kept.safetensors")  # a resumable checkpoint
    before = resumable.read_bytes()
    with pytest.raises(UsageError) as info:
        export_checkpoint(ckpt, "safetensors", resumable)
    message = str(info.value)
    assert str(resumable) in message and "--overwrite" in message and "\n" not in message
    with pytest.raises(UsageError, match="is not a weights-only capsctl checkpoint"):
        export_checkpoint(ckpt, "safetensors", resumable, overwrite=True)  # not an export: kept
    assert resumable.read_bytes() == before
    assert not (tmp_path / "kept.safetensors.json").exists()
    release = export_checkpoint(ckpt, "safetensors", tmp_path / "r.safetensors").path
    with pytest.raises(UsageError, match="--overwrite"):
        export_checkpoint(ckpt, "safetensors", release)
    result = export_checkpoint(ckpt, "safetensors", release, overwrite=True)  # an earlier export
    assert result.path == release


def test_an_existing_sidecar_or_default_output_is_refused(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint(tmp_path / "run.safetensors", training_state=False)
    export_checkpoint(ckpt, "safetensors")  # the default path beside the checkpoint
    with pytest.raises(UsageError, match="run.release.safetensors already exists"):
        export_checkpoint(ckpt, "safetensors")
    sidecar = tmp_path / "new.safetensors.json"
    sidecar.write_text("mine")
    with pytest.raises(UsageError) as info:
        export_checkpoint(ckpt, "safetensors", tmp_path / "new.safetensors")
    assert str(sidecar) in str(info.value) and "--overwrite" in str(info.value)
    assert sidecar.read_text() == "mine" and not (tmp_path / "new.safetensors").exists()


@pytest.mark.parametrize("how", ["same", "symlink", "hardlink"])
def test_the_input_is_never_replaced_even_with_overwrite(tmp_path: Path, how: str) -> None:
    ckpt = write_tiny_checkpoint(tmp_path / "run.safetensors", training_state=False)
    before = ckpt.read_bytes()
    out = ckpt
    if how == "symlink":
        out = tmp_path / "link.safetensors"
        out.symlink_to(ckpt)
    elif how == "hardlink":
        out = tmp_path / "hard.safetensors"
        os.link(ckpt, out)
    with pytest.raises(UsageError) as info:
        export_checkpoint(ckpt, "safetensors", out, overwrite=True)
    assert str(ckpt) in str(info.value) and "pick another output path" in str(info.value)
    assert ckpt.read_bytes() == before


def test_the_sidecar_never_replaces_the_input(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint(tmp_path / "m.onnx.json", training_state=False)
    before = ckpt.read_bytes()
    with pytest.raises(UsageError) as info:
        export_checkpoint(ckpt, "safetensors", tmp_path / "m.onnx", overwrite=True)
    assert str(ckpt) in str(info.value) and "pick another output path" in str(info.value)
    assert ckpt.read_bytes() == before and not (tmp_path / "m.onnx").exists()
