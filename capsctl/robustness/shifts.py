"""Seeded, deterministic shifted test sets: rotation and translation sweeps, affNIST-style sets.

Every generator is a function of ``(dataset, seed, magnitude)``: image ``i``'s transformation
is drawn from one CPU ``torch.Generator`` seeded with ``seed``, so the same call gives the same
images on every machine, and magnitude 0 gives the images unchanged. Images keep their size
(a 28x28 model sees 28x28 images); pixels moved in from outside the image are black (0), and
values are resampled bilinearly and rounded back to uint8.

- ``rotate``: each image rotated about its centre by ``magnitude`` degrees, clockwise or
  anticlockwise at random.
- ``translate``: each image moved by ``magnitude`` pixels in a uniformly random direction.
- ``affine``: affNIST (T. Tieleman, affNIST, University of Toronto, 2013; the test protocol of
  Sabour et al., NeurIPS 2017, §5.2): the 28x28 digits are padded to the centre of a 40x40
  canvas and transformed by ``translate(t) @ rotate(r) @ shear(s) @ scale(sx, sy)`` about the
  centre with affNIST's ranges: rotation within ±20°, horizontal shear factor within ±0.2,
  scale 0.8–1.2 independently per axis, and a translation drawn uniformly among those that
  keep the transformed digit's bounding box on the canvas. ``magnitude`` scales those ranges
  (1 = affNIST's, 0 = no transformation). It needs a model with 40x40 input, trained e.g. on
  ``expanded-mnist`` (Sabour et al.'s train-on-translated, test-on-affine protocol).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from capsctl.data.dataset import ArrayDataset
from capsctl.errors import UsageError

__all__ = [
    "AFFNIST_CANVAS",
    "AFFNIST_RANGES",
    "DEFAULT_MAGNITUDES",
    "MAX_MAGNITUDES",
    "SHIFTS",
    "affnist_set",
    "shifted_images",
    "shifted_set",
]

SHIFTS = ("affine", "translate", "rotate")

#: Sweeps run when no magnitudes are given: degrees, pixels, share of affNIST's ranges.
DEFAULT_MAGNITUDES: dict[str, tuple[float, ...]] = {
    "rotate": (0.0, 15.0, 30.0, 45.0, 60.0, 90.0),
    "translate": (0.0, 2.0, 4.0, 6.0, 8.0),
    "affine": (0.0, 1.0),
}

#: The largest magnitude of each shift: half a turn; a shift past the largest 40x40 image;
#: affNIST's ranges themselves (beyond them the scale range reaches 0 at 5).
MAX_MAGNITUDES: dict[str, float] = {"rotate": 180.0, "translate": 64.0, "affine": 1.0}

AFFNIST_CANVAS = 40
#: affNIST's ranges (Tieleman 2013): rotation degrees, shear factor, scale per axis.
AFFNIST_RANGES = {"rotation_deg": 20.0, "shear": 0.2, "scale": (0.8, 1.2)}


def _warp(images: torch.Tensor, linear: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """uint8 ``images [N, C, H, W]`` mapped by ``p' = linear @ (p - c) + c + offset`` (pixel
    coordinates (x, y), ``c`` the centre), ``linear [N, 2, 2]``, ``offset [N, 2]``; bilinear,
    black outside, rounded back to uint8."""
    n, _, h, w = images.shape
    inv = torch.linalg.inv(linear.double())  # [N, 2, 2]: output -> input
    ys, xs = torch.meshgrid(
        torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64), indexing="ij"
    )
    centre = torch.tensor([(w - 1) / 2, (h - 1) / 2], dtype=torch.float64)  # [2]: (x, y)
    out = torch.stack([xs, ys], -1).view(1, h * w, 2) - centre - offset.double()[:, None]
    src = torch.einsum("nij,npj->npi", inv, out) + centre  # [N, H*W, 2]: input (x, y)
    scale = torch.tensor([2.0 / w, 2.0 / h], dtype=torch.float64)
    grid = ((src + 0.5) * scale - 1).view(n, h, w, 2).float()  # [N, H, W, 2] in [-1, 1]
    moved = F.grid_sample(
        images.float(), grid, mode="bilinear", padding_mode="zeros", align_corners=False
    )  # [N, C, H, W]
    return moved.round().clamp(0, 255).to(torch.uint8)


def _rotation(theta: torch.Tensor) -> torch.Tensor:
    """``[N, 2, 2]`` rotations by ``theta [N]`` radians (image axes: y points down)."""
    c, s = torch.cos(theta), torch.sin(theta)
    return torch.stack([torch.stack([c, -s], -1), torch.stack([s, c], -1)], -2)  # [N, 2, 2]


def shifted_images(images: torch.Tensor, kind: str, magnitude: float, seed: int) -> torch.Tensor:
    """``images [N, C, H, W]`` (uint8) under the sweep ``kind`` (``rotate``: degrees,
    ``translate``: pixels) at ``magnitude``; the same seed gives the same images."""
    n = images.shape[0]
    gen = torch.Generator().manual_seed(int(seed))
    if kind == "rotate":
        sign = torch.randint(0, 2, (n,), generator=gen).double() * 2 - 1  # [N]: ±1
        linear = _rotation(sign * math.radians(magnitude))
        offset = torch.zeros(n, 2, dtype=torch.float64)
    elif kind == "translate":
        angle = torch.rand(n, generator=gen, dtype=torch.float64) * 2 * math.pi  # [N]
        linear = torch.eye(2, dtype=torch.float64).expand(n, 2, 2)
        offset = magnitude * torch.stack([torch.cos(angle), torch.sin(angle)], -1)  # [N, 2]
    else:
        raise UsageError(f"--shift {kind}: the sweeps are rotate and translate (or affine)")
    if magnitude == 0:
        return images.clone()
    return _warp(images, linear, offset)


def _affine_params(n: int, magnitude: float, gen: torch.Generator) -> torch.Tensor:
    """``[N, 2, 2]`` linear parts ``rotate @ shear @ scale`` with affNIST's ranges x magnitude."""

    def uniform(low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(n, generator=gen, dtype=torch.float64)  # [N]

    rot = math.radians(AFFNIST_RANGES["rotation_deg"]) * magnitude
    shear_max = AFFNIST_RANGES["shear"] * magnitude
    lo, hi = AFFNIST_RANGES["scale"]
    theta = uniform(-rot, rot)
    shear = uniform(-shear_max, shear_max)
    sx = uniform(1 + (lo - 1) * magnitude, 1 + (hi - 1) * magnitude)
    sy = uniform(1 + (lo - 1) * magnitude, 1 + (hi - 1) * magnitude)
    one, zero = torch.ones(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    shear_m = torch.stack([torch.stack([one, shear], -1), torch.stack([zero, one], -1)], -2)
    scale_m = torch.diag_embed(torch.stack([sx, sy], -1))  # [N, 2, 2]
    return _rotation(theta) @ shear_m @ scale_m  # [N, 2, 2]


def _room(images: torch.Tensor, linear: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The lowest and highest translation ``[N, 2]`` that keep each image's ink (its bounding
    box, transformed by ``linear`` about the centre) on the canvas."""
    n, _, h, w = images.shape
    ink = images.amax(1) > 0  # [N, H, W]
    cols, rows = ink.any(1), ink.any(2)  # [N, W], [N, H]
    idx_w, idx_h = torch.arange(w), torch.arange(h)
    x0 = torch.where(cols, idx_w, w).amin(1).double()  # [N]
    x1 = torch.where(cols, idx_w, -1).amax(1).double()
    y0 = torch.where(rows, idx_h, h).amin(1).double()
    y1 = torch.where(rows, idx_h, -1).amax(1).double()
    centre = torch.tensor([(w - 1) / 2, (h - 1) / 2], dtype=torch.float64)
    corners = torch.stack(
        [torch.stack(p, -1) for p in ((x0, y0), (x1, y0), (x0, y1), (x1, y1))], 1
    )  # [N, 4, 2]
    moved = torch.einsum("nij,nkj->nki", linear, corners - centre) + centre  # [N, 4, 2]
    size = torch.tensor([w - 1, h - 1], dtype=torch.float64)
    low = -moved.amin(1)  # [N, 2]: the shift that brings the far side to 0
    high = size - moved.amax(1)  # [N, 2]
    empty = ~(cols.any(1))  # blank images stay put
    low[empty], high[empty] = 0.0, 0.0
    return torch.minimum(low, high), torch.maximum(low, high)


def affnist_set(digits: ArrayDataset, seed: int, magnitude: float = 1.0) -> ArrayDataset:
    """affNIST-style test set (see the module docstring) from 28x28 (or smaller) digits."""
    images = digits.images
    n, c, h, w = images.shape
    if h > AFFNIST_CANVAS or w > AFFNIST_CANVAS:
        raise UsageError(f"affNIST-style sets need digits up to 40x40, got {h}x{w}")
    top, left = (AFFNIST_CANVAS - h) // 2, (AFFNIST_CANVAS - w) // 2
    canvas = F.pad(images, (left, AFFNIST_CANVAS - w - left, top, AFFNIST_CANVAS - h - top))
    gen = torch.Generator().manual_seed(int(seed))
    linear = _affine_params(n, magnitude, gen)  # [N, 2, 2]
    low, high = _room(canvas, linear)  # [N, 2]
    pick = torch.rand(n, 2, generator=gen, dtype=torch.float64)  # [N, 2]
    offset = (low + (high - low) * pick) * magnitude  # [N, 2]: centred at magnitude 0
    out = canvas.clone() if magnitude == 0 else _warp(canvas, linear, offset)
    return ArrayDataset(out, digits.labels.clone(), list(digits.classes), f"affnist({digits.name})")


def shifted_set(ds: ArrayDataset, kind: str, magnitude: float, seed: int) -> ArrayDataset:
    """``ds`` under the sweep ``kind`` at ``magnitude`` (same size, same labels)."""
    images = shifted_images(ds.images, kind, magnitude, seed)
    return ArrayDataset(images, ds.labels.clone(), list(ds.classes), f"{ds.name}[{kind}]")
