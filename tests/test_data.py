"""Tests for capsctl.data: sources, safe unpickling, downloads, splits and the Loader.

Real datasets come from ``$CAPSCTL_DATA`` (the ``data_root`` fixture); everything else is
built in ``tmp_path``. The network is never used: an autouse fixture makes every non-file
URL fail.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import pickle
import tarfile
import urllib.error
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import load_script

from capsctl.data import (
    DATASETS,
    NORMALIZATION,
    ArrayDataset,
    Loader,
    dataset_info,
    find_test_files,
    fingerprint,
    load_dataset,
    normalization_for,
    resolve_data_dir,
    sources,
    split_train_val,
)
from capsctl.data import download as dl
from capsctl.data.idx import read_idx
from capsctl.data.safe_pickle import safe_load
from capsctl.errors import DataError

EMBEDDED = Path(__file__).resolve().parent.parent / "capsctl" / "data" / "embedded"


# --------------------------------------------------------------------------------------------
# helpers


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let downloads open file:// URLs only."""
    real = dl._urlopen

    def guarded(url: str, *args: Any, **kwargs: Any) -> Any:
        if not str(url).startswith("file:"):
            raise urllib.error.URLError("network disabled in tests")
        return real(url, *args, **kwargs)

    monkeypatch.setattr(dl, "_urlopen", guarded)


def tiny_dataset(n: int = 40, c: int = 3, h: int = 8, w: int = 8, k: int = 4) -> ArrayDataset:
    """Random images whose first two pixels encode the sample id (id % 256, id // 256)."""
    g = torch.Generator().manual_seed(123)
    images = torch.randint(0, 256, (n, c, h, w), generator=g, dtype=torch.uint8)
    ids = torch.arange(n)
    images[:, 0, 0, 0] = (ids % 256).to(torch.uint8)
    images[:, 0, 0, 1] = (ids // 256).to(torch.uint8)
    labels = ids % k
    return ArrayDataset(images, labels, [f"c{i}" for i in range(k)], "tiny")


def ids_of(images: torch.Tensor) -> list[int]:
    return (images[:, 0, 0, 0].long() + 256 * images[:, 0, 0, 1].long()).tolist()


def write_cifar_batches(
    folder: Path, per_batch: int = 6, seed: int = 0, hundred: bool = False
) -> dict[str, tuple[np.ndarray, list[int]]]:
    """A fake python-batch folder pickled like the real files (protocol 2, bytes keys)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    written: dict[str, tuple[np.ndarray, list[int]]] = {}
    if hundred:
        names, label_key, meta = ["train", "test"], b"fine_labels", "meta"
        meta_obj = {b"fine_label_names": [f"n{i}".encode() for i in range(100)]}
        num_classes = 100
    else:
        names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
        label_key, meta = b"labels", "batches.meta"
        meta_obj = {b"label_names": [f"class{i}".encode() for i in range(10)], b"num_vis": 3072}
        num_classes = 10
    for fname in names:
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, num_classes, per_batch)]
        obj = {
            b"batch_label": fname.encode(),
            label_key: labels,
            b"data": data,
            b"filenames": [f"img{i}.png".encode() for i in range(per_batch)],
        }
        (folder / fname).write_bytes(pickle.dumps(obj, protocol=2))
        written[fname] = (data, labels)
    (folder / meta).write_bytes(pickle.dumps(meta_obj, protocol=2))
    return written


def write_npz(path: Path, n: int, seed: int, h: int = 32) -> None:
    rng = np.random.default_rng(seed)
    np.savez_compressed(
        path,
        images=rng.integers(0, 256, (n, h, h, 3), dtype=np.uint8),
        labels=rng.integers(0, 10, n).astype(np.uint8),
    )


def idx_bytes(arr: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    return header + arr.astype(np.uint8).tobytes()


def write_idx_split(folder: Path, prefix: str, n: int, gz: bool, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, n).astype(np.uint8)
    folder.mkdir(parents=True, exist_ok=True)
    for kind, arr in (("images-idx3", images), ("labels-idx1", labels)):
        raw = idx_bytes(arr)
        name = f"{prefix}-{kind}-ubyte"
        if gz:
            (folder / f"{name}.gz").write_bytes(gzip.compress(raw))
        else:
            (folder / name).write_bytes(raw)
    return images


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------------------------
# data dir and catalog


def test_resolve_data_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CAPSCTL_DATA", str(tmp_path / "env"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_data_dir(tmp_path / "arg") == tmp_path / "arg"
    assert resolve_data_dir(None) == tmp_path / "env"
    monkeypatch.delenv("CAPSCTL_DATA")
    assert resolve_data_dir(None) == tmp_path / "xdg" / "capsctl" / "data"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resolve_data_dir(None) == tmp_path / "home" / ".cache" / "capsctl" / "data"
    assert resolve_data_dir("~/d") == tmp_path / "home" / "d"


def test_catalog_and_normalization() -> None:
    assert {"cifar10", "cifar100", "mnist", "fashion-mnist", "fashion-mnist-quickstart"} <= set(
        DATASETS
    )
    assert DATASETS["cifar10"].val_size == 5000
    assert DATASETS["mnist"].val_size == 5000
    assert DATASETS["fashion-mnist-quickstart"].val_size == 1000
    assert dataset_info("imagefolder:/x").normalization == "none"
    assert dataset_info("cifar10[test-jpeg]").name == "cifar10"
    for info in DATASETS.values():
        assert info.normalization in NORMALIZATION
    assert normalization_for("cifar10", 3) == ([0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616])
    assert normalization_for("cifar10-authors", 3)[1] == [0.2023, 0.1994, 0.2010]
    assert normalization_for("cifar100", 3)[0] == [0.5071, 0.4865, 0.4409]
    assert normalization_for("mnist", 1) == ([0.1307], [0.3081])
    assert normalization_for("fashion-mnist", 1) == ([0.2860], [0.3530])
    assert normalization_for("none", 5) == ([0.0] * 5, [1.0] * 5)
    assert normalization_for("fashion-mnist-quickstart", 1) == ([0.2860], [0.3530])
    with pytest.raises(DataError, match="3-channel"):
        normalization_for("cifar10", 1)
    with pytest.raises(DataError, match="unknown normalization"):
        normalization_for("imagenet", 3)
    with pytest.raises(DataError, match="unknown dataset"):
        load_dataset("svhn", "train")
    with pytest.raises(DataError, match="unknown split"):
        load_dataset("mnist", "val")
    with pytest.raises(DataError, match="test_file"):
        load_dataset("fashion-mnist-quickstart", "test", test_file="test-jpeg")


# --------------------------------------------------------------------------------------------
# real data


def test_real_mnist(data_root: Path) -> None:
    train = load_dataset("mnist", "train", data_root, download=False)
    test = load_dataset("mnist", "test", data_root, download=False)
    assert train.images.shape == (60000, 1, 28, 28) and train.images.dtype == torch.uint8
    assert test.images.shape == (10000, 1, 28, 28)
    assert train.labels.dtype == torch.int64
    assert torch.bincount(train.labels).tolist() == [
        5923,
        6742,
        5958,
        6131,
        5842,
        5421,
        5918,
        6265,
        5851,
        5949,
    ]
    assert torch.bincount(test.labels).tolist() == [
        980,
        1135,
        1032,
        1010,
        982,
        892,
        958,
        1028,
        974,
        1009,
    ]
    assert train.classes == [str(i) for i in range(10)]
    mean = float(train.images.numpy().sum(dtype=np.uint64)) / (60000 * 28 * 28 * 255)
    assert abs(mean - NORMALIZATION["mnist"][0][0]) < 1e-4


def test_real_cifar10_train(data_root: Path) -> None:
    """The one test that reads all four train files (~140 MB compressed)."""
    events: list[dict[str, Any]] = []
    ds = load_dataset("cifar10", "train", data_root, download=False, on_event=events.append)
    assert ds.name == "cifar10"
    assert ds.images.shape == (50000, 3, 32, 32) and ds.images.is_contiguous()
    assert ds.images[0, 0, 0, :6].tolist() == [59, 43, 50, 68, 98, 119]
    assert ds.classes[0] == "airplane" and ds.classes[6] == "frog" and ds.labels[0] == 6
    assert torch.bincount(ds.labels).tolist() == [5000] * 10
    sums = ds.images.numpy().sum(axis=(0, 2, 3), dtype=np.uint64)  # numpy: fast on uint8
    mean = (sums / (50000 * 32 * 32 * 255)).tolist()
    assert mean == pytest.approx(NORMALIZATION["cifar10"][0], abs=1e-4)
    assert events[-1]["event"] == "dataset" and events[-1]["count"] == 50000
    assert len(fingerprint(ds)) == 16


def test_real_cifar10_test_file_selection(data_root: Path) -> None:
    assert find_test_files("cifar10", data_root) == ["test-lossless-1k.npz", "test-jpeg.npz"]
    default = load_dataset("cifar10", "test", data_root, download=False)
    assert default.name == "cifar10[test-lossless-1k]"
    assert len(default) == 1000
    assert default.images[0, 0, 0, :6].tolist() == [158, 159, 165, 166, 160, 156]
    assert torch.bincount(default.labels).tolist() == [
        103,
        89,
        100,
        103,
        90,
        86,
        112,
        102,
        106,
        109,
    ]
    jpeg = load_dataset("cifar10", "test", data_root, test_file="test-jpeg", download=False)
    assert jpeg.name == "cifar10[test-jpeg]" and len(jpeg) == 10000
    again = load_dataset(jpeg.name, "test", data_root, download=False)  # the name round-trips
    assert fingerprint(again) == fingerprint(jpeg)
    with pytest.raises(DataError, match="test-lossless-1k.npz, test-jpeg.npz"):
        load_dataset("cifar10", "test", data_root, test_file="test-full.npz", download=False)


def test_real_fashion_mnist_from_debian(tmp_path: Path) -> None:
    from capsctl.data.sources import FASHION_MNIST_SYSTEM_DIR

    if not (FASHION_MNIST_SYSTEM_DIR / "t10k-images-idx3-ubyte.gz").is_file():
        pytest.skip("Debian's dataset-fashion-mnist is not installed")
    ds = load_dataset("fashion-mnist", "test", tmp_path, download=False)
    assert ds.images.shape == (10000, 1, 28, 28)
    assert torch.bincount(ds.labels).tolist() == [1000] * 10
    assert ds.classes[0] == "T-shirt/top" and ds.classes[9] == "Ankle boot"


# --------------------------------------------------------------------------------------------
# embedded quickstart


def test_quickstart_embedded() -> None:
    npz = EMBEDDED / "fashion-mnist-quickstart.npz"
    assert npz.stat().st_size <= 5 * 1024 * 1024
    assert "Zalando SE" in (EMBEDDED / "LICENSE-fashion-mnist.txt").read_text()
    train = load_dataset("fashion-mnist-quickstart", "train", "/nonexistent", download=False)
    test = load_dataset("fashion-mnist-quickstart", "test", download=False)
    assert train.images.shape[1:] == (1, 28, 28) and test.images.shape[1:] == (1, 28, 28)
    train_counts = torch.bincount(train.labels, minlength=10).tolist()
    test_counts = torch.bincount(test.labels, minlength=10).tolist()
    assert len(set(train_counts)) == 1 and train_counts[0] >= 500
    assert len(set(test_counts)) == 1 and test_counts[0] >= 100
    assert train.classes[0] == "T-shirt/top" and len(train.classes) == 10
    assert train.name == "fashion-mnist-quickstart"
    with np.load(npz, allow_pickle=False) as z:
        assert z["train_images"].dtype == np.uint8 and z["train_labels"].dtype == np.uint8


# --------------------------------------------------------------------------------------------
# CIFAR python batches and the safe unpickler


def test_fake_cifar10_batches(tmp_path: Path) -> None:
    written = write_cifar_batches(tmp_path / "cifar10" / "cifar-10-batches-py")
    # An npz folder next to it must lose against the python batches.
    write_npz(tmp_path / "cifar10" / "train-0.npz", 3, 0)
    train = load_dataset("cifar10", "train", tmp_path, download=False)
    test = load_dataset("cifar10", "test", tmp_path, download=False)
    assert len(train) == 30 and len(test) == 6
    assert train.classes == [f"class{i}" for i in range(10)]
    data, labels = written["data_batch_2"]
    assert torch.equal(train.images[6], torch.from_numpy(data[0].reshape(3, 32, 32)))
    assert train.labels[6:12].tolist() == labels
    tdata, tlabels = written["test_batch"]
    assert torch.equal(test.images, torch.from_numpy(tdata.reshape(6, 3, 32, 32)))
    assert test.labels.tolist() == tlabels and test.name == "cifar10"


def test_fake_cifar100_batches_directly_under_data_dir(tmp_path: Path) -> None:
    written = write_cifar_batches(tmp_path / "cifar-100-python", hundred=True)
    ds = load_dataset("cifar100", "train", tmp_path, download=False)
    assert len(ds.classes) == 100 and ds.classes[3] == "n3"
    assert ds.labels.tolist() == written["train"][1]


def _malicious_payloads(target: Path) -> list[Any]:
    class SystemCall:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {target}",))

    class OpenCall:
        def __reduce__(self) -> Any:
            return (open, (str(target), "w"))

    return [SystemCall(), OpenCall()]


def test_safe_unpickler_refuses_code(tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    for payload in _malicious_payloads(target):
        path = tmp_path / "evil.pkl"
        path.write_bytes(pickle.dumps({b"data": payload}, protocol=2))
        with pytest.raises(DataError, match=r"refuses to load .*evil\.pkl.*plain data never needs"):
            safe_load(path)
        assert not target.exists()
    # ... also when it sits inside a CIFAR folder
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar_batches(folder)
    (folder / "data_batch_3").write_bytes(
        pickle.dumps({b"data": _malicious_payloads(target)[0]}, protocol=2)
    )
    with pytest.raises(DataError, match="system"):
        load_dataset("cifar10", "train", tmp_path, download=False)
    assert not target.exists()


def test_safe_unpickler_plain_data_and_corrupt_files(tmp_path: Path) -> None:
    path = tmp_path / "ok.pkl"
    obj = {"a": np.arange(5, dtype=np.int64), "b": np.float32(2.5), b"c": [1, "x", b"y"]}
    path.write_bytes(pickle.dumps(obj, protocol=2))
    loaded = safe_load(path)
    assert np.array_equal(loaded["a"], obj["a"]) and loaded["b"] == 2.5 and loaded[b"c"][2] == b"y"
    bad = tmp_path / "bad.pkl"
    bad.write_bytes(pickle.dumps(obj, protocol=2)[:20])
    with pytest.raises(DataError, match=r"bad\.pkl"):
        safe_load(bad)


# --------------------------------------------------------------------------------------------
# npz folders


def test_npz_folder_order_and_defaults(tmp_path: Path) -> None:
    folder = tmp_path / "cifar10"
    folder.mkdir()
    for i, n in ((0, 2), (1, 3), (10, 4), (2, 5)):  # natural order: 0, 1, 2, 10
        write_npz(folder / f"train-{i}.npz", n, seed=i)
    write_npz(folder / "test-jpeg.npz", 7, seed=20)
    write_npz(folder / "test-lossless-1k.npz", 6, seed=21)
    train = load_dataset("cifar10", "train", tmp_path, download=False)
    assert len(train) == 14
    with np.load(folder / "train-2.npz") as z:
        first_of_2 = torch.from_numpy(z["images"][0]).permute(2, 0, 1)
    assert torch.equal(train.images[5], first_of_2)
    assert train.classes[0] == "airplane"  # no classes.txt: the standard names
    assert load_dataset("cifar10", "test", tmp_path).name == "cifar10[test-lossless-1k]"
    write_npz(folder / "test.npz", 8, seed=22)
    (folder / "classes.txt").write_text("\n".join(f"k{i}" for i in range(10)) + "\n")
    test = load_dataset("cifar10", "test", tmp_path)
    assert test.name == "cifar10" and len(test) == 8 and test.classes[9] == "k9"
    assert find_test_files("cifar10", tmp_path) == [
        "test.npz",
        "test-lossless-1k.npz",
        "test-jpeg.npz",
    ]
    # data_dir may also be the npz folder itself
    assert len(load_dataset("cifar10", "test", folder, test_file="test-jpeg.npz")) == 7
    (folder / "test-broken.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError, match=r"test-broken\.npz"):
        load_dataset("cifar10", "test", tmp_path, test_file="test-broken")


# --------------------------------------------------------------------------------------------
# IDX


@pytest.mark.parametrize("gz", [True, False])
def test_idx_reader_and_mnist_layouts(tmp_path: Path, gz: bool) -> None:
    images = write_idx_split(tmp_path / "mnist" / "raw", "t10k", 12, gz=gz)
    arr = read_idx(next((tmp_path / "mnist" / "raw").glob("t10k-images*")))
    assert arr.shape == (12, 28, 28) and arr.dtype == np.uint8 and np.array_equal(arr, images)
    ds = load_dataset("mnist", "test", tmp_path, download=False)
    assert torch.equal(ds.images[:, 0], torch.from_numpy(images))
    # torchvision's layout for Fashion-MNIST
    fimages = write_idx_split(tmp_path / "FashionMNIST" / "raw", "train", 5, gz=gz, seed=3)
    fds = load_dataset("fashion-mnist", "train", tmp_path, download=False)
    assert torch.equal(fds.images[:, 0], torch.from_numpy(fimages))


def test_idx_reader_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad-idx"
    bad.write_bytes(b"\x01\x02\x03\x04rest")
    with pytest.raises(DataError, match="bad-idx"):
        read_idx(bad)
    good = idx_bytes(np.zeros((3, 2, 2), dtype=np.uint8))
    (tmp_path / "short").write_bytes(good[:-1])
    with pytest.raises(DataError, match="short"):
        read_idx(tmp_path / "short")
    (tmp_path / "trunc.gz").write_bytes(gzip.compress(good)[:-10])
    with pytest.raises(DataError, match=r"trunc\.gz"):
        read_idx(tmp_path / "trunc.gz")


# --------------------------------------------------------------------------------------------
# image folders


def _write_png(path: Path, arr: np.ndarray) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)


def test_imagefolder(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    pics = {}
    for split in ("train", "test"):
        for cls in ("dog", "cat"):
            for i in range(2):
                arr = rng.integers(0, 256, (5, 7, 3), dtype=np.uint8)
                pics[(split, cls, i)] = arr
                _write_png(tmp_path / "pets" / split / cls / f"{i}.png", arr)
    (tmp_path / "pets" / "train" / "cat" / "notes.txt").write_text("ignored")
    spec = f"imagefolder:{tmp_path / 'pets'}"
    ds = load_dataset(spec, "train")
    assert ds.classes == ["cat", "dog"] and ds.labels.tolist() == [0, 0, 1, 1]
    assert ds.images.shape == (4, 3, 5, 7) and ds.name == spec
    assert torch.equal(ds.images[2], torch.from_numpy(pics[("train", "dog", 0)]).permute(2, 0, 1))
    # grayscale folder -> one channel
    _write_png(tmp_path / "gray" / "test" / "a" / "x.png", np.full((4, 4), 7, dtype=np.uint8))
    gray = load_dataset(f"imagefolder:{tmp_path / 'gray'}", "test")
    assert gray.images.shape == (1, 1, 4, 4) and int(gray.images.max()) == 7
    with pytest.raises(DataError, match="not found"):
        load_dataset(f"imagefolder:{tmp_path / 'gray'}", "train")


def test_imagefolder_errors_name_the_file(tmp_path: Path) -> None:
    root = tmp_path / "imgs"
    _write_png(root / "train" / "a" / "ok.png", np.zeros((4, 4, 3), dtype=np.uint8))
    broken = root / "train" / "b" / "broken.png"
    broken.parent.mkdir()
    broken.write_bytes(b"\x89PNG not really")
    with pytest.raises(DataError, match=r"broken\.png"):
        load_dataset(f"imagefolder:{root}", "train")
    broken.unlink()
    _write_png(root / "train" / "b" / "big.png", np.zeros((6, 4, 3), dtype=np.uint8))
    with pytest.raises(DataError, match=r"big\.png.*one size"):
        load_dataset(f"imagefolder:{root}", "train")


# --------------------------------------------------------------------------------------------
# downloads (file:// URLs only)


def _cifar_tarball(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    write_cifar_batches(src / "cifar-10-batches-py")
    tar_path = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(tar_path, "w:gz") as tar:
        tar.add(src / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    return tar_path


def test_download_cifar_from_file_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tar_path = _cifar_tarball(tmp_path)
    remote = dl.Remote((tar_path.as_uri(),), "cifar-10-python.tar.gz", md5(tar_path))
    monkeypatch.setitem(dl.CIFAR_ARCHIVES, "cifar10", remote)
    events: list[dict[str, Any]] = []
    root = tmp_path / "data"
    ds = load_dataset("cifar10", "train", root, on_event=events.append)
    assert len(ds) == 30
    assert (root / "cifar10" / "cifar-10-batches-py" / "test_batch").is_file()
    assert not (root / "cifar10" / "cifar-10-python.tar.gz").exists()  # removed after extracting
    kinds = [e["event"] for e in events]
    assert "download" in kinds and "extract" in kinds and kinds[-1] == "dataset"
    last = [e for e in events if e["event"] == "download"][-1]
    assert last["done"] == tar_path.stat().st_size
    # second call finds the extracted folder; no download
    events.clear()
    load_dataset("cifar10", "test", root, on_event=events.append)
    assert [e["event"] for e in events] == ["dataset"]


@pytest.mark.parametrize("name", ["cifar10", "mnist", "fashion-mnist"])
def test_a_failed_download_removes_only_the_folders_it_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setattr(dl, "_urlopen", lambda *a, **k: (_ for _ in ()).throw(OSError("offline")))
    # Debian's dataset-fashion-mnist (installed by CI) would be found before any download
    monkeypatch.setattr(sources, "FASHION_MNIST_SYSTEM_DIR", tmp_path / "no-system-copy")
    fresh = tmp_path / "fresh" / "data"
    with pytest.raises(DataError, match="could not download"):
        load_dataset(name, "train", fresh)
    assert not (tmp_path / "fresh").exists()
    shared = tmp_path / "shared"  # like CAPSCTL_DATA: it exists and holds other data
    (shared / "other").mkdir(parents=True)
    monkeypatch.setenv("CAPSCTL_DATA", str(shared))
    with pytest.raises(DataError, match="could not download"):
        load_dataset(name, "test")
    assert sorted(p.name for p in shared.iterdir()) == ["other"]
    (shared / name).mkdir()  # a folder the user made is kept, even when empty
    with pytest.raises(DataError, match="could not download"):
        load_dataset(name, "test")
    assert (shared / name).is_dir()


def test_download_md5_mismatch_and_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = dl.CIFAR_ARCHIVES["cifar10"]
    tar_path = _cifar_tarball(tmp_path)
    root = tmp_path / "data"
    bad = dl.Remote((tar_path.as_uri(),), "cifar-10-python.tar.gz", "0" * 32)
    monkeypatch.setitem(dl.CIFAR_ARCHIVES, "cifar10", bad)
    with pytest.raises(DataError, match="md5 mismatch"):
        load_dataset("cifar10", "train", root)
    assert not root.exists()  # no partial file, nor the folders the download created
    missing = dl.Remote(((tmp_path / "nope.tar.gz").as_uri(),), "cifar-10-python.tar.gz", "0" * 32)
    monkeypatch.setitem(dl.CIFAR_ARCHIVES, "cifar10", missing)
    with pytest.raises(DataError, match=r"could not download CIFAR-10.*looked in: .*data") as e:
        load_dataset("cifar10", "train", root)
    assert str(root / "cifar-10-batches-py") in str(e.value) and "\n" not in str(e.value)
    # the real URLs with the network disabled (by the no_network fixture)
    monkeypatch.setitem(dl.CIFAR_ARCHIVES, "cifar10", original)
    with pytest.raises(DataError, match="could not download.*network disabled"):
        load_dataset("cifar10", "test", tmp_path / "other")
    monkeypatch.setattr(dl, "_urlopen", lambda *a, **k: pytest.fail("download attempted"))
    with pytest.raises(DataError, match="not found; looked in"):
        load_dataset("cifar10", "test", tmp_path / "other", download=False)


def test_download_mnist_from_mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mirror = tmp_path / "mirror"
    images = write_idx_split(mirror, "t10k", 4, gz=True)
    md5s = {p.name: md5(p) for p in mirror.iterdir()}
    monkeypatch.setitem(
        dl.IDX_MIRRORS, "mnist", ("http://unreachable.invalid/", mirror.as_uri() + "/")
    )
    monkeypatch.setitem(dl.IDX_MD5, "mnist", md5s)
    ds = load_dataset("mnist", "test", tmp_path / "data")
    assert torch.equal(ds.images[:, 0], torch.from_numpy(images))
    assert (tmp_path / "data" / "mnist" / "t10k-images-idx3-ubyte.gz").is_file()


def test_extract_tar_refuses_unsafe_members(tmp_path: Path) -> None:
    def make(name: str, build: Any) -> Path:
        path = tmp_path / name
        with tarfile.open(path, "w") as tar:
            build(tar)
        return path

    def add_file(tar: tarfile.TarFile, arcname: str, data: bytes = b"x") -> None:
        info = tarfile.TarInfo(arcname)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    def traversal(tar: tarfile.TarFile) -> None:
        add_file(tar, "ok/fine.txt")
        add_file(tar, "ok/../../evil.txt")

    def absolute(tar: tarfile.TarFile) -> None:
        add_file(tar, "/tmp/capsctl-evil-absolute.txt")

    def symlink(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo("link")
        info.type = tarfile.SYMTYPE
        info.linkname = "/etc/passwd"
        tar.addfile(info)

    dest = tmp_path / "out"
    for name, build in (("t.tar", traversal), ("a.tar", absolute), ("s.tar", symlink)):
        with pytest.raises(DataError, match="refusing to extract"):
            dl.extract_tar(make(name, build), dest)
    assert not (tmp_path / "evil.txt").exists()
    assert not Path("/tmp/capsctl-evil-absolute.txt").exists()
    assert not (dest / "ok" / "fine.txt").exists()  # checked before anything is written
    good = make("g.tar", lambda tar: add_file(tar, "./d/f.txt", b"hello"))
    assert dl.extract_tar(good, dest) == [dest / "d" / "f.txt"]
    assert (dest / "d" / "f.txt").read_bytes() == b"hello"


# --------------------------------------------------------------------------------------------
# dataset operations


def test_array_dataset_subset_and_validation() -> None:
    ds = tiny_dataset(10)
    sub = ds.subset(torch.tensor([3, 1]))
    assert ids_of(sub.images) == [3, 1] and sub.labels.tolist() == [3, 1] and len(sub) == 2
    assert len(ds.subset(ds.labels == 0)) == 3
    with pytest.raises(DataError, match="uint8"):
        ArrayDataset(ds.images.float(), ds.labels, ds.classes, "x")
    with pytest.raises(DataError, match="labels"):
        ArrayDataset(ds.images, ds.labels[:5], ds.classes, "x")


def test_split_train_val() -> None:
    ds = tiny_dataset(103, k=4)
    tr, va = split_train_val(ds, 20, seed=7)
    tr2, va2 = split_train_val(ds, 20, seed=7)
    _, va3 = split_train_val(ds, 20, seed=8)
    assert len(tr) == 83 and len(va) == 20
    assert ids_of(va.images) == ids_of(va2.images) and ids_of(tr.images) == ids_of(tr2.images)
    assert ids_of(va.images) != ids_of(va3.images)
    assert set(ids_of(tr.images)).isdisjoint(ids_of(va.images))
    assert sorted(ids_of(tr.images) + ids_of(va.images)) == list(range(103))
    assert ids_of(va.images) == sorted(ids_of(va.images))  # original order kept
    assert torch.bincount(va.labels).tolist() == [5, 5, 5, 5]  # stratified
    # pinned: the same images as before composite datasets got their own split
    pinned = [12, 23, 25, 33, 35, 37, 38, 43, 54, 62, 65, 66, 67, 68, 71, 72, 76, 77, 82, 92]
    assert ids_of(va.images) == pinned
    # a plain multi-label dataset is still split by rows, stratified on the first label
    pairs = ArrayDataset(
        ds.images, torch.stack([ds.labels, (ds.labels + 1) % 4], 1), ds.classes, "p"
    )
    assert ids_of(split_train_val(pairs, 20, seed=7)[1].images) == pinned
    assert fingerprint(va) == fingerprint(va2)
    # global RNG state does not matter
    torch.manual_seed(999)
    assert ids_of(split_train_val(ds, 20, seed=7)[1].images) == ids_of(va.images)
    assert len(split_train_val(ds, 0, seed=0)[1]) == 0
    with pytest.raises(DataError, match="val_size"):
        split_train_val(ds, 103, seed=0)


def test_fingerprint() -> None:
    ds = tiny_dataset(10)
    fp = fingerprint(ds)
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert fingerprint(tiny_dataset(10)) == fp
    changed = tiny_dataset(10)
    changed.images[9, 2, 7, 7] ^= 1
    assert fingerprint(changed) != fp
    relabeled = tiny_dataset(10)
    relabeled.labels[0] = 3
    assert fingerprint(relabeled) != fp


# --------------------------------------------------------------------------------------------
# Loader


def _batches(loader: Loader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(loader)


def test_loader_shapes_and_normalization() -> None:
    ds = tiny_dataset(10)
    mean, std = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]
    loader = Loader(ds, 4, shuffle=False, mean=mean, std=std)
    batches = _batches(loader)
    assert len(loader) == 3 and [len(y) for _, y in batches] == [4, 4, 2]
    x, y = batches[0]
    assert x.dtype == torch.float32 and x.shape == (4, 3, 8, 8) and x.device.type == "cpu"
    assert y.dtype == torch.int64 and y.tolist() == [0, 1, 2, 3]
    expected = (ds.images[:4].float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(
        std
    ).view(1, 3, 1, 1)
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-5)
    assert len(Loader(ds, 4, shuffle=False, mean=mean, std=std, drop_last=True)) == 2
    with pytest.raises(DataError, match="channel"):
        Loader(ds, 4, shuffle=False, mean=[0.5], std=[0.5])


def _raw(x: torch.Tensor) -> torch.Tensor:
    """Undo mean 0 / std 1 normalization back to uint8 pixel values."""
    return (x * 255).round().to(torch.uint8)


def test_loader_augmentation_preserves_content() -> None:
    ds = tiny_dataset(32)
    kw: dict[str, Any] = {"shuffle": False, "mean": [0.0] * 3, "std": [1.0] * 3}
    plain = torch.cat([_raw(x) for x, _ in Loader(ds, 8, crop_padding=0, **kw)])
    assert torch.equal(plain, ds.images)  # padding 0 and no flip: identity

    flipped = torch.cat([_raw(x) for x, _ in Loader(ds, 8, hflip=True, seed=1, **kw)])
    same = [torch.equal(a, b) for a, b in zip(flipped, ds.images, strict=True)]
    mirrored = [torch.equal(a, b.flip(-1)) for a, b in zip(flipped, ds.images, strict=True)]
    assert all(s or m for s, m in zip(same, mirrored, strict=True))
    assert any(same) and any(mirrored)
    assert torch.equal(flipped.flip(-1).flip(-1), flipped)

    p = 2
    loader = Loader(ds, 8, crop_padding=p, hflip=True, seed=3, **kw)
    cropped = torch.cat([_raw(x) for x, _ in loader])
    padded = torch.nn.functional.pad(ds.images, (p, p, p, p))
    offsets = set()
    for i in range(len(ds)):
        windows = {
            (dy, dx, f)
            for dy in range(2 * p + 1)
            for dx in range(2 * p + 1)
            for f in (False, True)
            if torch.equal(
                cropped[i],
                (lambda w: w.flip(-1) if f else w)(padded[i, :, dy : dy + 8, dx : dx + 8]),
            )
        }
        assert windows, f"sample {i} is not a flipped/unflipped window of its padded image"
        offsets |= windows
    assert len({(dy, dx) for dy, dx, _ in offsets}) > 3  # offsets really vary


def test_loader_zero_padding_normalizes_to_black() -> None:
    ds = ArrayDataset(
        torch.full((4, 1, 4, 4), 255, dtype=torch.uint8),
        torch.zeros(4, dtype=torch.long),
        ["a"],
        "w",
    )
    x = torch.cat(
        [b for b, _ in Loader(ds, 4, shuffle=False, mean=[0.5], std=[0.25], crop_padding=4)]
    )
    values = set(x.unique().tolist())
    assert values <= {(0 - 0.5) / 0.25, (1 - 0.5) / 0.25}
    assert (0 - 0.5) / 0.25 in values  # some padding was cut in


def test_loader_reproducible_and_epoch_dependent() -> None:
    ds = tiny_dataset(50)
    kw: dict[str, Any] = {
        "shuffle": True,
        "seed": 5,
        "mean": [0.1] * 3,
        "std": [0.2] * 3,
        "crop_padding": 2,
        "hflip": True,
    }
    a, b = Loader(ds, 16, **kw), Loader(ds, 16, **kw)
    a.set_epoch(3)
    b.set_epoch(3)
    torch.manual_seed(0)
    first = _batches(a)
    torch.manual_seed(1)
    second = _batches(b)
    for (x1, y1), (x2, y2) in zip(first, second, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert all(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(first, _batches(a), strict=True))
    no_aug = Loader(ds, 50, shuffle=True, seed=5, mean=[0.0] * 3, std=[1.0] * 3)
    no_aug.set_epoch(3)
    ids3 = ids_of(_raw(next(iter(no_aug))[0]))
    no_aug.set_epoch(4)
    ids4 = ids_of(_raw(next(iter(no_aug))[0]))
    assert sorted(ids3) == sorted(ids4) == list(range(50))
    assert ids3 != ids4  # another epoch, another order


@pytest.mark.parametrize("n,world,drop_last", [(10, 3, False), (12, 4, False), (11, 3, True)])
def test_loader_sharding(n: int, world: int, drop_last: bool) -> None:
    ds = tiny_dataset(n)
    kw: dict[str, Any] = {"shuffle": True, "seed": 2, "mean": [0.0] * 3, "std": [1.0] * 3}
    shards = []
    for rank in range(world):
        loader = Loader(ds, 2, rank=rank, world_size=world, drop_last=drop_last, **kw)
        loader.set_epoch(1)
        shards.append([i for x, _ in loader for i in ids_of(_raw(x))])
    lengths = {
        len(Loader(ds, 2, rank=r, world_size=world, drop_last=drop_last, **kw))
        for r in range(world)
    }
    assert len(lengths) == 1  # every rank runs the same number of batches
    sizes = {len(s) for s in shards}
    every = [i for s in shards for i in s]
    if drop_last:
        assert sizes == {2 * (n // world // 2)}
        assert len(set(every)) == len(every)  # disjoint
    else:
        assert sizes == {-(-n // world)}
        assert set(every) == set(range(n))  # covering
        assert len(every) - len(set(every)) == len(every) - n  # only the wrap-around repeats
        assert all(len(set(s)) == len(s) for s in shards)


def test_quickstart_in_a_loader() -> None:
    ds = load_dataset("fashion-mnist-quickstart", "test")
    mean, std = normalization_for(dataset_info(ds.name).normalization, ds.images.shape[1])
    loader = Loader(ds, 500, shuffle=True, mean=mean, std=std, crop_padding=2, hflip=True)
    x, y = next(iter(loader))
    assert x.shape == (500, 1, 28, 28) and abs(float(x.mean())) < 0.5
    assert zipfile.is_zipfile(EMBEDDED / "fashion-mnist-quickstart.npz")


def test_quickstart_file_is_reproduced_by_its_script(tmp_path: Path) -> None:
    """scripts/make_quickstart_data.py rebuilds exactly the shipped arrays from Debian's files."""
    import numpy as np

    source = Path("/usr/share/datasets/fashion-mnist")
    if not (source / "train-images-idx3-ubyte.gz").exists():
        pytest.skip("Debian's dataset-fashion-mnist is not installed")
    mod = load_script("make_quickstart_data")
    out = tmp_path / "q.npz"
    assert mod.main(["--source", str(source), "--out", str(out)]) == 0
    shipped = Path(__file__).resolve().parent.parent / "capsctl" / "data" / "embedded"
    with np.load(out) as new, np.load(shipped / "fashion-mnist-quickstart.npz") as old:
        assert sorted(new.files) == sorted(old.files)
        for key in new.files:
            assert np.array_equal(new[key], old[key]), key


def test_too_few_images_for_a_batch_gives_advice_a_user_can_follow() -> None:
    from capsctl.data import Loader

    ds = tiny_dataset(10)
    with pytest.raises(DataError) as info:
        Loader(ds, 16, shuffle=True, mean=[0.5] * 3, std=[0.25] * 3, drop_last=True)
    message = str(info.value)
    assert "10 images" in message and "--batch-size" in message and "data.val_size" in message
    assert "drop_last" not in message and "\n" not in message


def test_a_val_size_leaving_no_training_images_says_what_to_set() -> None:
    from capsctl.config import load_preset
    from capsctl.data.prepare import prepare_data
    from capsctl.errors import ConfigError

    preset = load_preset("quickstart", ["data.val_size=100000"])
    with pytest.raises(ConfigError) as info:
        prepare_data(preset)
    message = str(info.value)
    assert "data.val_size: 100000" in message and "--set data.val_size=" in message


def test_an_empty_home_or_xdg_cache_home_counts_as_unset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pwd = pytest.importorskip("pwd")
    home = Path(pwd.getpwuid(os.getuid()).pw_dir)
    monkeypatch.delenv("CAPSCTL_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    monkeypatch.setenv("HOME", "")
    assert resolve_data_dir(None) == home / ".cache" / "capsctl" / "data"
    assert resolve_data_dir("~/d") == home / "d"
    monkeypatch.setenv("CAPSCTL_DATA", "~/shared")
    assert resolve_data_dir(None) == home / "shared"
