"""Reading image files for a model: decode any common format and mode, convert, resize, crop.

:func:`load_image` turns one file into what a checkpoint's model takes before normalization:
uint8 ``[C, H, W]`` with ``C`` = the model's channels and ``H = W`` = its input size, plus a
one-line description of what was done, e.g.
``"PNG RGBA 64x48 -> RGB (alpha on black), resized to 32x32 (shorter side, center crop)"``.
:func:`read_image_file` returns only the tensor. :func:`expand_image_paths` turns command-line
arguments (files, folders, glob patterns) into a sorted list of image files.

Steps of :func:`load_image`:

1. decode with Pillow (PNG, JPEG, BMP, GIF, WebP, TIFF, PNM, ...; the first frame of an
   animation), rotated upright when the file carries an EXIF orientation;
2. bring every mode to 8-bit gray or RGB, with or without alpha: palette images through their
   palette, 1-bit to gray, 16-bit and 32-bit integer gray scaled by 1/257 (65535 -> 255),
   float gray scaled from [0, 1] (or clipped to [0, 255]), CMYK/YCbCr/LAB/HSV to RGB;
3. composite alpha on black (``value * alpha / 255``): transparent pixels become 0;
4. convert to the model's channels: gray -> RGB repeats the channel; RGB -> gray is the
   ITU-R BT.601 luma ``0.299 R + 0.587 G + 0.114 B`` (rounded);
5. when the image is not ``size x size``: scale so that the shorter side is ``size`` (bilinear,
   antialiased, aspect kept; skipped when the shorter side already is ``size``), then cut the
   central ``size x size`` square.
"""

from __future__ import annotations

import glob
import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from capsctl.errors import DataError, UsageError

__all__ = [
    "IMAGE_SUFFIXES",
    "LoadedImage",
    "UnreadableImageError",
    "channel_name",
    "describe_preprocessing",
    "expand_image_paths",
    "fit_to_size",
    "load_image",
    "read_image_file",
]

#: File suffixes (lower case) that folders and glob patterns are searched for.
IMAGE_SUFFIXES = (
    ".png",
    ".jpg",
    ".jpeg",
    ".jpe",
    ".jfif",
    ".bmp",
    ".gif",
    ".webp",
    ".tif",
    ".tiff",
    ".pgm",
    ".ppm",
    ".pbm",
    ".pnm",
)

# Friendly names of Pillow modes for descriptions.
_MODE_NAMES = {
    "1": "1-bit",
    "L": "gray",
    "LA": "gray+alpha",
    "La": "gray+alpha",
    "P": "palette",
    "PA": "palette+alpha",
    "I": "32-bit gray",
    "I;16": "16-bit gray",
    "I;16L": "16-bit gray",
    "I;16B": "16-bit gray",
    "I;16N": "16-bit gray",
    "F": "float gray",
    "RGBa": "RGBA",
}
# ITU-R BT.601 luma weights (R, G, B).
_LUMA = (0.299, 0.587, 0.114)
_EXIF_ORIENTATION = 0x0112
_GLOB_CHARS = frozenset("*?[")


class UnreadableImageError(DataError):
    """A file that Pillow cannot decode; ``path`` and ``reason`` for messages of callers."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}; pass a PNG, JPEG or other image file")
        self.path = path
        self.reason = reason


@dataclass(frozen=True)
class LoadedImage:
    """One image file ready for a model (before normalization)."""

    pixels: Tensor  # uint8 [C, H, W]
    description: str  # e.g. "PNG RGBA 64x48 -> RGB (alpha on black), resized to 32x32 (...)"
    warnings: tuple[str, ...] = ()  # what the decoder warned about, one line each


def channel_name(channels: int) -> str:
    """``gray`` for 1 channel, ``RGB`` for 3."""
    return {1: "gray", 3: "RGB"}.get(channels, f"{channels}-channel")


def describe_preprocessing(channels: int, size: int) -> str:
    """What :func:`load_image` does for a model with ``channels`` and input ``size``."""
    return (
        f"{channel_name(channels)}, shorter side resized to {size} (antialiased), "
        f"center crop {size}x{size}"
    )


def read_image_file(path: str | os.PathLike[str], channels: int, size: int) -> Tensor:
    """The uint8 ``[channels, size, size]`` tensor of :func:`load_image`."""
    return load_image(path, channels, size).pixels


def load_image(path: str | os.PathLike[str], channels: int, size: int) -> LoadedImage:
    """Decode ``path`` and make it ``channels x size x size`` (see the module docstring).

    Raises :class:`~capsctl.errors.UsageError` when the file does not exist and
    :class:`~capsctl.errors.DataError` naming the file when it is not a regular file (a named
    pipe would block) or cannot be decoded. Warnings of the decoder (such as Pillow's
    ``DecompressionBombWarning``) are not shown; they are returned as one-line ``warnings``.
    """
    path = Path(path)
    if channels not in (1, 3):
        raise DataError(f"{path}: cannot make {channels}-channel images; models take 1 or 3")
    if size < 1:
        raise DataError(f"{path}: input size must be >= 1, got {size}")
    if not path.exists():
        raise UsageError(f"{path}: no such image file")
    if path.is_dir():
        raise DataError(f"{path} is a folder, not an image file")
    if not path.is_file():  # reading a named pipe would wait for a writer forever
        raise DataError(
            f"{path} is not a regular file (a named pipe, socket or device); pass an image file"
        )
    array, source, steps, notes = _decode(path)  # uint8 [H, W, c], c in 1..4
    array, step = _to_channels(array, channels)
    if step:
        steps.append(step)
    pixels = torch.from_numpy(array.transpose(2, 0, 1).copy())  # [C, H, W]
    pixels, step = fit_to_size(pixels, size)
    if step:
        steps.append(step)
    text = f"{source} -> {', '.join(steps)}" if steps else f"{source}, used as is"
    return LoadedImage(pixels, text, notes)


def fit_to_size(pixels: Tensor, size: int) -> tuple[Tensor, str]:
    """uint8 ``[C, H, W]`` -> ``[C, size, size]``: shorter side to ``size``, center crop.

    The resize is bilinear with antialiasing (so shrinking averages over each output pixel's
    footprint instead of skipping pixels), rounded back to uint8. Returns the image and a
    description of what was done (empty when nothing was).
    """
    c, h, w = pixels.shape
    if (h, w) == (size, size):
        return pixels, ""
    resized = min(h, w) != size
    if resized:
        # Shorter side -> size; the longer side keeps the aspect ratio (at least size).
        nh = size if h <= w else max(size, round(h * size / w))
        nw = size if w <= h else max(size, round(w * size / h))
        x = pixels.to(torch.float32).unsqueeze(0)  # [1, C, H, W]
        x = torch.nn.functional.interpolate(
            x, size=(nh, nw), mode="bilinear", antialias=True, align_corners=False
        )  # [1, C, nh, nw]
        pixels = x.squeeze(0).round_().clamp_(0, 255).to(torch.uint8)  # [C, nh, nw]
        h, w = nh, nw
    top, left = (h - size) // 2, (w - size) // 2
    pixels = pixels[:, top : top + size, left : left + size].contiguous()  # [C, size, size]
    if resized:
        return pixels, f"resized to {size}x{size} (shorter side, center crop)"
    return pixels, f"center-cropped to {size}x{size}"


def _warning_text(w: warnings.WarningMessage) -> str:
    """A decoder's warning as one line: Pillow's bomb check in words, others as they are."""
    from PIL import Image

    if issubclass(w.category, Image.DecompressionBombWarning):
        return f"very large image, decoded anyway (Pillow: {' '.join(str(w.message).split())})"
    return " ".join(str(w.message).split())


def _decode(path: Path) -> tuple[np.ndarray, str, list[str], tuple[str, ...]]:
    """``(uint8 [H, W, c] with c = 1 gray, 2 gray+alpha, 3 RGB or 4 RGBA, source, steps,
    the decoder's warnings)``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        array, source, steps = _decode_quietly(path)
    notes = tuple(dict.fromkeys(_warning_text(w) for w in caught))
    return array, source, steps, notes


def _decode_quietly(path: Path) -> tuple[np.ndarray, str, list[str]]:
    from PIL import Image, ImageOps

    steps: list[str] = []
    try:
        with Image.open(path) as im:
            fmt = im.format or path.suffix.lstrip(".").upper() or "image"
            mode = im.mode
            width, height = im.size
            frames = int(getattr(im, "n_frames", 1) or 1)
            im.load()
            orientation = im.getexif().get(_EXIF_ORIENTATION, 1)
            if orientation in range(2, 9):
                im = ImageOps.exif_transpose(im)
                steps.append("rotated upright (EXIF)")
            array, note = _to_array(im)
    except DataError:
        raise
    except Exception as e:  # Pillow raises many types (OSError, ValueError, SyntaxError, ...)
        reason = " ".join(str(e).split())[:100] or type(e).__name__
        raise UnreadableImageError(path, f"cannot read this image: {reason}") from None
    if frames > 1:
        steps.insert(0, f"first of {frames} frames")
    if note:
        steps.append(note)
    source = f"{fmt} {_MODE_NAMES.get(mode, mode)} {width}x{height}"
    return array, source, steps


def _to_array(im: Any) -> tuple[np.ndarray, str]:
    """A decoded Pillow image -> uint8 ``[H, W, c]`` (c = 1..4) and a note on bit depth."""
    mode = im.mode
    if mode in ("I", "F") or mode.startswith("I;16"):
        wide = np.asarray(im, dtype=np.float64)  # [H, W]
        if mode == "F":
            numbers = wide[~np.isnan(wide)]  # an all-NaN image has none (and is black)
            scale = 255.0 if numbers.size and float(numbers.max()) <= 1.0 else 1.0
            gray = np.nan_to_num(wide) * scale
            note = "8-bit gray"
        else:
            gray = np.clip(wide, 0, 65535) / 257.0  # 65535 -> 255
            note = "8-bit gray (value / 257)"
        return np.rint(np.clip(gray, 0, 255)).astype(np.uint8)[..., None], note
    if mode in ("P", "PA"):
        # Through the palette; RGBA keeps a transparent palette entry transparent.
        has_alpha = mode == "PA" or "transparency" in im.info
        im = im.convert("RGBA" if has_alpha else "RGB")
    elif mode == "1":
        im = im.convert("L")
    elif mode == "La":
        im = im.convert("LA")
    elif mode == "RGBa":
        im = im.convert("RGBA")
    elif mode not in ("L", "LA", "RGB", "RGBA"):
        im = im.convert("RGB")  # CMYK, YCbCr, LAB, HSV, RGBX, ...
    array = np.asarray(im, dtype=np.uint8)
    if array.ndim == 2:
        array = array[..., None]  # [H, W, 1]
    return array, ""


def _to_channels(array: np.ndarray, channels: int) -> tuple[np.ndarray, str]:
    """uint8 ``[H, W, c]`` (c = 1..4) -> ``[H, W, channels]``; alpha composited on black."""
    c = array.shape[2]
    note = ""
    if c in (2, 4):
        color = array[..., : c - 1].astype(np.float64)  # [H, W, c-1]
        alpha = array[..., c - 1 :].astype(np.float64) / 255.0  # [H, W, 1]
        array = np.rint(color * alpha).astype(np.uint8)
        note = " (alpha on black)"
        c -= 1
    if c == channels:
        return array, f"{channel_name(channels)}{note}" if note else ""
    if channels == 3:  # gray -> RGB
        return np.repeat(array, 3, axis=2), f"RGB{note}"  # [H, W, 3]
    luma = array.astype(np.float64) @ np.array(_LUMA)  # [H, W]
    return np.rint(np.clip(luma, 0, 255)).astype(np.uint8)[..., None], f"gray{note}"


# --------------------------------------------------------------------------------------------
# Command-line arguments -> files


def _is_image_name(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_SUFFIXES and not path.name.startswith(".")


def expand_image_paths(
    items: Iterable[str | os.PathLike[str]],
) -> tuple[list[Path], list[tuple[str, str]]]:
    """Files, folders and glob patterns -> image files, and the arguments that matched nothing.

    A file is taken as given (whatever its suffix). A folder gives its image files (by suffix,
    :data:`IMAGE_SUFFIXES`, case-insensitive; hidden files skipped; not recursive), sorted by
    name. An argument that does not exist and holds ``*``, ``?`` or ``[`` is a glob pattern
    (``**`` recurses), expanded to image files, sorted. A file named twice is kept once, at
    its first place. Returns ``(files, unmatched)``: ``unmatched`` holds ``(argument, reason)``
    for each argument that gave no file (missing path, folder without images, pattern without
    matches).
    """
    files: list[Path] = []
    unmatched: list[tuple[str, str]] = []
    seen: set[str] = set()

    def add(found: Sequence[Path]) -> None:
        for p in found:
            key = os.path.normcase(os.path.abspath(p))
            if key not in seen:
                seen.add(key)
                files.append(p)

    suffixes = ", ".join(IMAGE_SUFFIXES[:3]) + ", ..."
    for item in items:
        text = os.fspath(item)
        path = Path(text).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if _is_image_name(p) and p.is_file())
            if not found:
                unmatched.append((str(path), f"folder holds no image files ({suffixes})"))
            add(found)
        elif path.exists():
            add([path])
        elif _GLOB_CHARS & set(text):
            pattern = os.path.expanduser(text)
            found = sorted(
                Path(p)
                for p in glob.glob(pattern, recursive=True)
                if _is_image_name(Path(p)) and Path(p).is_file()
            )
            if not found:
                unmatched.append((text, f"pattern matches no image files ({suffixes})"))
            add(found)
        else:
            unmatched.append((str(path), "no such file or folder"))
    return files, unmatched
