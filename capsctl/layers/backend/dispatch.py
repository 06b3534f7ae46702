"""Which implementation of a vote-sized pass runs: the one switch of capsctl/layers/.

Every pass of capsctl/layers/passes/ has up to three implementations of the same math, fastest
first on a CPU:

- ``native``: the compiled loops of capsctl/layers/backend/csrc/ (float32 tensors on a CPU,
  when the library is built; capsctl/layers/backend/native.py), run through the chunked
  autograd functions;
- ``chunked``: the same autograd functions as torch code, tile by tile of parent sites, the
  votes never kept (capsctl/layers/passes/tiles.py);
- ``dense``: one torch expression over the whole batch (the votes materialized), for tracing
  and ``torch.compile``: the chunked code loops over the batch in Python, which tracing would
  unroll and specialize to one batch size.

A pass asks :func:`choose` with its tensors and runs what it says; :attr:`Choice.reason`
says why no faster backend runs. :func:`use` picks one inside a block: ``use("dense")`` for
export (ONNX, torch.export), ``use("chunked")`` for the torch code instead of the compiled
loops (tests, comparisons; ``sites=`` also fixes the parent sites per tile of the chunked
passes). A backend for accelerators (e.g. ``backend/triton/``) is one more name in
:data:`BACKENDS` and one more branch of :func:`choose`.

:func:`tracing` says whether torch is tracing or compiling, for the layout copies whose own
autograd functions export and compile must not see (capsctl/layers/passes/layout.py).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from capsctl.layers.backend import native

__all__ = ["BACKENDS", "Choice", "choose", "tracing", "use"]

#: The implementations of a pass, fastest first on a CPU.
BACKENDS = ("native", "chunked", "dense")

_OPEN = {"dense": 0, "chunked": 0}  # open use() blocks of each backend
_SITES = {"sites": 0}  # parent sites per tile fixed by use(..., sites=)
_LOCK = threading.Lock()


@dataclass(frozen=True)
class Choice:
    """The implementation a pass runs: ``backend`` (one of :data:`BACKENDS`); ``reason``: why
    no faster backend runs ("" for ``native``); ``sites``: parent sites per tile of a chunked
    pass fixed by :func:`use` (0: by the chunk budget of capsctl/layers/backend/chunks.py)."""

    backend: str
    reason: str = ""
    sites: int = 0


@contextlib.contextmanager
def use(backend: str, *, sites: int = 0) -> Iterator[None]:
    """Run ``backend`` (``"dense"`` or ``"chunked"``) inside the block, where it can run
    (``dense`` always can; ``chunked`` is the torch code, also where the compiled loops could
    run); ``sites`` (> 0, ``chunked`` only): parent sites per tile of the chunked passes.
    Blocks nest and may be open in several threads at once; ``dense`` wins over ``chunked``."""
    if backend not in _OPEN:
        raise ValueError(f"use() takes 'dense' or 'chunked', got {backend!r}")
    if sites and backend != "chunked":
        raise ValueError("sites= applies to the chunked backend only")
    with _LOCK:
        _OPEN[backend] += 1
        before = _SITES["sites"]
        if sites:
            _SITES["sites"] = sites
    try:
        yield
    finally:
        with _LOCK:
            _OPEN[backend] -= 1
            if sites:
                _SITES["sites"] = before


def tracing() -> bool:
    """Whether torch is tracing (``torch.jit.trace``, the ONNX exporter) or compiling
    (``torch.compile``, ``torch.export``): code that must show plain torch ops."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def choose(*tensors: Tensor) -> Choice:
    """The backend of a pass over ``tensors`` (its inputs, as the pass will read them)."""
    if _OPEN["dense"]:
        return Choice("dense", 'inside use("dense") (export)')
    if torch.compiler.is_compiling():
        return Choice("dense", "torch.compile or torch.export is tracing")
    sites = _SITES["sites"]
    if torch.jit.is_tracing():
        return Choice("chunked", "torch.jit is tracing", sites)
    if _OPEN["chunked"]:
        return Choice("chunked", 'inside use("chunked")', sites)
    if not all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors):
        return Choice("chunked", "the compiled loops take float32 tensors on a CPU only", sites)
    if native.loaded() is None:
        return Choice("chunked", "the compiled loops are " + native.native_status(), sites)
    return Choice("native")
