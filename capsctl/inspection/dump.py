"""Raw routing coefficients as a safetensors file: :func:`dump_coefficients`.

Keys ``layer{l}.iter{t}`` (layers 0-based, iterations 1-based, as in
capsctl/inspection/report.py) hold float32 tensors shaped as in the trace (conv
``[b, h, w, k, l, n, m]``, FC ``[b, n, m]``). The string metadata holds ``format``
(``capsctl-routing``) and, as JSON, ``kinds``, ``child_grids``, ``classes``, ``iterations`` and
``routing``. The file is written atomically (capsctl/atomic.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import Tensor

from capsctl.atomic import write_atomic
from capsctl.errors import CapsctlError
from capsctl.inspection.report import RoutingReport

__all__ = ["check_folder", "dump_coefficients", "dump_metadata", "dump_tensors"]


def dump_tensors(report: RoutingReport) -> dict[str, Tensor]:
    """``report``'s raw coefficients and activations by key, float32 on the CPU."""
    tensors = {
        f"layer{li}.iter{ti + 1}": c.detach().to("cpu", torch.float32).contiguous()
        for li, per_layer in enumerate(report.coefficients)
        for ti, c in enumerate(per_layer)
    }
    for li, per_layer in enumerate(report.activations):
        for ti, a in enumerate(per_layer):
            tensors[f"layer{li}.iter{ti + 1}.activations"] = a.to("cpu", torch.float32).contiguous()
    return tensors


def dump_metadata(report: RoutingReport) -> dict[str, str]:
    """The string metadata of a dump of ``report`` (module docstring)."""
    grids = [None if g is None else list(g) for g in report.child_grids]
    return {
        "format": "capsctl-routing",
        "algorithm": report.algorithm,
        "kinds": json.dumps(report.kinds),
        "child_grids": json.dumps(grids),
        "classes": json.dumps(report.classes, ensure_ascii=False),
        "iterations": json.dumps(report.iterations),
        "routing": json.dumps(report.routing),
    }


def dump_coefficients(report: RoutingReport, path: str | os.PathLike[str]) -> Path:
    """Write ``report``'s raw coefficients to ``path`` (format in the module docstring).

    Returns the path. Raises :class:`CapsctlError` naming the path when its folder is missing.
    """
    from safetensors.torch import save

    path = Path(path)
    check_folder(path)
    write_atomic(path, save(dump_tensors(report), metadata=dump_metadata(report)))
    return path


def check_folder(path: Path) -> None:
    """:class:`CapsctlError` naming ``path`` when its folder does not exist."""
    if not path.parent.is_dir():
        raise CapsctlError(
            f"cannot write {path}: the folder {path.parent} does not exist; create it first"
        )
