"""Finding, downloading and decoding datasets into :class:`ArrayDataset`: :func:`load_dataset`.

Where data is looked for (``root`` = :func:`resolve_data_dir`):

- ``cifar10`` / ``cifar100``: a python-batch folder, an npz folder (``test_file`` picks its
  test file; a test set read from a file other than ``test.npz`` is named
  ``"<name>[<file stem>]"``, and that name can be passed back to :func:`load_dataset`), else
  the canonical download; see :mod:`capsctl.data.cifar`.
- ``mnist`` / ``fashion-mnist``: the IDX files (``.gz`` or plain) in ``root``,
  ``root/<name>``, ``root/<name>/raw``, torchvision's ``root/MNIST/raw`` /
  ``root/FashionMNIST/raw`` and, for Fashion-MNIST, ``/usr/share/datasets/fashion-mnist``;
  else downloaded from the canonical mirrors into ``root/<name>/``.
- ``diverse-multimnist``: composed from the MNIST split found as above
  (:mod:`capsctl.data.multimnist`); the result remembers its source digits, so that
  :func:`~capsctl.data.split_train_val` holds out MNIST digits, not composites.
- ``expanded-mnist``: MNIST digits at random places on 40x40 canvases
  (:mod:`capsctl.data.expanded_mnist`), generated from the MNIST split found as above.
- ``smallnorb``, ``smallnorb-azimuth``, ``smallnorb-elevation``: the official smallNORB files
  in ``root/smallnorb`` or ``root`` (:mod:`capsctl.data.smallnorb`; never downloaded here).
- ``fashion-mnist-quickstart``: the subset shipped inside the package (no files needed).
- ``imagefolder:<path>``: ``<path>/<split>/<class>/*.png|jpg|jpeg|bmp|gif|webp``
  (:mod:`capsctl.data.imagefolder`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from capsctl.data.arrays import dataset_from_arrays
from capsctl.data.catalog import FASHION_MNIST_CLASSES, MNIST_CLASSES, dataset_info
from capsctl.data.cifar import load_cifar, npz_dirs, npz_test_candidates
from capsctl.data.dataset import ArrayDataset
from capsctl.data.download import IDX_MD5, IDX_MIRRORS, Remote, download_file
from capsctl.data.idx import read_idx
from capsctl.data.imagefolder import load_imagefolder
from capsctl.errors import DataError
from capsctl.events import EventFn, emit
from capsctl.user_cache import home_folder

__all__ = [
    "FASHION_MNIST_SYSTEM_DIR",
    "QUICKSTART_FILE",
    "find_test_files",
    "load_dataset",
    "resolve_data_dir",
]

FASHION_MNIST_SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")
"""Where Debian's ``dataset-fashion-mnist`` package installs the IDX files."""

QUICKSTART_FILE = "fashion-mnist-quickstart.npz"
"""File name of the embedded quickstart subset in ``capsctl/data/embedded/``."""

_EMBEDDED = Path(__file__).resolve().parent / "embedded"

_SPLITS = ("train", "test")


# --------------------------------------------------------------------------------------------
# data dir


def resolve_data_dir(data_dir: str | Path | None) -> Path:
    """The data root: ``data_dir`` if given, else ``$CAPSCTL_DATA``, else the user cache.

    The cache is ``$XDG_CACHE_HOME/capsctl/data`` (``~/.cache/capsctl/data`` when
    ``XDG_CACHE_HOME`` is unset, empty or not absolute). ``~`` is expanded; an empty ``HOME``
    counts as unset (the home folder is then the one the user database names, never ``/``).
    Nothing is created.
    """
    if data_dir is not None and str(data_dir) != "":
        return _expand_user(data_dir)
    env = os.environ.get("CAPSCTL_DATA", "")
    if env:
        return _expand_user(env)
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    cache = Path(xdg) if xdg and Path(xdg).is_absolute() else _home() / ".cache"
    return cache / "capsctl" / "data"


def _home() -> Path:
    """The user's home folder (:func:`capsctl.user_cache.home_folder`), or a one-line error."""
    found = home_folder()
    if not found:
        raise DataError(
            "HOME is empty and this user has no home folder; set CAPSCTL_DATA or pass "
            "--data-dir to say where datasets live"
        )
    return Path(found)


def _expand_user(path: str | Path) -> Path:
    """``path`` with a leading ``~`` replaced by :func:`_home` (``~user`` as the OS says)."""
    text = os.fspath(path)
    if text == "~" or text.startswith(("~/", "~" + os.sep)):
        return _home() / text[2:]
    return Path(text).expanduser()


# --------------------------------------------------------------------------------------------
# entry point


def load_dataset(
    name: str,
    split: str,
    data_dir: str | Path | None = None,
    *,
    test_file: str | None = None,
    download: bool = True,
    on_event: EventFn = None,
) -> ArrayDataset:
    """Load split ``"train"`` or ``"test"`` of dataset ``name`` (see the module docstring).

    ``test_file`` picks the npz test file of a CIFAR npz folder (``"test-jpeg"`` or
    ``"test-jpeg.npz"``); it is ignored for ``split="train"`` and an error for other
    datasets. ``name`` may carry it in brackets (``"cifar10[test-jpeg]"``).
    ``download=False`` never touches the network. ``on_event`` receives progress dicts:
    ``{"event": "download", "url", "done", "total"}`` (total may be None),
    ``{"event": "downloaded", "url", "path"}``, ``{"event": "extract", "path"}`` and, once
    loaded, ``{"event": "dataset", "name", "split", "source", "count"}``.
    Every problem is a :class:`DataError` with a one-line message.
    """
    if split not in _SPLITS:
        raise DataError(
            f"unknown split {split!r}; use 'train' or 'test' (validation data comes from "
            "split_train_val)"
        )
    base = name
    m = re.fullmatch(r"([^\[\]]+)\[([^\[\]]+)\]", name)
    if m and not name.startswith("imagefolder:"):
        base = m.group(1)
        if test_file is None:
            test_file = m.group(2)
    if split == "train":
        test_file = None

    if base.startswith("imagefolder:"):
        _reject_test_file(base, test_file)
        ds, source = load_imagefolder(base, split)
    else:
        dataset_info(base)  # DataError for unknown names
        root = resolve_data_dir(data_dir)
        if base in ("cifar10", "cifar100"):
            ds, source = load_cifar(base, split, root, test_file, download, on_event)
        elif base in ("mnist", "fashion-mnist"):
            _reject_test_file(base, test_file)
            ds, source = _load_idx_dataset(base, split, root, download, on_event)
        elif base == "diverse-multimnist":
            _reject_test_file(base, test_file)
            from capsctl.data.multimnist import SEEDS, diverse_multimnist

            mnist, source = _load_idx_dataset("mnist", split, root, download, on_event)
            ds = diverse_multimnist(mnist, seed=SEEDS[split], name="diverse-multimnist")
            source = f"generated from MNIST in {source}"
        elif base == "expanded-mnist":
            _reject_test_file(base, test_file)
            from capsctl.data.expanded_mnist import SEEDS as EXPANDED_SEEDS
            from capsctl.data.expanded_mnist import expanded_mnist

            mnist, source = _load_idx_dataset("mnist", split, root, download, on_event)
            ds = expanded_mnist(mnist, seed=EXPANDED_SEEDS[split])
            source = f"generated from MNIST in {source}"
        elif base.startswith("smallnorb"):
            _reject_test_file(base, test_file)
            from capsctl.data.smallnorb import load_smallnorb

            folder = root / "smallnorb" if (root / "smallnorb").is_dir() else root
            view = base.split("-", 1)[1] if "-" in base else None
            ds, source = load_smallnorb(folder, split, view), str(folder)
        elif base == "fashion-mnist-quickstart":
            _reject_test_file(base, test_file)
            ds, source = _load_quickstart(split)
        else:  # pragma: no cover - catalog and loaders out of sync
            raise DataError(f"dataset {base!r} has no loader; report this as a bug")
    emit(on_event, "dataset", name=ds.name, split=split, source=source, count=len(ds))
    return ds


def _reject_test_file(name: str, test_file: str | None) -> None:
    if test_file is not None:
        raise DataError(
            f"test_file {test_file!r} only applies to CIFAR npz folders, not to {name!r}; "
            "leave it out"
        )


def find_test_files(name: str, data_dir: str | Path | None = None) -> list[str]:
    """Test npz file names available for a CIFAR npz folder, the default first ([] if none)."""
    for folder in npz_dirs(name, resolve_data_dir(data_dir)):
        if folder.is_dir():
            found = npz_test_candidates(folder)
            if found:
                return [p.name for p in found]
    return []


# --------------------------------------------------------------------------------------------
# MNIST / Fashion-MNIST

_IDX_NAMES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_TORCHVISION_FOLDER = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST"}


def _idx_dirs(name: str, root: Path) -> list[Path]:
    dirs = [root, root / name, root / name / "raw", root / _TORCHVISION_FOLDER[name] / "raw"]
    if name == "fashion-mnist":
        dirs.append(FASHION_MNIST_SYSTEM_DIR)
    return dirs


def _find_idx(folder: Path, stem: str) -> Path | None:
    for candidate in (folder / stem, folder / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _load_idx_pair(name: str, split: str, images_path: Path, labels_path: Path) -> ArrayDataset:
    images = read_idx(images_path)
    labels = read_idx(labels_path)
    if images.ndim != 3 or images.dtype != np.uint8:
        raise DataError(
            f"{images_path}: expected uint8 images [N, H, W], got {images.dtype} {images.shape}; "
            "replace the file"
        )
    if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
        raise DataError(
            f"{labels_path} holds {labels.shape} labels for {images.shape[0]} images in "
            f"{images_path}; replace the files"
        )
    classes = MNIST_CLASSES if name == "mnist" else FASHION_MNIST_CLASSES
    return dataset_from_arrays(images, labels, classes, name, str(images_path))


def _load_idx_dataset(
    name: str, split: str, root: Path, download: bool, on_event: EventFn
) -> tuple[ArrayDataset, str]:
    img_stem, lbl_stem = _IDX_NAMES[split]
    dirs = _idx_dirs(name, root)
    for folder in dirs:
        images_path, labels_path = _find_idx(folder, img_stem), _find_idx(folder, lbl_stem)
        if images_path is not None and labels_path is not None:
            return _load_idx_pair(name, split, images_path, labels_path), str(folder)
    title = "MNIST" if name == "mnist" else "Fashion-MNIST"
    if not download:
        raise DataError(
            f"{title} {split} files ({img_stem}[.gz], {lbl_stem}[.gz]) not found; looked in: "
            f"{', '.join(map(str, dirs))}; put them in {root / name} or set CAPSCTL_DATA, or "
            "allow downloading"
        )
    dest = root / name
    paths = []
    for stem in (img_stem, lbl_stem):
        fname = f"{stem}.gz"
        remote = Remote(
            tuple(base + fname for base in IDX_MIRRORS[name]), fname, IDX_MD5[name][fname]
        )
        paths.append(download_file(remote, dest, looked_in=dirs, what=title, on_event=on_event))
    return _load_idx_pair(name, split, paths[0], paths[1]), str(dest)


# --------------------------------------------------------------------------------------------
# embedded quickstart subset


def _load_quickstart(split: str) -> tuple[ArrayDataset, str]:
    path = _EMBEDDED / QUICKSTART_FILE
    try:
        with np.load(path, allow_pickle=False) as z:
            images = z[f"{split}_images"]
            labels = z[f"{split}_labels"]
            classes = [str(c) for c in z["classes"]] if "classes" in z.files else None
    except (OSError, KeyError, ValueError) as e:
        raise DataError(
            f"the embedded quickstart data ({QUICKSTART_FILE}) is missing or damaged ({e}); "
            "reinstall capsctl or run scripts/make_quickstart_data.py"
        ) from None
    ds = dataset_from_arrays(
        images,
        labels,
        classes or FASHION_MNIST_CLASSES,
        "fashion-mnist-quickstart",
        f"capsctl/data/embedded/{QUICKSTART_FILE}",
    )
    return ds, f"capsctl/data/embedded/{QUICKSTART_FILE}"
