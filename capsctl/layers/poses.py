"""Pose kinds of a capsule, and how a pose of ``d`` entries reads as a matrix.

A pose is a vector of ``d`` entries or, for *matrix poses* (Tsai et al., ICLR 2020,
arXiv:2002.04764), an ``s x s`` matrix with ``d = s*s``. Every capsule layer writes a child pose
as an ``a x x`` matrix: ``a = s`` rows for matrix poses, ``a = 1`` row for vectors (letters as in
capsctl/layers/passes/routed.py). Imports no torch: model configurations use :data:`PoseKind` too.
"""

from __future__ import annotations

import math
from typing import Literal

PoseKind = Literal["matrix", "vector"]


def pose_shape(dim: int, kind: PoseKind) -> tuple[int, int]:
    """``(a, x)``: rows and columns of a pose of ``dim`` entries read as a matrix."""
    if kind == "vector":
        return 1, dim
    s = math.isqrt(dim)
    if s * s != dim:
        raise ValueError(f"matrix poses need a square pose dim, got {dim}")
    return s, s
