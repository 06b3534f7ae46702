"""The test sets capsctl robustness makes: seeded shifts, affNIST-style canvases, CIFAR-10-C
corruptions, expanded MNIST, and smallNORB's files and viewpoint splits."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

from capsctl.data.dataset import ArrayDataset
from capsctl.errors import DataError
from capsctl.robustness.shifts import _warp, affnist_set, shifted_images


def _digits(n: int = 8, size: int = 28) -> ArrayDataset:
    gen = torch.Generator().manual_seed(3)
    images = torch.zeros(n, 1, size, size, dtype=torch.uint8)
    images[:, :, 6:22, 10:18] = torch.randint(1, 256, (n, 1, 16, 8), generator=gen).to(torch.uint8)
    return ArrayDataset(images, torch.arange(n) % 10, [str(i) for i in range(10)], "digits")


def test_the_identity_warp_returns_the_images_exactly() -> None:
    images = _digits().images
    n = images.shape[0]
    same = _warp(images, torch.eye(2).expand(n, 2, 2), torch.zeros(n, 2))
    assert torch.equal(same, images)
    for kind in ("rotate", "translate"):
        assert torch.equal(shifted_images(images, kind, 0.0, seed=5), images)


def test_a_quarter_turn_moves_pixels_where_the_equation_says() -> None:
    """Rotation by 90 degrees about the centre c = (13.5, 13.5) is exact: x' = c - (y - c)...
    for the sign drawn; both signs give a 90-degree rotation of the array."""
    images = _digits(2).images
    turned = shifted_images(images, "rotate", 90.0, seed=0)
    for i in range(2):
        options = [torch.rot90(images[i], k, (1, 2)) for k in (1, 3)]
        assert any(torch.equal(turned[i], o) for o in options)


def test_shifted_sets_repeat_for_a_seed_and_differ_for_another() -> None:
    images = _digits().images
    for kind, mag in (("rotate", 30.0), ("translate", 3.0)):
        a = shifted_images(images, kind, mag, seed=1)
        assert torch.equal(a, shifted_images(images, kind, mag, seed=1))
        assert not torch.equal(a, shifted_images(images, kind, mag, seed=2))
    digits = _digits()
    a = affnist_set(digits, seed=1)
    assert torch.equal(a.images, affnist_set(digits, seed=1).images)
    assert not torch.equal(a.images, affnist_set(digits, seed=2).images)


def test_affnist_canvases_keep_the_digit_on_the_canvas() -> None:
    digits = _digits(16)
    moved = affnist_set(digits, seed=4)
    assert moved.images.shape == (16, 1, 40, 40)
    centred = affnist_set(digits, seed=4, magnitude=0.0).images
    assert torch.equal(centred[:, :, 6:34, 6:34], digits.images)  # padded 28 -> 40, centred
    ink = moved.images.float().sum((1, 2, 3)) / digits.images.float().sum((1, 2, 3))
    assert float(ink.min()) > 0.55  # scaled by at most 0.8 x 0.8, never cut off
    assert not torch.equal(moved.images, centred)


def test_expanded_mnist_places_whole_digits_on_40x40_with_a_seed() -> None:
    from capsctl.data.expanded_mnist import expanded_mnist

    digits = _digits(32)
    digits.images = torch.randint(1, 256, (32, 1, 28, 28), dtype=torch.uint8)  # ink up to edges
    a = expanded_mnist(digits, seed=7)
    assert a.images.shape == (32, 1, 40, 40) and torch.equal(a.labels, digits.labels)
    assert torch.equal(a.images.sum((1, 2, 3)), digits.images.sum((1, 2, 3)))  # whole digit
    assert torch.equal(a.images, expanded_mnist(digits, seed=7).images)
    assert not torch.equal(a.images, expanded_mnist(digits, seed=8).images)
    assert len({tuple(torch.nonzero(im[0])[0].tolist()) for im in a.images}) > 8  # offsets vary


def test_expanded_mnist_presets_build_40x40_models_of_equal_widths() -> None:
    from capsctl.config import load_preset
    from capsctl.models import build_model_from_config

    caps, cnn = load_preset("expanded-mnist-caps"), load_preset("expanded-mnist-cnn")
    assert caps.data.dataset == cnn.data.dataset == "expanded-mnist"
    assert (caps.model.arch, cnn.model.arch) == ("capsnet", "cnn")
    assert caps.model.input_size == cnn.model.input_size == 40
    assert caps.model.layers == cnn.model.layers
    out = build_model_from_config(caps.model).eval()(torch.zeros(2, 1, 40, 40))
    assert out.shape == (2, 10)


def _cifar_like(n: int = 3) -> np.ndarray:
    """Smooth colour images with edges (uint8 [n, 3, 32, 32])."""
    yy, xx = np.mgrid[0:32, 0:32] / 31.0
    out = []
    for i in range(n):
        r = 0.5 + 0.4 * np.sin(6 * xx + i)
        g = 0.5 + 0.4 * np.cos(5 * yy - i)
        b = np.where(xx + yy > 1.0, 0.8, 0.2)
        out.append(np.stack([r, g, b]) * 255)
    return np.uint8(np.array(out))


@pytest.mark.parametrize(
    "name",
    ["gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur",
     "motion_blur", "zoom_blur", "snow", "fog", "brightness", "contrast", "pixelate",
     "jpeg_compression"],
)  # fmt: skip
def test_severity_5_changes_an_image_more_than_severity_1(name: str) -> None:
    from capsctl.robustness.corruptions import corrupt_images

    clean = _cifar_like()
    mild = corrupt_images(clean, name, 1, seed=0).astype(np.float64)
    harsh = corrupt_images(clean, name, 5, seed=0).astype(np.float64)
    assert mild.shape == harsh.shape == clean.shape
    assert np.abs(mild - clean).mean() < np.abs(harsh - clean).mean()


def test_corruptions_repeat_for_a_seed_and_cover_all_fifteen() -> None:
    from capsctl.robustness.corruptions import CORRUPTIONS, SEVERITIES, corrupt_images

    assert len(CORRUPTIONS) == 15 and all(len(SEVERITIES[c]) == 5 for c in CORRUPTIONS)
    assert SEVERITIES["gaussian_noise"] == [0.04, 0.06, 0.08, 0.09, 0.10]  # make_cifar_c.py
    clean = _cifar_like(2)
    for name in CORRUPTIONS:
        a = corrupt_images(clean, name, 3, seed=1)
        assert np.array_equal(a, corrupt_images(clean, name, 3, seed=1)), name
    gray = corrupt_images(clean[:, :1], "contrast", 5, seed=0)
    assert gray.shape == (2, 1, 32, 32)


# ------------------------------------------------------------------------------------------
# smallNORB, on small files written here in its binary matrix format


def _write_matrix(path: Path, array: np.ndarray, magic: int) -> None:
    dims = list(array.shape) + [1] * max(0, 3 - array.ndim)
    header = np.array([magic, array.ndim, *dims], dtype="<i4").tobytes()
    data = header + np.ascontiguousarray(array).tobytes()
    if path.suffix == ".gz":
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


def _write_norb(folder: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    from capsctl.data.smallnorb import FILES

    azimuths, elevations = np.arange(0, 36, 2), np.arange(9)
    info = np.array([[i % 10, e, a, i % 6] for i, (e, a) in enumerate(
        (e, a) for e in elevations for a in azimuths)], dtype="<i4")  # fmt: skip
    n = info.shape[0]  # 162: every (elevation, azimuth) once
    gen = np.random.default_rng(0)
    dat = gen.integers(0, 256, (n, 2, 96, 96), dtype=np.uint8)
    cat = (np.arange(n) % 5).astype("<i4")
    stem = folder / FILES[split]
    _write_matrix(Path(f"{stem}-dat.mat.gz"), dat, 0x1E3D4C55)
    _write_matrix(Path(f"{stem}-cat.mat"), cat, 0x1E3D4C54)
    _write_matrix(Path(f"{stem}-info.mat"), info, 0x1E3D4C54)
    return dat, info


def test_smallnorb_reader_reads_the_binary_matrix_format(tmp_path: Path) -> None:
    from capsctl.data.smallnorb import load_smallnorb, read_norb_matrix

    dat, info = _write_norb(tmp_path, "train")
    got = read_norb_matrix(next(tmp_path.glob("*-info.mat")))
    assert got.shape == (162, 4) and np.array_equal(got, info)
    ds = load_smallnorb(tmp_path, "train")
    assert ds.images.shape == (162, 2, 48, 48) and ds.classes[0] == "animal"
    block = dat[5, 1, 10:12, 20:22].astype(np.float64).mean()
    assert int(ds.images[5, 1, 5, 10]) == int(np.floor(block + 0.5))  # 2x2 mean, 96 -> 48
    bad = tmp_path / "bad.mat"
    bad.write_bytes(np.array([0x12345678, 1, 3, 1, 1], dtype="<i4").tobytes())
    with pytest.raises(DataError, match="not a smallNORB matrix"):
        read_norb_matrix(bad)


def test_smallnorb_viewpoint_splits(tmp_path: Path) -> None:
    from capsctl.data import load_dataset

    _, info = _write_norb(tmp_path, "train")
    _write_norb(tmp_path, "test")
    az_train = load_dataset("smallnorb-azimuth", "train", tmp_path, download=False)
    az_test = load_dataset("smallnorb-azimuth", "test", tmp_path, download=False)
    assert len(az_train) == 9 * 6 and len(az_test) == 9 * 12  # azimuths 300..40 vs 60..280
    el_train = load_dataset("smallnorb-elevation", "train", tmp_path, download=False)
    el_test = load_dataset("smallnorb-elevation", "test", tmp_path, download=False)
    assert len(el_train) == 3 * 18 and len(el_test) == 6 * 18  # elevations 30-40 vs 45-70
    from capsctl.data.smallnorb import viewpoint_mask

    kept = info[viewpoint_mask(info, "azimuth", train=True), 2]
    assert sorted(set(kept.tolist())) == [0, 2, 4, 30, 32, 34]  # x 10 degrees
    with pytest.raises(DataError, match="not found"):
        load_dataset("smallnorb", "train", tmp_path / "nowhere", download=False)
