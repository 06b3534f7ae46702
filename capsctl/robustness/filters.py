"""Image filters the CIFAR-10-C corruptions are made of, written with numpy and scipy.

Each follows what Hendrycks and Dietterich's ``make_cifar_c.py`` (ICLR 2019) computes with
OpenCV, scikit-image and ImageMagick, so that capsctl needs neither:

- :func:`disk_kernel`: an aliased disk on a 17x17 grid (radius <= 8), normalized, smoothed by a
  3x3 Gaussian of ``sigma = alias_blur`` with reflect-101 borders (OpenCV's GaussianBlur);
- :func:`clipped_zoom`: crop the centre ``ceil(h / z)`` square, zoom it by ``z`` with linear
  interpolation (``scipy.ndimage.zoom``), cut the centre ``h x h`` back out;
- :func:`plasma_fractal`: a diamond-square height map (side a power of two, wrapping around),
  the random offsets of each level ``wibble * U(-wibble, wibble)`` with ``wibble`` starting at
  100 and divided by ``wibbledecay`` per level, scaled to [0, 1];
- :func:`motion_blur` (a substitute: the original calls ImageMagick's MotionBlurImage through
  Wand): a one-sided line kernel of ``2 * ceil(radius) + 1`` taps at ``angle`` degrees, tap
  ``i`` weighted ``exp(-i^2 / (2 sigma^2))`` and normalized, offsets rounded to whole pixels,
  edge pixels repeated beyond the border;
- :func:`frost_texture` (a substitute: the original blends crops of six photographs of frost
  shipped with its code): a bluish-white fractal haze with thin bright crystal streaks;
- :func:`affine_warp`: OpenCV's ``warpAffine`` (bilinear, reflect-101 borders) for a 2x3 matrix
  in (x, y) coordinates, through ``scipy.ndimage.affine_transform``.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import ndimage

__all__ = [
    "affine_matrix",
    "affine_warp",
    "clipped_zoom",
    "disk_kernel",
    "frost_texture",
    "gaussian_kernel_1d",
    "motion_blur",
    "plasma_fractal",
]


def gaussian_kernel_1d(size: int, sigma: float) -> np.ndarray:
    """OpenCV's ``getGaussianKernel`` for ``sigma > 0``: ``exp(-(i - (size-1)/2)^2 / 2s^2)``,
    normalized to sum 1."""
    i = np.arange(size, dtype=np.float64) - (size - 1) / 2
    k = np.exp(-(i**2) / (2 * sigma**2))
    return k / k.sum()


def disk_kernel(radius: float, alias_blur: float) -> np.ndarray:
    """The defocus kernel: an aliased disk, normalized, blurred by a small Gaussian."""
    half, ksize = (8, 3) if radius <= 8 else (int(radius), 5)
    grid = np.arange(-half, half + 1)
    xx, yy = np.meshgrid(grid, grid)
    disk = ((xx**2 + yy**2) <= radius**2).astype(np.float64)
    disk /= disk.sum()
    g = gaussian_kernel_1d(ksize, alias_blur)
    return ndimage.correlate(disk, np.outer(g, g), mode="mirror")


def clipped_zoom(img: np.ndarray, factor: float) -> np.ndarray:
    """``img [h, h, c]`` zoomed by ``factor`` about its centre, cropped to ``h x h``."""
    h = img.shape[0]
    ch = int(math.ceil(h / factor))
    top = (h - ch) // 2
    zoomed = ndimage.zoom(img[top : top + ch, top : top + ch], (factor, factor, 1), order=1)
    trim = (zoomed.shape[0] - h) // 2
    return zoomed[trim : trim + h, trim : trim + h]


def plasma_fractal(rng: np.random.Generator, size: int, wibbledecay: float) -> np.ndarray:
    """A ``[size, size]`` diamond-square height map in [0, 1] (``size`` a power of two)."""
    grid = np.zeros((size, size), dtype=np.float64)
    step, wibble = size, 100.0
    while step >= 2:
        half = step // 2

        def jitter(values: np.ndarray, w: float = wibble) -> np.ndarray:
            return values / 4 + w * rng.uniform(-w, w, values.shape)

        corners = grid[0:size:step, 0:size:step]  # [s, s]
        square = corners + np.roll(corners, -1, axis=0)
        square = square + np.roll(square, -1, axis=1)
        grid[half:size:step, half:size:step] = jitter(square)
        centres = grid[half:size:step, half:size:step]
        corners = grid[0:size:step, 0:size:step]
        top = centres + np.roll(centres, 1, axis=0) + corners + np.roll(corners, -1, axis=1)
        grid[0:size:step, half:size:step] = jitter(top)
        left = centres + np.roll(centres, 1, axis=1) + corners + np.roll(corners, -1, axis=0)
        grid[half:size:step, 0:size:step] = jitter(left)
        step //= 2
        wibble /= wibbledecay
    grid -= grid.min()
    return grid / max(grid.max(), 1e-12)


def motion_blur(img: np.ndarray, radius: float, sigma: float, angle: float) -> np.ndarray:
    """``img [h, w]`` or ``[h, w, c]`` blurred along a line at ``angle`` degrees (substitute for
    ImageMagick's motion blur; see the module docstring)."""
    taps = 2 * int(math.ceil(radius)) + 1
    i = np.arange(taps, dtype=np.float64)
    weights = np.exp(-(i**2) / (2 * sigma**2))
    weights /= weights.sum()
    rad = math.radians(angle)
    dx = np.ceil(i * math.cos(rad) - 0.5).astype(int)
    dy = np.ceil(i * math.sin(rad) - 0.5).astype(int)
    h, w = img.shape[:2]
    rows, cols = np.arange(h)[:, None], np.arange(w)[None, :]
    out = np.zeros(img.shape, dtype=np.float64)
    for k in range(taps):
        r = np.clip(rows + dy[k], 0, h - 1)  # [h, 1]
        c = np.clip(cols + dx[k], 0, w - 1)  # [1, w]
        out += weights[k] * img[r, c]
    return out


def frost_texture(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A frost-like ``[h, w, 3]`` layer in [0, 255] (substitute for the frost photographs)."""
    size = 1 << max(int(math.ceil(math.log2(max(h, w)))), 1)
    haze = plasma_fractal(rng, size, 2.0)[:h, :w]  # [h, w] in [0, 1]
    seeds = (rng.random((h, w)) < 0.04).astype(np.float64)  # sparse crystal starts
    streaks = np.zeros((h, w), dtype=np.float64)
    for angle in rng.uniform(0, 180, size=3):
        streaks = np.maximum(streaks, motion_blur(seeds, 3.0, 2.0, float(angle)) * 4)
    ice = np.clip(0.55 * haze + 0.45 * np.clip(streaks, 0, 1), 0, 1)  # [h, w]
    tint = np.array([0.86, 0.93, 1.0])  # bluish white
    return ice[..., None] * tint * 255.0  # [h, w, 3]


def affine_matrix(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """The 2x3 matrix mapping three points ``src [3, 2]`` onto ``dst [3, 2]`` ((x, y) pairs)."""
    a = np.concatenate([src, np.ones((3, 1))], axis=1)  # [3, 3]
    return np.linalg.solve(a, dst).T  # [2, 3]


def affine_warp(img: np.ndarray, m: np.ndarray) -> np.ndarray:
    """``img [h, w, c]`` warped by the 2x3 (x, y) matrix ``m`` as OpenCV's warpAffine: the
    output pixel ``p`` reads the input at ``m^-1 p``; bilinear, reflect-101 borders."""
    inv = np.linalg.inv(np.vstack([m, [0.0, 0.0, 1.0]]))  # [3, 3]: output (x, y) -> input
    rc = np.array([[inv[1, 1], inv[1, 0]], [inv[0, 1], inv[0, 0]]])  # (row, col) order
    offset = np.array([inv[1, 2], inv[0, 2]])
    channels = [
        ndimage.affine_transform(img[..., k], rc, offset=offset, order=1, mode="mirror")
        for k in range(img.shape[2])
    ]
    return np.stack(channels, axis=-1)
