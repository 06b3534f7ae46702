"""Finding, downloading and decoding datasets into :class:`ArrayDataset`.

Where data is looked for (``root`` = :func:`resolve_data_dir`):

- ``cifar10`` / ``cifar100``, in order:
  (a) the python-batch folder (``cifar-10-batches-py/`` or ``cifar-100-python/``) at
  ``root/<folder>``, ``root/<name>/<folder>`` or ``root`` itself when it is that folder;
  (b) an npz folder ``root/<name>/`` (or ``root`` itself when it is named ``<name>``) holding
  ``train.npz`` or ``train-*.npz`` (concatenated in natural sort order) and test files, each
  with ``images`` uint8 ``[N, H, W, C]`` and ``labels``; class names from ``classes.txt``;
  (c) download of the canonical python tarball into ``root/<name>/`` (md5-checked).
  The npz test file is ``test_file`` when given, else the first that exists of
  :data:`NPZ_TEST_PREFERENCE` (exact before lossy), else the first other ``test*.npz``.
  A test set read from a file other than ``test.npz`` is named ``"<name>[<file stem>]"``,
  e.g. ``"cifar10[test-lossless-1k]"``; that name can be passed back to :func:`load_dataset`.
- ``mnist`` / ``fashion-mnist``: the IDX files (``.gz`` or plain) in ``root``,
  ``root/<name>``, ``root/<name>/raw``, torchvision's ``root/MNIST/raw`` /
  ``root/FashionMNIST/raw`` and, for Fashion-MNIST, ``/usr/share/datasets/fashion-mnist``;
  else downloaded from the canonical mirrors into ``root/<name>/``.
- ``diverse-multimnist``: composed from the MNIST split found as above
  (:mod:`capsctl.data.multimnist`); the result remembers its source digits, so that
  :func:`~capsctl.data.split_train_val` holds out MNIST digits, not composites.
- ``fashion-mnist-quickstart``: the subset shipped inside the package (no files needed).
- ``imagefolder:<path>``: ``<path>/<split>/<class>/*.png|jpg|jpeg|bmp|gif|webp``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch

from capsctl.data.catalog import (
    CIFAR10_CLASSES,
    CIFAR100_CLASSES,
    FASHION_MNIST_CLASSES,
    MNIST_CLASSES,
    dataset_info,
)
from capsctl.data.dataset import ArrayDataset
from capsctl.data.download import (
    CIFAR_ARCHIVES,
    IDX_MD5,
    IDX_MIRRORS,
    Remote,
    download_file,
    extract_tar,
)
from capsctl.data.idx import read_idx
from capsctl.data.safe_pickle import safe_load
from capsctl.errors import DataError

__all__ = [
    "FASHION_MNIST_SYSTEM_DIR",
    "NPZ_TEST_PREFERENCE",
    "QUICKSTART_FILE",
    "find_test_files",
    "load_dataset",
    "resolve_data_dir",
]

EventCallback = Callable[[dict[str, Any]], None]

FASHION_MNIST_SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")
"""Where Debian's ``dataset-fashion-mnist`` package installs the IDX files."""

NPZ_TEST_PREFERENCE: tuple[str, ...] = ("test.npz", "test-lossless.npz", "test-lossless-1k.npz")
"""Default npz test files, best first: the exact full test set, then exact subsets."""

QUICKSTART_FILE = "fashion-mnist-quickstart.npz"
"""File name of the embedded quickstart subset in ``capsctl/data/embedded/``."""

_SPLITS = ("train", "test")
_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp"}


# --------------------------------------------------------------------------------------------
# data dir


def resolve_data_dir(data_dir: str | Path | None) -> Path:
    """The data root: ``data_dir`` if given, else ``$CAPSCTL_DATA``, else the user cache.

    The cache is ``$XDG_CACHE_HOME/capsctl/data`` (``~/.cache/capsctl/data`` when
    ``XDG_CACHE_HOME`` is unset or not absolute). ``~`` is expanded; nothing is created.
    """
    if data_dir is not None and str(data_dir) != "":
        return Path(data_dir).expanduser()
    env = os.environ.get("CAPSCTL_DATA", "")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    cache = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return cache / "capsctl" / "data"


# --------------------------------------------------------------------------------------------
# entry point


def load_dataset(
    name: str,
    split: str,
    data_dir: str | Path | None = None,
    *,
    test_file: str | None = None,
    download: bool = True,
    on_event: EventCallback | None = None,
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
        ds, source = _load_imagefolder(base, split)
    else:
        dataset_info(base)  # DataError for unknown names
        root = resolve_data_dir(data_dir)
        if base in ("cifar10", "cifar100"):
            ds, source = _load_cifar(base, split, root, test_file, download, on_event)
        elif base in ("mnist", "fashion-mnist"):
            _reject_test_file(base, test_file)
            ds, source = _load_idx_dataset(base, split, root, download, on_event)
        elif base == "diverse-multimnist":
            _reject_test_file(base, test_file)
            from capsctl.data.multimnist import SEEDS, diverse_multimnist

            mnist, source = _load_idx_dataset("mnist", split, root, download, on_event)
            ds = diverse_multimnist(mnist, seed=SEEDS[split], name="diverse-multimnist")
            source = f"generated from MNIST in {source}"
        elif base == "fashion-mnist-quickstart":
            _reject_test_file(base, test_file)
            ds, source = _load_quickstart(split)
        else:  # pragma: no cover - catalog and loaders out of sync
            raise DataError(f"dataset {base!r} has no loader; report this as a bug")
    if on_event:
        on_event(
            {
                "event": "dataset",
                "name": ds.name,
                "split": split,
                "source": source,
                "count": len(ds),
            }
        )
    return ds


def _reject_test_file(name: str, test_file: str | None) -> None:
    if test_file is not None:
        raise DataError(
            f"test_file {test_file!r} only applies to CIFAR npz folders, not to {name!r}; "
            "leave it out"
        )


def _to_dataset(
    images_nhwc: np.ndarray, labels: np.ndarray, classes: list[str], name: str, source: str
) -> ArrayDataset:
    """Build an ArrayDataset from uint8 ``[N,H,W]``/``[N,H,W,C]`` images and integer labels."""
    if images_nhwc.dtype != np.uint8:
        raise DataError(f"{source}: images are {images_nhwc.dtype}, expected uint8; fix the file")
    if images_nhwc.ndim == 3:
        images_nhwc = images_nhwc[..., None]
    if images_nhwc.ndim != 4:
        raise DataError(
            f"{source}: images have shape {images_nhwc.shape}, expected [N, H, W, C]; fix the file"
        )
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.shape[0] != images_nhwc.shape[0]:
        raise DataError(
            f"{source}: {images_nhwc.shape[0]} images but labels of shape {labels.shape}; "
            "fix the file"
        )
    if not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"{source}: labels are {labels.dtype}, expected integers; fix the file")
    labels64 = labels.astype(np.int64)
    if labels64.size and (labels64.min() < 0 or labels64.max() >= len(classes)):
        raise DataError(
            f"{source}: labels range {labels64.min()}..{labels64.max()} but there are "
            f"{len(classes)} classes; fix the labels or the class list"
        )
    images = torch.from_numpy(np.ascontiguousarray(images_nhwc)).permute(0, 3, 1, 2).contiguous()
    return ArrayDataset(images, torch.from_numpy(labels64), list(classes), name)


# --------------------------------------------------------------------------------------------
# CIFAR

_CIFAR_LAYOUT: dict[str, dict[str, Any]] = {
    "cifar10": {
        "folder": "cifar-10-batches-py",
        "train": [f"data_batch_{i}" for i in range(1, 6)],
        "test": ["test_batch"],
        "meta": "batches.meta",
        "label_key": "labels",
        "names_key": "label_names",
        "classes": CIFAR10_CLASSES,
        "title": "CIFAR-10",
    },
    "cifar100": {
        "folder": "cifar-100-python",
        "train": ["train"],
        "test": ["test"],
        "meta": "meta",
        "label_key": "fine_labels",
        "names_key": "fine_label_names",
        "classes": CIFAR100_CLASSES,
        "title": "CIFAR-100",
    },
}


def _str_keys(obj: Any, source: Path) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise DataError(
            f"{source} holds a {type(obj).__name__}, not a CIFAR batch dict; "
            "delete it and download the dataset again"
        )
    return {(k.decode("latin1") if isinstance(k, bytes) else str(k)): v for k, v in obj.items()}


def _batch_dirs(name: str, root: Path) -> list[Path]:
    folder = _CIFAR_LAYOUT[name]["folder"]
    dirs = [root / folder, root / name / folder]
    if root.name == folder:
        dirs.insert(0, root)
    return dirs


def _npz_dirs(name: str, root: Path) -> list[Path]:
    return [root, root / name] if root.name == name else [root / name]


def _read_cifar_batch(path: Path, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    d = _str_keys(safe_load(path), path)
    data, labels = d.get("data"), d.get(label_key)
    if not isinstance(data, np.ndarray) or labels is None:
        raise DataError(
            f"{path} lacks 'data' or '{label_key}'; delete it and download the dataset again"
        )
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise DataError(
            f"{path}: 'data' is {data.dtype} {data.shape}, expected uint8 [N, 3072]; delete it "
            "and download the dataset again"
        )
    try:
        labels_arr = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError):
        raise DataError(f"{path}: '{label_key}' is not a list of integers; delete it") from None
    images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # -> NHWC for _to_dataset
    return images, labels_arr


def _load_cifar_batches(name: str, split: str, folder: Path) -> ArrayDataset:
    layout = _CIFAR_LAYOUT[name]
    parts = [_read_cifar_batch(folder / f, layout["label_key"]) for f in layout[split]]
    images = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    classes: list[str] = list(layout["classes"])
    meta_path = folder / layout["meta"]
    if meta_path.is_file():
        meta = _str_keys(safe_load(meta_path), meta_path)
        names = meta.get(layout["names_key"])
        if isinstance(names, list) and names:
            classes = [n.decode("latin1") if isinstance(n, bytes) else str(n) for n in names]
    return _to_dataset(images, labels, classes, name, str(folder))


def _natural_key(s: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def _npz_train_files(folder: Path) -> list[Path]:
    if (folder / "train.npz").is_file():
        return [folder / "train.npz"]
    return sorted(folder.glob("train-*.npz"), key=lambda p: _natural_key(p.name))


def _npz_test_candidates(folder: Path) -> list[Path]:
    """All test npz files in ``folder``, in default-preference order."""
    found = {p.name: p for p in folder.glob("test*.npz") if p.is_file()}
    ordered = [found.pop(n) for n in NPZ_TEST_PREFERENCE if n in found]
    ordered += [found[n] for n in sorted(found, key=_natural_key)]
    return ordered


def find_test_files(name: str, data_dir: str | Path | None = None) -> list[str]:
    """Test npz file names available for a CIFAR npz folder, the default first ([] if none)."""
    for folder in _npz_dirs(name, resolve_data_dir(data_dir)):
        if folder.is_dir():
            found = _npz_test_candidates(folder)
            if found:
                return [p.name for p in found]
    return []


def _read_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as z:
            if "images" not in z.files or "labels" not in z.files:
                raise DataError(
                    f"{path} lacks an 'images' or 'labels' array (has {z.files}); fix the file"
                )
            return z["images"], z["labels"]
    except DataError:
        raise
    except Exception as e:  # zipfile.BadZipFile, ValueError (pickled object arrays), OSError
        raise DataError(f"cannot read {path} ({type(e).__name__}: {e}); replace the file") from None


def _npz_classes(folder: Path, default: list[str]) -> list[str]:
    path = folder / "classes.txt"
    if not path.is_file():
        return list(default)
    names = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [n for n in names if n]


def _load_cifar_npz(
    name: str, split: str, folder: Path, test_file: str | None
) -> ArrayDataset | None:
    """Load from an npz folder, or None if the folder holds no files for this split."""
    default_classes: list[str] = _CIFAR_LAYOUT[name]["classes"]
    if split == "train":
        files = _npz_train_files(folder)
        if not files:
            return None
        ds_name = name
    else:
        if test_file is not None:
            fname = test_file if test_file.endswith(".npz") else f"{test_file}.npz"
            path = folder / fname
            if Path(fname).name != fname or not path.is_file():
                available = ", ".join(p.name for p in _npz_test_candidates(folder)) or "none"
                raise DataError(
                    f"test file {fname!r} not found in {folder}; available: {available}"
                )
        else:
            candidates = _npz_test_candidates(folder)
            if not candidates:
                return None
            path = candidates[0]
        files = [path]
        ds_name = name if path.name == "test.npz" else f"{name}[{path.stem}]"
    parts = [_read_npz(p) for p in files]
    for p, (images, _) in zip(files, parts, strict=True):
        if images.ndim != 4 or images.dtype != np.uint8:
            raise DataError(
                f"{p}: images are {images.dtype} {images.shape}, expected uint8 [N, H, W, C]; "
                "fix the file"
            )
    images = parts[0][0] if len(parts) == 1 else np.concatenate([p[0] for p in parts])
    labels = parts[0][1] if len(parts) == 1 else np.concatenate([p[1] for p in parts])
    source = str(files[0]) if len(files) == 1 else f"{folder}/{{{','.join(f.name for f in files)}}}"
    return _to_dataset(images, labels, _npz_classes(folder, default_classes), ds_name, source)


def _load_cifar(
    name: str,
    split: str,
    root: Path,
    test_file: str | None,
    download: bool,
    on_event: EventCallback | None,
) -> tuple[ArrayDataset, str]:
    layout = _CIFAR_LAYOUT[name]
    batch_dirs = _batch_dirs(name, root)
    npz_dirs = _npz_dirs(name, root)
    if test_file is None:
        for folder in batch_dirs:
            if all((folder / f).is_file() for f in layout[split]):
                return _load_cifar_batches(name, split, folder), str(folder)
    for folder in npz_dirs:
        if folder.is_dir():
            ds = _load_cifar_npz(name, split, folder, test_file)
            if ds is not None:
                return ds, str(folder)
    looked = [*batch_dirs, *npz_dirs]
    if test_file is not None:
        raise DataError(
            f"test_file {test_file!r} needs a {layout['title']} npz folder but none was found; "
            f"looked in: {', '.join(map(str, npz_dirs))}"
        )
    how = (
        f"put {layout['folder']}/ (from {CIFAR_ARCHIVES[name].filename}) or an npz folder "
        f"in {root / name} or set CAPSCTL_DATA"
    )
    if not download:
        raise DataError(
            f"{layout['title']} {split} data not found; looked in: "
            f"{', '.join(map(str, looked))}; {how}, or allow downloading"
        )
    dest = root / name
    archive = download_file(
        CIFAR_ARCHIVES[name], dest, looked_in=looked, what=layout["title"], on_event=on_event
    )
    extract_tar(archive, dest, on_event=on_event)
    archive.unlink(missing_ok=True)
    folder = dest / layout["folder"]
    if not all((folder / f).is_file() for f in layout[split]):
        raise DataError(
            f"the downloaded {archive.name} did not contain {layout['folder']}/ with "
            f"{', '.join(layout[split])}; delete {dest} and try again"
        )
    return _load_cifar_batches(name, split, folder), str(folder)


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
    return _to_dataset(images, labels, classes, name, str(images_path))


def _load_idx_dataset(
    name: str, split: str, root: Path, download: bool, on_event: EventCallback | None
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
    resource = resources.files("capsctl.data").joinpath("embedded", QUICKSTART_FILE)
    try:
        with resources.as_file(resource) as path, np.load(path, allow_pickle=False) as z:
            images = z[f"{split}_images"]
            labels = z[f"{split}_labels"]
            classes = [str(c) for c in z["classes"]] if "classes" in z.files else None
    except (OSError, KeyError, ValueError) as e:
        raise DataError(
            f"the embedded quickstart data ({QUICKSTART_FILE}) is missing or damaged ({e}); "
            "reinstall capsctl or run scripts/make_quickstart_data.py"
        ) from None
    ds = _to_dataset(
        images,
        labels,
        classes or FASHION_MNIST_CLASSES,
        "fashion-mnist-quickstart",
        f"capsctl/data/embedded/{QUICKSTART_FILE}",
    )
    return ds, f"capsctl/data/embedded/{QUICKSTART_FILE}"


# --------------------------------------------------------------------------------------------
# image folders


def _read_image(path: Path) -> np.ndarray:
    """Decode an image to uint8 ``[H, W]`` (grayscale) or ``[H, W, 3]`` (RGB)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im.load()
            if im.mode in ("1", "L", "LA", "I", "I;16", "F"):
                im = im.convert("L")
            elif im.mode != "RGB":
                im = im.convert("RGB")
            return np.asarray(im, dtype=np.uint8).copy()
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise DataError(f"cannot read image {path} ({e}); fix or remove the file") from None


def _class_dirs(folder: Path) -> list[str]:
    return [d.name for d in folder.iterdir() if d.is_dir() and not d.name.startswith(".")]


def _load_imagefolder(spec: str, split: str) -> tuple[ArrayDataset, str]:
    root = Path(spec.split(":", 1)[1]).expanduser()
    folder = root / split
    if not folder.is_dir():
        raise DataError(
            f"image folder {folder} not found; expected {root}/{split}/<class>/<image files>"
        )
    # Classes: union over the train and test folders, sorted, so labels agree between splits.
    names: set[str] = set()
    for s in _SPLITS:
        if (root / s).is_dir():
            names.update(_class_dirs(root / s))
    classes = sorted(names)
    files: list[tuple[Path, int]] = []
    for label, cls in enumerate(classes):
        cdir = folder / cls
        if cdir.is_dir():
            files += [
                (p, label)
                for p in sorted(cdir.iterdir())
                if p.is_file() and p.suffix.lower() in _IMAGE_SUFFIXES
            ]
    if not files:
        raise DataError(
            f"no images (*.png, *.jpg, ...) in {folder}/<class>/; expected "
            f"{root}/{split}/<class>/<image files>"
        )
    arrays: list[np.ndarray] = []
    first_shape: tuple[int, int] | None = None
    for path, _ in files:
        arr = _read_image(path)
        if first_shape is None:
            first_shape = (arr.shape[0], arr.shape[1])
        elif (arr.shape[0], arr.shape[1]) != first_shape:
            raise DataError(
                f"image {path} is {arr.shape[1]}x{arr.shape[0]} but {files[0][0]} is "
                f"{first_shape[1]}x{first_shape[0]}; resize all images to one size"
            )
        arrays.append(arr)
    if any(a.ndim == 3 for a in arrays):  # mixed or colour: everything becomes RGB
        arrays = [a if a.ndim == 3 else np.repeat(a[..., None], 3, axis=2) for a in arrays]
    images = np.stack(arrays)
    labels = np.array([label for _, label in files], dtype=np.int64)
    return _to_dataset(images, labels, classes, spec, str(folder)), str(folder)
