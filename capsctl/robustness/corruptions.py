"""The 15 corruptions x 5 severities of CIFAR-10-C, generated locally and seeded.

Constants: the per-severity parameter tables for 32x32 images of Hendrycks and Dietterich,
"Benchmarking Neural Network Robustness to Common Corruptions and Perturbations", ICLR 2019,
from their ``make_cifar_c.py`` (cited in :data:`SEVERITIES`); the transforms are written here
with numpy, scipy and Pillow (:mod:`capsctl.robustness.filters`). Two of them cannot be made
faithfully without what the original used, and are close substitutes named with a star:

- ``motion_blur*`` and ``snow*`` (whose snow layer is motion-blurred): ImageMagick's motion
  blur (through Wand) is replaced by a one-sided Gaussian-weighted line kernel with the same
  radius, sigma and random angle;
- ``frost*``: the six frost photographs blended in are replaced by a generated frost texture,
  blended with the original weights.

Everything else follows the original: the noises, defocus/glass/zoom blur, fog (plasma
fractal), brightness (value channel of HSV), contrast, elastic transform, pixelate (Pillow box
resampling) and JPEG (Pillow, the given quality). In glass blur the published code's numpy
"swap" of two pixels copies the neighbour into the pixel (numpy row views), and so does this
one. Other image sizes use the same constants (elastic's scale with the side, as there);
grayscale images are corrupted as gray RGB and averaged back to one channel.

Randomness: one ``numpy.random.Generator`` per (seed, corruption, severity), drawn image after
image, so the first N images of a set are the same whatever N.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import numpy as np
from PIL import Image
from scipy import ndimage

from capsctl.robustness.filters import (
    affine_matrix,
    affine_warp,
    clipped_zoom,
    disk_kernel,
    frost_texture,
    motion_blur,
    plasma_fractal,
)

__all__ = ["CORRUPTIONS", "SEVERITIES", "SUBSTITUTES", "corrupt", "corrupt_images"]

#: make_cifar_c.py's constants for 32x32 images, severity 1..5, per corruption.
SEVERITIES: dict[str, list] = {
    "gaussian_noise": [0.04, 0.06, 0.08, 0.09, 0.10],  # noise std
    "shot_noise": [500, 250, 100, 75, 50],  # photons per unit intensity
    "impulse_noise": [0.01, 0.02, 0.03, 0.05, 0.07],  # salt-and-pepper share
    "defocus_blur": [(0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (1, 0.2), (1.5, 0.1)],  # radius, alias
    "glass_blur": [(0.05, 1, 1), (0.25, 1, 1), (0.4, 1, 1), (0.25, 1, 2), (0.4, 1, 2)],
    "motion_blur": [(6, 1), (6, 1.5), (6, 2), (8, 2), (9, 2.5)],  # radius, sigma
    "zoom_blur": [1.06, 1.11, 1.16, 1.21, 1.26],  # zooms 1, 1.01, ... below this bound
    "snow": [
        (0.1, 0.2, 1, 0.6, 8, 3, 0.95),
        (0.1, 0.2, 1, 0.5, 10, 4, 0.9),
        (0.15, 0.3, 1.75, 0.55, 10, 4, 0.9),
        (0.25, 0.3, 2.25, 0.6, 12, 6, 0.85),
        (0.3, 0.3, 1.25, 0.65, 14, 12, 0.8),
    ],  # loc, scale, zoom, threshold, blur radius, blur sigma, image weight
    "frost": [(1, 0.2), (1, 0.3), (0.9, 0.4), (0.85, 0.4), (0.75, 0.45)],  # image, frost
    "fog": [(0.2, 3), (0.5, 3), (0.75, 2.5), (1, 2), (1.5, 1.75)],  # amount, wibble decay
    "brightness": [0.05, 0.1, 0.15, 0.2, 0.3],  # added to HSV value
    "contrast": [0.75, 0.5, 0.4, 0.3, 0.15],  # factor about the channel means
    "elastic_transform": [
        (0, 0, 0.08),
        (0.05, 0.2, 0.07),
        (0.08, 0.06, 0.06),
        (0.1, 0.04, 0.05),
        (0.1, 0.03, 0.03),
    ],  # x side: displacement, smoothing sigma, affine jitter
    "pixelate": [0.95, 0.9, 0.85, 0.75, 0.65],  # downscale factor
    "jpeg_compression": [80, 65, 58, 50, 40],  # quality
}

#: Corruptions reproduced by a documented substitute (shown with a star).
SUBSTITUTES = frozenset({"motion_blur", "snow", "frost"})

Rng = np.random.Generator
Fn = Callable[[np.ndarray, Rng, object], np.ndarray]


def _gaussian_noise(x: np.ndarray, rng: Rng, c: object) -> np.ndarray:
    return x + rng.normal(size=x.shape, scale=float(c))  # type: ignore[arg-type]


def _shot_noise(x: np.ndarray, rng: Rng, c: object) -> np.ndarray:
    return rng.poisson(x * float(c)) / float(c)  # type: ignore[arg-type]


def _impulse_noise(x: np.ndarray, rng: Rng, c: object) -> np.ndarray:
    hit = rng.random(x.shape) < float(c)  # type: ignore[arg-type]
    salt = rng.random(x.shape) < 0.5
    return np.where(hit, salt.astype(np.float64), x)


def _defocus_blur(x: np.ndarray, rng: Rng, c: object) -> np.ndarray:
    radius, alias = c  # type: ignore[misc]
    kernel = disk_kernel(radius, alias)
    return np.stack([ndimage.correlate(x[..., k], kernel, mode="mirror") for k in range(3)], -1)


def _glass_blur(x: np.ndarray, rng: Rng, c: object) -> np.ndarray:
    sigma, delta, iterations = c  # type: ignore[misc]
    img = np.uint8(ndimage.gaussian_filter(x, (sigma, sigma, 0), mode="nearest") * 255)
    h, w = img.shape[:2]
    rows, cols = range(h - delta, delta, -1), range(w - delta, delta, -1)
    moves = rng.integers(-delta, delta, size=(iterations, len(rows), len(cols), 2))
    for it in range(iterations):
        for i, r in enumerate(rows):
            for j, col in enumerate(cols):
                dx, dy = moves[it, i, j]
                img[r, col] = img[r + dy, col + dx]
    return ndimage.gaussian_filter(img / 255.0, (sigma, sigma, 0), mode="nearest")


def _motion_blur(x: np.ndarray, rng: Rng, c: object) -> np.ndarray:
    radius, sigma = c  # type: ignore[misc]
    return motion_blur(x, radius, sigma, float(rng.uniform(-45, 45)))


def _zoom_blur(x: np.ndarray, rng: Rng, c: object) -> np.ndarray:
    zooms = np.arange(1, float(c), 0.01)  # type: ignore[arg-type]
    out = np.zeros_like(x)
    for z in zooms:
        out += clipped_zoom(x, float(z))
    return (x + out) / (len(zooms) + 1)


def _snow(x: np.ndarray, rng: Rng, c: object) -> np.ndarray:
    loc, scale, zoom, threshold, radius, sigma, keep = c  # type: ignore[misc]
    h, w = x.shape[:2]
    layer = rng.normal(size=(h, w), loc=loc, scale=scale)
    layer = clipped_zoom(layer[..., None], zoom)[..., 0]
    layer[layer < threshold] = 0
    layer = np.uint8(np.clip(layer, 0, 1) * 255).astype(np.float64)  # as the 8-bit layer
    layer = motion_blur(layer, radius, sigma, float(rng.uniform(-135, -45)))
    layer = np.floor(layer + 0.5)[..., None] / 255.0  # [h, w, 1]
    gray = (x @ np.array([0.299, 0.587, 0.114]))[..., None]  # [h, w, 1]
    x = keep * x + (1 - keep) * np.maximum(x, gray * 1.5 + 0.5)
    return x + layer + np.rot90(layer, k=2)


def _frost(x: np.ndarray, rng: Rng, c: object) -> np.ndarray:
    weight, frost = c  # type: ignore[misc]
    texture = frost_texture(rng, x.shape[0], x.shape[1])  # [h, w, 3] in [0, 255]
    return (weight * x * 255 + frost * texture) / 255


def _fog(x: np.ndarray, rng: Rng, c: object) -> np.ndarray:
    amount, decay = c  # type: ignore[misc]
    h, w = x.shape[:2]
    size = max(32, 1 << int(np.ceil(np.log2(max(h, w)))))
    top = x.max()
    x = x + amount * plasma_fractal(rng, size, decay)[:h, :w, None]
    return x * top / (top + amount)


def _brightness(x: np.ndarray, rng: Rng, c: object) -> np.ndarray:
    """HSV value + c (hue and saturation kept): RGB scaled by v'/v; black becomes gray v'."""
    v = x.max(-1, keepdims=True)  # [h, w, 1]
    v_new = np.clip(v + float(c), 0, 1)  # type: ignore[arg-type]
    return np.where(v > 0, x * v_new / np.maximum(v, 1e-12), v_new)


def _contrast(x: np.ndarray, rng: Rng, c: object) -> np.ndarray:
    means = x.mean(axis=(0, 1), keepdims=True)  # [1, 1, 3]
    return (x - means) * float(c) + means  # type: ignore[arg-type]


def _elastic(x: np.ndarray, rng: Rng, c: object) -> np.ndarray:
    h, w = x.shape[:2]
    side = float(h)  # the original's IMSIZE
    alpha, sigma, jitter = (v * side for v in c)  # type: ignore[attr-defined]
    centre = np.array([h // 2, w // 2], dtype=np.float64)
    sq = min(h, w) // 3
    src = np.array([centre + sq, [centre[0] + sq, centre[1] - sq], centre - sq])  # [3, 2]
    dst = src + rng.uniform(-jitter, jitter, size=src.shape)
    x = affine_warp(x, affine_matrix(src, dst))
    dx = ndimage.gaussian_filter(rng.uniform(-1, 1, (h, w)), sigma, mode="reflect", truncate=3)
    dy = ndimage.gaussian_filter(rng.uniform(-1, 1, (h, w)), sigma, mode="reflect", truncate=3)
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")  # [h, w]
    coords = [rows + dy * alpha, cols + dx * alpha]
    return np.stack(
        [ndimage.map_coordinates(x[..., k], coords, order=1, mode="reflect") for k in range(3)],
        -1,
    )


def _pixelate(x: np.ndarray, rng: Rng, c: object) -> np.ndarray:
    h, w = x.shape[:2]
    img = Image.fromarray(np.uint8(np.round(x * 255)))
    small = img.resize((int(w * float(c)), int(h * float(c))), Image.BOX)  # type: ignore[arg-type]
    return np.asarray(small.resize((w, h), Image.BOX), dtype=np.float64) / 255


def _jpeg(x: np.ndarray, rng: Rng, c: object) -> np.ndarray:
    buf = io.BytesIO()
    Image.fromarray(np.uint8(np.round(x * 255))).save(buf, "JPEG", quality=int(c))  # type: ignore[call-overload]
    return np.asarray(Image.open(buf), dtype=np.float64) / 255


_FUNCTIONS: dict[str, Fn] = {
    "gaussian_noise": _gaussian_noise,
    "shot_noise": _shot_noise,
    "impulse_noise": _impulse_noise,
    "defocus_blur": _defocus_blur,
    "glass_blur": _glass_blur,
    "motion_blur": _motion_blur,
    "zoom_blur": _zoom_blur,
    "snow": _snow,
    "frost": _frost,
    "fog": _fog,
    "brightness": _brightness,
    "contrast": _contrast,
    "elastic_transform": _elastic,
    "pixelate": _pixelate,
    "jpeg_compression": _jpeg,
}

#: The 15 corruptions in CIFAR-10-C's order.
CORRUPTIONS: tuple[str, ...] = tuple(_FUNCTIONS)


def corrupt(image: np.ndarray, name: str, severity: int, rng: Rng) -> np.ndarray:
    """One uint8 ``[h, w, 3]`` RGB image under corruption ``name`` at ``severity`` (1..5)."""
    x = image.astype(np.float64) / 255.0
    out = _FUNCTIONS[name](x, rng, SEVERITIES[name][severity - 1])
    return np.uint8(np.clip(out, 0, 1) * 255)  # truncated, as the published sets are


def corrupt_images(images: np.ndarray, name: str, severity: int, seed: int) -> np.ndarray:
    """uint8 ``images [N, C, H, W]`` (C = 1 or 3) corrupted, same shape; the same seed gives
    the same images."""
    if name not in _FUNCTIONS:
        raise ValueError(f"unknown corruption {name!r}")
    if not 1 <= severity <= 5:
        raise ValueError(f"severity {severity} is not in 1..5")
    rng = np.random.default_rng([int(seed), CORRUPTIONS.index(name), int(severity)])
    gray = images.shape[1] == 1
    out = np.empty_like(images)
    for i in range(images.shape[0]):
        rgb = np.repeat(images[i], 3, 0) if gray else images[i]  # [3, H, W]
        done = corrupt(np.ascontiguousarray(rgb.transpose(1, 2, 0)), name, severity, rng)
        chw = done.transpose(2, 0, 1)  # [3, H, W]
        out[i] = np.round(chw.mean(0, keepdims=True)) if gray else chw
    return out
