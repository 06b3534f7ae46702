"""Fused GPU passes in Triton: the votes built on chip tile by tile and never stored.

kernels.py holds the Triton kernels of the routed and the weighted pass (self-routing's
coefficients depend on the child alone, so its pass is torch's logits and the weighted pass),
em.py EM routing's moments and quadratic form (forward and backward, float32 accumulation);
ops.py and em_ops.py register them as ``torch.library`` custom ops
(``capsctl::triton_routed``, ``triton_weighted``, ``triton_em_moments``,
``triton_em_quad`` and their backwards) with fake implementations and autograd, so
``torch.compile`` keeps each pass as one node.

Importing this package imports neither Triton nor the kernels: :func:`unavailable` says why
the passes cannot run on a tensor's device ("" where they can); ops.py and em_ops.py import
Triton and register the ops (nothing is compiled until a launch).
On a CPU they run only under Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton
is imported), which the tests use; a model on a CPU never takes this backend.
"""

from __future__ import annotations

import os

import torch

__all__ = ["interpreted", "unavailable"]


def interpreted() -> bool:
    """Whether Triton's interpreter is asked for (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def unavailable(device: torch.device | str) -> str:
    """Why the Triton passes cannot run on ``device``; "" where they can (a CUDA device with
    Triton, or any CPU tensor under the interpreter)."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return "no CUDA device"
    if device.type not in ("cuda", "cpu"):
        return f"the Triton passes run on CUDA devices only, not {device.type}"
    if device.type == "cpu" and not interpreted():
        return "the Triton passes run on CUDA devices (on a CPU only under TRITON_INTERPRET=1)"
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return f"triton cannot import ({type(exc).__name__}: {exc})"
    return ""
