"""``capsctl predict``: image files of any size and mode, folders, globs, bad files, every arch."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import run_cli

from capsctl.checkpoint import load_checkpoint, model_tensors, save_checkpoint
from capsctl.config import DataConfig, Preset, TrainConfig, preset_to_dict, resolve_config
from capsctl.data import ArrayDataset, load_dataset
from capsctl.data.images import expand_image_paths, load_image, read_image_file
from capsctl.errors import DataError, UsageError
from capsctl.evaluation import evaluate
from capsctl.models import build_model_from_config
from capsctl.predict import predict_images

Image = pytest.importorskip("PIL.Image")

# Fashion-MNIST normalization, typed here (Xiao et al. 2017 training-set statistics as used by
# the quickstart preset).
FASHION_MEAN, FASHION_STD = 0.2860, 0.3530
N_IMAGES = 12


@pytest.fixture(scope="module")
def trained(tiny_trained_run: Path) -> Path:
    """A tiny capsule net trained for 20 steps on the embedded Fashion-MNIST subset (the
    session's tiny run, tests/conftest.py)."""
    return tiny_trained_run / "best.safetensors"


@pytest.fixture(scope="module")
def dataset_images() -> ArrayDataset:
    ds = load_dataset("fashion-mnist-quickstart", "test", None, download=False)
    return ArrayDataset(
        ds.images[:N_IMAGES].clone(), ds.labels[:N_IMAGES].clone(), ds.classes, ds.name
    )


def gray(ds: ArrayDataset, i: int) -> np.ndarray:
    return ds.images[i, 0].numpy()  # uint8 [28, 28]


def write_exact(path: Path, img: np.ndarray, kind: str) -> Path:
    """Write the 28x28 gray ``img`` so that decoding gives back exactly ``img`` (gray)."""
    h, w = img.shape
    if kind == "L":
        Image.fromarray(img).save(path)
    elif kind == "LA":
        Image.fromarray(np.stack([img, np.full_like(img, 255)], -1), "LA").save(path)
    elif kind == "RGB":
        Image.fromarray(np.stack([img] * 3, -1)).save(path)
    elif kind == "RGBA":
        Image.fromarray(np.stack([img] * 3 + [np.full_like(img, 255)], -1)).save(path)
    elif kind == "P":  # palette index i is the gray level 255 - i
        p = Image.frombytes("P", (w, h), (255 - img).tobytes())
        p.putpalette([v for i in range(256) for v in (255 - i,) * 3])
        p.save(path)
    elif kind == "I16":
        Image.fromarray(img.astype(np.uint16) * 257).save(path)  # 65535 = 255 * 257
    elif kind == "tall":  # 28 wide, 40 high: the centered 28x28 is the image
        canvas = np.zeros((h + 12, w), np.uint8)
        canvas[6 : 6 + h] = img
        Image.fromarray(canvas).save(path)
    elif kind == "wide":  # 44 wide, 28 high
        canvas = np.full((h, w + 16), 77, np.uint8)
        canvas[:, 8 : 8 + w] = img
        Image.fromarray(canvas).save(path)
    elif kind in ("bmp", "tiff", "webp", "gif"):
        Image.fromarray(img).save(path, **({"lossless": True} if kind == "webp" else {}))
    else:
        raise AssertionError(kind)
    return path


EXACT_KINDS = ["L", "LA", "RGB", "RGBA", "P", "I16", "tall", "wide", "bmp", "tiff", "webp", "gif"]


def suffix(kind: str) -> str:
    return {"bmp": ".bmp", "tiff": ".tif", "webp": ".webp", "gif": ".gif"}.get(kind, ".png")


# --------------------------------------------------------------------------------------------
# Decoding: exact round trips, conversions and resizing by hand


@pytest.mark.parametrize("kind", EXACT_KINDS)
def test_lossless_files_decode_to_the_same_pixels(
    kind: str, dataset_images: ArrayDataset, tmp_path: Path
) -> None:
    img = gray(dataset_images, 0)
    f = write_exact(tmp_path / f"a{suffix(kind)}", img, kind)
    loaded = load_image(f, 1, 28)
    assert loaded.pixels.dtype == torch.uint8 and loaded.pixels.shape == (1, 28, 28)
    assert torch.equal(loaded.pixels[0], torch.from_numpy(img)), loaded.description
    rgb = read_image_file(f, 3, 28)  # gray -> RGB repeats the channel
    assert rgb.shape == (3, 28, 28) and all(torch.equal(rgb[c], rgb[0]) for c in range(3))


def test_sixteen_bit_png_is_scaled_not_clipped(tmp_path: Path) -> None:
    values = np.array([0, 257, 1000, 32768, 65535, 65280], dtype=np.uint16)
    f = tmp_path / "deep.png"
    Image.fromarray(np.tile(values, (6, 1))).save(f)  # 6x6, every row the same
    assert f.read_bytes()[24] == 16  # IHDR bit depth: really a 16-bit PNG
    loaded = load_image(f, 1, 6)
    # v / 257 rounded: 0, 1, 3.89 -> 4, 127.5 -> 128, 255, 254
    assert loaded.pixels[0, 0].tolist() == [0, 1, 4, 128, 255, 254]
    assert loaded.description.startswith("PNG 16-bit gray 6x6 -> 8-bit gray")


def test_rgb_to_gray_is_bt601_luma_and_alpha_goes_on_black(tmp_path: Path) -> None:
    rgba = np.zeros((2, 2, 4), np.uint8)
    rgba[0, 0] = (200, 100, 50, 255)
    rgba[0, 1] = (10, 250, 90, 255)
    rgba[1, 0] = (200, 200, 200, 128)  # half transparent
    rgba[1, 1] = (255, 255, 255, 0)  # transparent
    f = tmp_path / "c.png"
    Image.fromarray(rgba, "RGBA").save(f)
    loaded = load_image(f, 1, 2)
    # ITU-R BT.601: Y = 0.299 R + 0.587 G + 0.114 B; alpha: value * a / 255.
    luma_a = round(0.299 * 200 + 0.587 * 100 + 0.114 * 50)
    luma_b = round(0.299 * 10 + 0.587 * 250 + 0.114 * 90)
    expected = [[luma_a, luma_b], [round(200 * 128 / 255), 0]]
    assert loaded.pixels[0].tolist() == expected
    assert loaded.description == "PNG RGBA 2x2 -> gray (alpha on black)"
    rgb = load_image(f, 3, 2).pixels
    assert rgb[:, 0, 0].tolist() == [200, 100, 50] and rgb[:, 1, 1].tolist() == [0, 0, 0]


def test_resize_shorter_side_then_center_crop(tmp_path: Path) -> None:
    # Three vertical stripes of 64 columns, 64 rows: black | 200 | black. Shorter side 64 -> 32
    # makes the stripes 32 columns wide; the center crop is the middle stripe.
    img = np.zeros((64, 192), np.uint8)
    img[:, 64:128] = 200
    f = tmp_path / "wide.png"
    Image.fromarray(img).save(f)
    loaded = load_image(f, 1, 32)
    assert loaded.description == "PNG gray 192x64 -> resized to 32x32 (shorter side, center crop)"
    px = loaded.pixels[0]
    assert px.shape == (32, 32)
    assert (px[:, 1:-1] == 200).all()  # the interior of the middle stripe is untouched
    assert (px[:, 0] >= 100).all() and (px[:, -1] >= 100).all()  # edges blend at most half
    # The same picture standing up gives the transposed result.
    g = tmp_path / "tall.png"
    Image.fromarray(np.ascontiguousarray(img.T)).save(g)
    assert torch.equal(load_image(g, 1, 32).pixels[0], px.T)
    # Already the right shorter side: only cropped, exactly.
    h = tmp_path / "crop.png"
    Image.fromarray(img[:32, 32:160]).save(h)  # 128x32: columns 32..95 of it are 200
    cropped = load_image(h, 1, 32)
    assert cropped.description.endswith("center-cropped to 32x32")
    assert (cropped.pixels == 200).all()


def test_shrinking_is_antialiased(tmp_path: Path) -> None:
    # Every 4th column white: a 4x shrink must average (about 255 / 4), not sample (0 or 255).
    img = np.zeros((128, 128), np.uint8)
    img[:, ::4] = 255
    f = tmp_path / "lines.png"
    Image.fromarray(img).save(f)
    px = load_image(f, 1, 32).pixels.float()
    assert abs(px[:, 2:-2, 2:-2].mean().item() - 255 / 4) < 2
    assert px[:, 2:-2, 2:-2].max().item() - px[:, 2:-2, 2:-2].min().item() < 8


def test_constant_images_stay_constant_in_any_size(tmp_path: Path) -> None:
    for w, h in [(50, 70), (7, 5), (300, 40)]:
        f = tmp_path / f"c{w}x{h}.jpg"
        Image.new("RGB", (w, h), (90, 160, 30)).save(f, quality=100)
        px = load_image(f, 3, 16).pixels
        assert px.shape == (3, 16, 16)
        for c, v in enumerate((90, 160, 30)):
            assert (px[c].int() - v).abs().max() <= 2  # JPEG rounding only


def test_unreadable_files_are_one_line_errors(tmp_path: Path) -> None:
    good = tmp_path / "good.png"
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(good)
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(good.read_bytes()[:40])
    text = tmp_path / "text.jpg"
    text.write_text("hello")
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    for f in (truncated, text, empty):
        with pytest.raises(DataError) as info:
            load_image(f, 1, 8)
        msg = str(info.value)
        assert str(f) in msg and "\n" not in msg
    with pytest.raises(UsageError, match="no such image file"):
        load_image(tmp_path / "missing.png", 1, 8)


def test_expand_folders_and_globs(tmp_path: Path) -> None:
    (tmp_path / "d" / "sub").mkdir(parents=True)
    for name in ("b.png", "a.JPG", "c.webp", "notes.txt", ".hidden.png", "sub/z.png"):
        (tmp_path / "d" / name).write_bytes(b"x")
    files, unmatched = expand_image_paths([tmp_path / "d"])
    assert [f.name for f in files] == ["a.JPG", "b.png", "c.webp"] and unmatched == []
    files, _ = expand_image_paths([str(tmp_path / "d" / "**" / "*.png")])
    assert [f.name for f in files] == ["b.png", "z.png"]
    # A file named twice (directly and through its folder) is kept once, at its first place.
    files, _ = expand_image_paths([tmp_path / "d" / "c.webp", tmp_path / "d"])
    assert [f.name for f in files] == ["c.webp", "a.JPG", "b.png"]
    files, unmatched = expand_image_paths(
        [tmp_path / "nope.png", str(tmp_path / "*.gif"), tmp_path / "d" / "sub" / ".."]
    )
    assert [reason for _, reason in unmatched] == [
        "no such file or folder",
        "pattern matches no image files (.png, .jpg, .jpeg, ...)",
    ]


# --------------------------------------------------------------------------------------------
# Predictions against capsctl eval


def eval_predictions(ckpt: Path, images: torch.Tensor, labels: list[int]) -> float:
    """Accuracy that capsctl eval's ``evaluate`` gives ``images`` labelled with ``labels``.

    1.0 exactly when, for every image, the class eval predicts is the given label.
    """
    model, meta = load_checkpoint(ckpt)
    ds = ArrayDataset(images, torch.tensor(labels), list(meta["classes"]), "files")
    res = evaluate(
        model,
        ds,
        batch_size=5,
        device=torch.device("cpu"),
        mean=meta["normalization"]["mean"],
        std=meta["normalization"]["std"],
        classes=list(meta["classes"]),
    )
    assert res.count == len(labels)
    return res.accuracy


def softmax(z: torch.Tensor) -> torch.Tensor:
    e = torch.exp(z - z.max(1, keepdim=True).values)
    return e / e.sum(1, keepdim=True)


def test_lossless_files_of_every_mode_predict_what_eval_predicts(
    trained: Path, dataset_images: ArrayDataset, tmp_path: Path
) -> None:
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(N_IMAGES):
        kind = EXACT_KINDS[i % len(EXACT_KINDS)]
        write_exact(folder / f"{i:02d}_{kind}{suffix(kind)}", gray(dataset_images, i), kind)
    res = predict_images(trained, [folder], top_k=10, device="cpu", batch_size=5)
    assert [Path(p.path).name[:2] for p in res.predictions] == [f"{i:02d}" for i in range(12)]
    top1 = [p.indices[0] for p in res.predictions]
    assert len(set(top1)) >= 2, "the tiny model predicts one class only: the test proves little"
    assert eval_predictions(trained, dataset_images.images, top1) == 1.0
    # The scores are the softmax of the model's outputs on the normalized dataset images.
    model, _ = load_checkpoint(trained)
    x = (dataset_images.images.float() / 255 - FASHION_MEAN) / FASHION_STD
    with torch.no_grad():
        probs = softmax(model(x))
    for i, p in enumerate(res.predictions):
        assert p.scores == sorted(p.scores, reverse=True)
        assert torch.allclose(torch.tensor(p.scores), probs[i, p.indices], atol=1e-5)
    assert res.score == "softmax" and res.arch == "capsnet" and not res.multi_label


def test_jpeg_and_resized_files_predict_what_eval_predicts_on_them(
    trained: Path, dataset_images: ArrayDataset, tmp_path: Path
) -> None:
    files = []
    for i in range(6):
        img = gray(dataset_images, i)
        big = np.kron(img, np.ones((i % 3 + 2, i % 3 + 2), np.uint8))  # 56, 84 or 112 wide
        f = tmp_path / f"{i}.jpg"
        if i % 2:
            Image.fromarray(np.stack([big] * 3, -1)).save(f, quality=95)  # RGB JPEG, upscaled
        else:
            Image.fromarray(img).save(f, quality=95)  # gray JPEG, same size
        files.append(f)
    res = predict_images(trained, files, top_k=3, device="cpu")
    decoded = torch.stack([read_image_file(f, 1, 28) for f in files])
    # What the files hold is close to the dataset images ...
    diff = (decoded.float() - dataset_images.images[:6].float()).abs().mean((1, 2, 3))
    assert (diff < 12).all(), diff
    # ... and predict's classes are eval's classes on exactly those pixels.
    assert eval_predictions(trained, decoded, [p.indices[0] for p in res.predictions]) == 1.0
    assert "JPEG RGB 84x84 -> gray, resized to 28x28" in res.predictions[1].input
    assert res.predictions[0].input == "JPEG gray 28x28, used as is"


# --------------------------------------------------------------------------------------------
# The command line


@pytest.fixture()
def folder(dataset_images: ArrayDataset, tmp_path: Path) -> Path:
    d = tmp_path / "pics"
    d.mkdir()
    for i in range(3):
        write_exact(d / f"{i}.png", gray(dataset_images, i), "RGB")
    return d


def test_json_is_one_document(
    trained: Path, folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, ["predict", str(trained), str(folder), "--json", "-k", "3"])
    assert code == 0, err
    doc = json.loads(out)
    assert doc["score"] == "softmax" and doc["top_k"] == 3 and doc["skipped"] == []
    assert [Path(i["path"]).name for i in doc["images"]] == ["0.png", "1.png", "2.png"]
    assert all(len(i["top"]) == 3 for i in doc["images"])
    assert "gray" in doc["preprocessing"] and "28x28" in doc["preprocessing"]
    assert doc["images"][0]["input"] == "PNG RGB 28x28 -> gray"


def test_table_says_the_preprocessing_and_the_score(
    trained: Path, folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(
        capsys, ["predict", str(trained), str(folder / "1.png"), "--device", "cpu"]
    )
    assert code == 0
    assert "preprocessing: gray, shorter side resized to 28 (antialiased), center crop 28x28" in out
    assert "score: softmax probability" in out and "1.png" in out and "Top-5 classes" in out


def test_top_k_bounds(trained: Path, folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, ["predict", str(trained), str(folder), "--top-k", "0"])
    assert code == 2 and "--top-k 0" in err and out == ""
    code, out, _ = run_cli(
        capsys, ["predict", str(trained), str(folder), "--top-k", "99", "--json"]
    )
    doc = json.loads(out)
    assert code == 0 and doc["top_k"] == 10
    for image in doc["images"]:
        assert sorted(t["index"] for t in image["top"]) == list(range(10))
        assert math.isclose(sum(t["score"] for t in image["top"]), 1.0, rel_tol=1e-5)


def test_an_unreadable_file_is_named_and_skip_bad_keeps_the_rest(
    trained: Path, folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    code, out, err = run_cli(capsys, ["predict", str(trained), str(folder)])
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "broken.png" in lines[0] and "--skip-bad" in lines[0]
    code, out, err = run_cli(capsys, ["predict", str(trained), str(folder), "--skip-bad", "--json"])
    assert code == 0
    doc = json.loads(out)
    assert [Path(i["path"]).name for i in doc["images"]] == ["0.png", "1.png", "2.png"]
    assert [Path(s["path"]).name for s in doc["skipped"]] == ["broken.png"]
    code, out, err = run_cli(capsys, ["predict", str(trained), str(folder), "--skip-bad"])
    assert code == 0 and "warning" in err and "broken.png" in err and "2.png" in out


def test_folders_globs_and_nothing_matched(
    trained: Path, folder: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (folder / "readme.txt").write_text("not an image")
    shutil.copy(folder / "0.png", tmp_path / "extra.png")
    args = [str(folder / "[12].png"), str(tmp_path / "extra.png"), "--json"]
    code, out, _ = run_cli(capsys, ["predict", str(trained), *args])
    assert code == 0
    assert [Path(i["path"]).name for i in json.loads(out)["images"]] == [
        "1.png",
        "2.png",
        "extra.png",
    ]
    code, out, err = run_cli(capsys, ["predict", str(trained), str(tmp_path / "*.gif")])
    assert code == 2 and out == "" and "*.gif" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(capsys, ["predict", str(trained), str(tmp_path / "missing.png")])
    assert code == 2 and "missing.png: no such file or folder" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run_cli(capsys, ["predict", str(trained), str(empty), str(folder), "--skip-bad"])
    assert code == 0 and "folder holds no image files" in err


# --------------------------------------------------------------------------------------------
# Every kind of model: the right score for its outputs

CLASSES = ["zero", "one", "two"]


def write_checkpoint(
    path: Path, spec: dict[str, Any] | str, *, dataset: str = "mnist", loss: str = "auto"
) -> tuple[Path, torch.nn.Module]:
    cfg = resolve_config(spec)
    torch.manual_seed(0)
    model = build_model_from_config(cfg).eval()
    with torch.no_grad():  # zero-initialized weights (self-routing's gating) would tie classes
        for p in model.parameters():
            if p.dim() > 1 and not bool(p.any()):
                p.normal_(0.0, 0.5)
    mean, std = [0.5] * cfg.in_channels, [0.25] * cfg.in_channels
    classes = [f"c{i}" for i in range(cfg.num_classes)]
    preset = Preset(
        name="t",
        model=cfg,
        data=DataConfig(dataset=dataset, normalization="none"),
        train=TrainConfig(loss=loss),  # type: ignore[arg-type]
    )
    save_checkpoint(
        path,
        model_tensors(model),
        {
            "preset": preset_to_dict(preset),
            "classes": classes,
            "normalization": {"name": "test", "mean": mean, "std": std},
            "input_size": cfg.input_size,
            "in_channels": cfg.in_channels,
        },
    )
    return path, model


TINY = {
    "base": "mnist-caps",
    "input_size": 12,
    "num_classes": 3,
    "primary_types": 4,
    "primary_dim": 4,
    "layers": [{"kind": "conv", "types": 4, "pose_dim": 4, "kernel": 3, "stride": 1}],
}


def expected_scores(out: torch.Tensor, kind: str) -> torch.Tensor:
    """The score of each kind, from its definition."""
    if kind == "softmax":
        return softmax(out)
    if kind == "sigmoid":
        return 1 / (1 + torch.exp(-out))
    if kind in ("length-share", "activation-share"):
        return out / out.sum(1, keepdim=True)
    return out  # length (logit_scale 1), activation


@pytest.mark.parametrize(
    "spec,dataset,loss,kind",
    [
        ({**TINY, "routing": "concurrent"}, "mnist", "auto", "softmax"),
        ({**TINY, "routing": "sequential", "iterations": 3}, "mnist", "auto", "softmax"),
        ({**TINY, "arch": "cnn"}, "mnist", "auto", "softmax"),
        ({**TINY, "arch": "capsnet-dynamic"}, "mnist", "margin", "length-share"),
        ({**TINY, "arch": "capsnet-em"}, "mnist", "spread", "activation-share"),
        ({**TINY, "arch": "capsnet-dynamic"}, "diverse-multimnist", "margin", "length"),
        ({**TINY, "arch": "capsnet-em"}, "diverse-multimnist", "spread", "activation"),
        ({**TINY, "router": {"name": "dynamic"}}, "mnist", "auto", "length-share"),
        ({**TINY, "router": {"name": "em"}}, "mnist", "auto", "activation-share"),
        ({**TINY, "router": {"name": "self"}}, "mnist", "auto", "softmax"),
        (TINY, "diverse-multimnist", "auto", "sigmoid"),
        (TINY, "mnist", "bce", "sigmoid"),
        ("resnet18", "cifar10", "auto", "softmax"),
    ],
)
def test_every_arch_gets_the_score_of_its_outputs(
    spec: Any, dataset: str, loss: str, kind: str, tmp_path: Path
) -> None:
    ckpt, model = write_checkpoint(tmp_path / "m.safetensors", spec, dataset=dataset, loss=loss)
    cfg = model.config  # type: ignore[attr-defined]
    rng = np.random.default_rng(0)
    files = []
    for i, (w, h) in enumerate([(cfg.input_size, cfg.input_size), (40, 23)]):
        f = tmp_path / f"{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(f)
        files.append(f)
    res = predict_images(ckpt, files, top_k=100, device="cpu")
    assert res.score == kind and res.arch == cfg.arch
    assert res.multi_label == (kind in ("sigmoid", "length", "activation"))
    pixels = torch.stack([read_image_file(f, cfg.in_channels, cfg.input_size) for f in files])
    with torch.no_grad():
        out = model((pixels.float() / 255 - 0.5) / 0.25)
    want = expected_scores(out, kind)
    for i, p in enumerate(res.predictions):
        assert len(p.indices) == cfg.num_classes and p.indices[0] == int(out[i].argmax())
        assert torch.allclose(torch.tensor(p.scores), want[i, p.indices], atol=1e-5)


# --------------------------------------------------------------------------------------------
# Named pipes and decoder warnings (issue 26, finding 10)
# --------------------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes on this platform")
@pytest.mark.parametrize("which", ["image", "checkpoint"])
def test_a_named_pipe_is_refused_not_read(tiny_checkpoint, tmp_path: Path, which: str) -> None:
    ckpt = tiny_checkpoint()
    image = tmp_path / "img.png"
    Image.fromarray(np.zeros((28, 28), np.uint8)).save(image)
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    args = [str(ckpt), str(fifo)] if which == "image" else [str(fifo), str(image)]
    res = subprocess.run(
        [sys.executable, "-m", "capsctl", "predict", *args, "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,  # reading the pipe would wait here forever
    )
    err = res.stderr.strip()
    assert res.returncode in (1, 2) and len(err.splitlines()) == 1, err
    assert f"{fifo}: " in err or f"{fifo} is" in err
    assert "not a regular file" in err and "pass a" in err and "Traceback" not in err


def test_a_named_pipe_is_skipped_with_skip_bad(tiny_checkpoint, tmp_path: Path) -> None:
    if not hasattr(os, "mkfifo"):
        pytest.skip("no named pipes on this platform")
    image = tmp_path / "img.png"
    Image.fromarray(np.zeros((28, 28), np.uint8)).save(image)
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match="not a regular file"):
        load_image(fifo, 1, 28)
    res = predict_images(tiny_checkpoint(), [fifo, image], skip_bad=True, device="cpu")
    assert [p.path for p in res.predictions] == [str(image)]
    assert res.skipped[0].path == str(fifo) and "not a regular file" in res.skipped[0].reason


def test_decompression_bomb_warning_is_one_clear_line(
    tiny_checkpoint,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    image = tmp_path / "big.png"
    Image.fromarray(np.full((28, 28), 7, np.uint8)).save(image)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 500)  # 784 pixels: a warning, no error
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_image(image, 1, 28)
        code, out, err = run_cli(capsys, ["predict", str(tiny_checkpoint()), str(image)])
    assert caught == []  # nothing reaches Python's warning machinery (stderr)
    assert len(loaded.warnings) == 1 and "very large image" in loaded.warnings[0]
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [f"warning: {image}: {loaded.warnings[0]}"]
    assert "DecompressionBombWarning" not in err


def test_an_all_nan_float_image_is_black_without_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "nan.tif"
    Image.fromarray(np.full((8, 8), np.nan, np.float32), mode="F").save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "All-NaN slice encountered" would raise
        loaded = load_image(path, 1, 8)
    assert int(loaded.pixels.max()) == 0 and loaded.warnings == ()
