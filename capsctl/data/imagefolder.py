"""Image-folder datasets: ``imagefolder:<path>`` reads ``<path>/<split>/<class>/<image files>``.

Classes are the union of the class folders of ``train`` and ``test``, sorted, so labels agree
between splits. Every image must have the size of the first; gray and colour images mixed
become RGB.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from capsctl.data.arrays import dataset_from_arrays
from capsctl.data.dataset import ArrayDataset
from capsctl.errors import DataError

__all__ = ["IMAGEFOLDER_SUFFIXES", "load_imagefolder"]

#: File suffixes (lower case) of the images an image folder is searched for.
IMAGEFOLDER_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp"}
_SPLITS = ("train", "test")


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


def load_imagefolder(spec: str, split: str) -> tuple[ArrayDataset, str]:
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
                if p.is_file() and p.suffix.lower() in IMAGEFOLDER_SUFFIXES
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
    return dataset_from_arrays(images, labels, classes, spec, str(folder)), str(folder)
