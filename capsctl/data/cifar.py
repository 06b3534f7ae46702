"""CIFAR-10 and CIFAR-100: python-batch folders, npz folders and the canonical download.

Where they are looked for (``root`` = the data root):
(a) the python-batch folder (``cifar-10-batches-py/`` or ``cifar-100-python/``) at
``root/<folder>``, ``root/<name>/<folder>`` or ``root`` itself when it is that folder;
(b) an npz folder ``root/<name>/`` (or ``root`` itself when it is named ``<name>``) holding
``train.npz`` or ``train-*.npz`` (concatenated in natural sort order) and test files, each
with ``images`` uint8 ``[N, H, W, C]`` and ``labels``; class names from ``classes.txt``;
(c) download of the canonical python tarball into ``root/<name>/`` (md5-checked).
The npz test file is ``test_file`` when given, else the first that exists of
:data:`NPZ_TEST_PREFERENCE` (exact before lossy), else the first other ``test*.npz``.
A test set read from a file other than ``test.npz`` is named ``"<name>[<file stem>]"``,
e.g. ``"cifar10[test-lossless-1k]"``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from capsctl.data.arrays import dataset_from_arrays
from capsctl.data.catalog import CIFAR10_CLASSES, CIFAR100_CLASSES
from capsctl.data.dataset import ArrayDataset
from capsctl.data.download import CIFAR_ARCHIVES, download_file, extract_tar
from capsctl.data.safe_pickle import safe_load
from capsctl.errors import DataError
from capsctl.events import EventFn

__all__ = ["NPZ_TEST_PREFERENCE", "load_cifar", "npz_dirs", "npz_test_candidates"]

NPZ_TEST_PREFERENCE: tuple[str, ...] = ("test.npz", "test-lossless.npz", "test-lossless-1k.npz")
"""Default npz test files, best first: the exact full test set, then exact subsets."""

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


def npz_dirs(name: str, root: Path) -> list[Path]:
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
    images = data.reshape(-1, 3, 32, 32).transpose(
        0, 2, 3, 1
    )  # [N, 3072] -> [N, 3, 32, 32] -> [N, H, W, C]
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
    return dataset_from_arrays(images, labels, classes, name, str(folder))


def _natural_key(s: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def _npz_train_files(folder: Path) -> list[Path]:
    if (folder / "train.npz").is_file():
        return [folder / "train.npz"]
    return sorted(folder.glob("train-*.npz"), key=lambda p: _natural_key(p.name))


def npz_test_candidates(folder: Path) -> list[Path]:
    """All test npz files in ``folder``, in default-preference order."""
    found = {p.name: p for p in folder.glob("test*.npz") if p.is_file()}
    ordered = [found.pop(n) for n in NPZ_TEST_PREFERENCE if n in found]
    ordered += [found[n] for n in sorted(found, key=_natural_key)]
    return ordered


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
                available = ", ".join(p.name for p in npz_test_candidates(folder)) or "none"
                raise DataError(
                    f"test file {fname!r} not found in {folder}; available: {available}"
                )
        else:
            candidates = npz_test_candidates(folder)
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
    return dataset_from_arrays(
        images, labels, _npz_classes(folder, default_classes), ds_name, source
    )


def load_cifar(
    name: str,
    split: str,
    root: Path,
    test_file: str | None,
    download: bool,
    on_event: EventFn,
) -> tuple[ArrayDataset, str]:
    """Split ``split`` of ``name`` (``cifar10``/``cifar100``) and the folder it came from.

    Looked for as the module docstring says; downloaded (``download_file`` and ``extract_tar``
    events) when missing and ``download`` allows it, else a DataError naming where it looked.
    """
    layout = _CIFAR_LAYOUT[name]
    batch_dirs = _batch_dirs(name, root)
    npz_folders = npz_dirs(name, root)
    if test_file is None:
        for folder in batch_dirs:
            if all((folder / f).is_file() for f in layout[split]):
                return _load_cifar_batches(name, split, folder), str(folder)
    for folder in npz_folders:
        if folder.is_dir():
            ds = _load_cifar_npz(name, split, folder, test_file)
            if ds is not None:
                return ds, str(folder)
    looked = [*batch_dirs, *npz_folders]
    if test_file is not None:
        raise DataError(
            f"test_file {test_file!r} needs a {layout['title']} npz folder but none was found; "
            f"looked in: {', '.join(map(str, npz_folders))}"
        )
    if not download:
        how = (
            f"put {layout['folder']}/ (from {CIFAR_ARCHIVES[name].filename}) or an npz folder "
            f"in {root / name} or set CAPSCTL_DATA"
        )
        raise DataError(
            f"{layout['title']} {split} data not found; looked in: "
            f"{', '.join(map(str, looked))}; {how}, or allow downloading"
        )
    folder = _download_batches(name, split, root / name, looked, on_event)
    return _load_cifar_batches(name, split, folder), str(folder)


def _download_batches(
    name: str, split: str, dest: Path, looked: list[Path], on_event: EventFn
) -> Path:
    """Download and extract the canonical tarball into ``dest``; the batch folder."""
    layout = _CIFAR_LAYOUT[name]
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
    return folder
