"""Which implementation of a vote-sized pass runs: the one switch of capsctl/layers/.

Every pass of capsctl/layers/passes/ has up to four implementations of the same math:

- ``native``: the compiled loops of capsctl/layers/backend/csrc/ (float32 tensors on a CPU,
  when the library is built; capsctl/layers/backend/native.py), run through the chunked
  autograd functions;
- ``triton``: the fused Triton kernels of capsctl/layers/backend/triton/ (tensors on a CUDA
  device; on a CPU only inside ``use("triton")`` under Triton's interpreter, for tests): a
  tile's votes built on chip and never written to memory, registered as custom ops that
  ``torch.compile`` keeps; ``CAPSCTL_TRITON=0`` turns them off;
- ``chunked``: the chunked autograd functions as torch code, tile by tile of parent sites, the
  votes never kept (capsctl/layers/passes/tiles.py);
- ``dense``: one torch expression over the whole batch (the votes materialized), for tracing
  and ``torch.compile`` where no fused pass runs (the chunked code loops over the batch in
  Python, which tracing would unroll and specialize to one batch size), and on a CUDA device
  where a pass that gives its vote sizes finds it cheaper than the fused kernels by the cost
  model of capsctl/layers/backend/cost.py, within its memory budget.

A pass asks :func:`choose` once with its tensors and gets its whole plan, a :class:`Choice`:
the backend, why no faster one runs (:attr:`Choice.reason`), the parent sites per tile fixed
by :func:`use`, and the dtype it runs in (under autocast, 16-bit where the Triton kernels
take it). It hands the choice on to its chunked autograd function, whose forward and backward
run what it says without asking again. :func:`use` picks one inside a block: ``use("dense")`` for
export (ONNX, torch.export), ``use("chunked")`` for the torch code instead of the compiled
loops or the Triton kernels (tests, comparisons; ``sites=`` also fixes the parent sites per
tile of the chunked passes), ``use("triton")`` for the Triton kernels on a CPU under
``TRITON_INTERPRET=1``. :func:`ran` tallies the backends the passes ran since
:func:`reset_ran` (what ``capsctl bench`` reports).

:func:`tracing` says whether torch is tracing or compiling, for the layout copies whose own
autograd functions export and compile must not see (capsctl/layers/passes/layout.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from capsctl.environment import switch
from capsctl.layers.backend import native
from capsctl.layers.backend import triton as triton_backend
from capsctl.layers.backend.cost import VoteShape, cuda_path, dense_budget

__all__ = [
    "BACKENDS",
    "TRITON_ENV",
    "Choice",
    "autocast_dtype",
    "choose",
    "expected",
    "peek",
    "ran",
    "reset_ran",
    "run_fused",
    "takes_triton",
    "tracing",
    "triton_status",
    "use",
]

#: The implementations of a pass: the compiled CPU loops, the fused GPU kernels, the torch code
#: and the dense expression for tracing.
BACKENDS = ("native", "triton", "chunked", "dense")
#: Environment variable: ``0`` keeps the Triton kernels off (the torch code runs on a GPU).
TRITON_ENV = "CAPSCTL_TRITON"
#: dtypes the Triton kernels take (float32 sums in every case).
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

_RAN: Counter[str] = Counter()  # backends chosen since reset_ran()
_FUSED_RAN: Counter[str] = Counter()  # run_fused's kernels that ran since reset_ran()
_TRITON_CHECKED: dict[str, str] = {}  # device -> why its self-test failed ("" passed)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Blocks:
    """The :func:`use` blocks open in the current context: how many of each backend, and the
    parent sites per tile fixed by ``use("chunked", sites=)`` (0: none)."""

    dense: int = 0
    chunked: int = 0
    triton: int = 0
    sites: int = 0


# Per thread and per asyncio task (a context variable), not per process: an export's
# use("dense") in one thread leaves another thread's training on its own backend.
_BLOCKS: contextvars.ContextVar[_Blocks] = contextvars.ContextVar("capsctl_use")
_NO_BLOCKS = _Blocks()


def _blocks() -> _Blocks:
    return _BLOCKS.get(_NO_BLOCKS)


@dataclass(frozen=True)
class Choice:
    """The implementation a pass runs: ``backend`` (one of :data:`BACKENDS`); ``reason``: why
    no faster backend runs ("" for ``native``); ``sites``: parent sites per tile of a chunked
    pass fixed by :func:`use` (0: by the chunk budget of capsctl/layers/backend/chunks.py);
    ``dtype``: the dtype the pass runs in where :func:`choose` was given an autocast dtype
    (None: its inputs' own); ``modelled``: fused or dense on a CUDA device as the cost model
    (capsctl/layers/backend/cost.py) chose them, ``reason`` giving both modelled times."""

    backend: str
    reason: str = ""
    sites: int = 0
    dtype: torch.dtype | None = None
    modelled: bool = False  # chosen by the cost model of capsctl/layers/backend/cost.py


@contextlib.contextmanager
def use(backend: str, *, sites: int = 0) -> Iterator[None]:
    """Run ``backend`` (``"dense"``, ``"chunked"`` or ``"triton"``) inside the block, where it
    can run (``dense`` always can; ``chunked`` is the torch code, also where the compiled loops
    or the Triton kernels could run; ``triton`` also takes CPU tensors, under Triton's
    interpreter); ``sites`` (> 0, ``chunked`` only): parent sites per tile of the chunked
    passes. Blocks nest; ``dense`` wins over ``chunked``, which wins over ``triton``. A block
    holds for the thread (or asyncio task) that opened it, and for the worker threads of the
    chunked passes it starts (capsctl/layers/backend/chunks.py), not for other threads."""
    if backend not in ("dense", "chunked", "triton"):
        raise ValueError(f"use() takes 'dense', 'chunked' or 'triton', got {backend!r}")
    if sites and backend != "chunked":
        raise ValueError("sites= applies to the chunked backend only")
    blocks = _blocks()
    opened = replace(blocks, **{backend: getattr(blocks, backend) + 1})
    token = _BLOCKS.set(replace(opened, sites=sites) if sites else opened)
    try:
        yield
    finally:
        _BLOCKS.reset(token)


def tracing() -> bool:
    """Whether torch is tracing (``torch.jit.trace``, the ONNX exporter) or compiling
    (``torch.compile``, ``torch.export``): code that must show plain torch ops."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def triton_status(device: torch.device | str) -> str:
    """Why the Triton kernels cannot run on ``device`` ("" where they can). The first time
    they could, on each device, they run their self-test (capsctl/layers/backend/triton/
    check.py); a device where it fails keeps the torch code, with one warning."""
    if not switch(TRITON_ENV, default=True):
        return f"the Triton kernels are off ({TRITON_ENV}={os.environ[TRITON_ENV].strip()})"
    why = triton_backend.unavailable(device)
    if why:
        return why
    key = str(torch.device(device))
    if key not in _TRITON_CHECKED:
        # out of any graph torch.compile traces; wrapped here, not at import: the wrapper
        # imports torch._dynamo (slow), which imports Triton before a test can ask for its
        # interpreter
        _TRITON_CHECKED[key] = torch.compiler.disable(_self_test)(key)
        if _TRITON_CHECKED[key]:
            log.warning("%s; the routing runs as torch code there", _TRITON_CHECKED[key])
    return _TRITON_CHECKED[key]


def _self_test(device: str) -> str:
    from capsctl.layers.backend.triton.check import self_test

    return self_test(device)


# what a backend is decided on: each input's device and dtype
_Spec = tuple[torch.device, torch.dtype]


def _triton_reason(specs: list[_Spec]) -> str:
    """Why the Triton kernels cannot run this pass ("" where they do)."""
    device = specs[0][0]
    if device.type == "cpu" and not _blocks().triton:
        return 'the Triton kernels run on CUDA devices (on a CPU only inside use("triton"))'
    if any(dev != device for dev, _ in specs):
        return "the tensors are on several devices"
    if not all(dt in _TRITON_DTYPES for _, dt in specs):
        return "the Triton kernels take floating-point tensors"
    return triton_status(device)


def takes_triton(*tensors: Tensor) -> bool:
    """Whether a pass over ``tensors`` would run as the fused Triton kernels (no export, trace
    or ``use("chunked")`` in the way)."""
    blocks = _blocks()
    if blocks.dense or blocks.chunked or torch.jit.is_tracing():
        return False
    return not _triton_reason([(t.device, t.dtype) for t in tensors])


def _chosen(choice: Choice) -> Choice:
    _RAN[choice.backend] += 1
    return choice


def choose(
    *tensors: Tensor, autocast: torch.dtype | None = None, votes: VoteShape | None = None
) -> Choice:
    """The plan of one pass over ``tensors`` (its inputs, as the pass will read them), counted
    in :func:`ran`: a pass asks once and hands the answer on. ``autocast``: the 16-bit dtype
    of an autocast block the pass runs in; the choice's ``dtype`` then says what to cast the
    inputs to (that dtype where the Triton kernels take it, else float32). ``votes``: the
    pass's vote sizes, for which a CUDA device runs the fused kernels or the dense expression,
    whichever the cost model finds cheaper (capsctl/layers/backend/cost.py)."""
    return _chosen(peek(*tensors, autocast=autocast, votes=votes))


def peek(
    *tensors: Tensor, autocast: torch.dtype | None = None, votes: VoteShape | None = None
) -> Choice:
    """The choice :func:`choose` would make, not counted in :func:`ran`: for a pass that runs
    only on one backend and leaves the others to passes that ask :func:`choose` themselves."""
    specs = [(t.device, t.dtype) for t in tensors]
    if autocast is None:
        return _decide(specs, votes)
    low = _decide([(dev, autocast) for dev, _ in specs], votes)
    if low.backend == "triton" or low.modelled:
        return replace(low, dtype=autocast)
    return replace(_decide([(dev, torch.float32) for dev, _ in specs]), dtype=torch.float32)


def autocast_dtype(t: Tensor) -> torch.dtype | None:
    """The 16-bit dtype of the autocast block active on ``t``'s device (None outside one): what
    a pass gives :func:`choose` as ``autocast``, so that inputs autocast made 16-bit still run
    the compiled loops, in float32."""
    device = t.device.type
    if not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


def expected(device: torch.device | str) -> Choice:
    """The backend a float32 pass on ``device`` runs outside any :func:`use` block, and why no
    faster one does (for the training header and ``capsctl bench``); not counted in
    :func:`ran`."""
    device = torch.device(device)
    choice = _decide([(device, torch.float32)])
    if choice.backend == "triton" and device.type == "cuda":
        budget = dense_budget() / (1 << 30)
        return replace(choice, reason=f"a pass takes materialized votes where the cost model "
                       f"finds them cheaper and within {budget:.2g} GiB")  # fmt: skip
    return choice


def _decide(specs: list[_Spec], votes: VoteShape | None = None) -> Choice:
    """The backend of a pass over inputs of these devices and dtypes (see :func:`choose`)."""
    blocks = _blocks()
    if blocks.dense:
        return Choice("dense", 'inside use("dense") (export)')
    sites = blocks.sites
    on_cpu = specs[0][0].type == "cpu"
    why_not_triton = _triton_reason(specs)
    if torch.compiler.is_compiling():
        if not why_not_triton and not blocks.chunked:
            return Choice("triton")  # custom ops: compile keeps the fused pass
        return Choice("dense", "torch.compile or torch.export is tracing")
    if torch.jit.is_tracing():
        return Choice("chunked", "torch.jit is tracing", sites)
    if blocks.chunked:
        return Choice("chunked", 'inside use("chunked")', sites)
    if not why_not_triton:
        if votes is not None and specs[0][0].type == "cuda" and not blocks.triton:
            backend, reason = cuda_path(votes, specs[0][1].itemsize)
            return Choice(backend, reason, modelled=True)
        return Choice("triton")
    if not all(dev.type == "cpu" and dt == torch.float32 for dev, dt in specs):
        reason = "the compiled loops take float32 tensors on a CPU only"
        if not on_cpu:
            reason = why_not_triton
        return Choice("chunked", reason, sites)
    if native.loaded() is None:
        return Choice("chunked", "the compiled loops are " + native.native_status(), sites)
    return Choice("native")


# (kernel, shapes, dtypes, device) -> why the fused pass failed there; its torch code runs
_FUSED_FAILED: dict[tuple[Any, ...], str] = {}
# (kernel, shapes, dtypes, device) whose backward ran once (a pass needing gradients runs its
# backward at those shapes once first, so that a failure shows before training relies on it)
_FUSED_PROVEN: set[tuple[Any, ...]] = set()


def run_fused(kernel: str, call: Callable[..., Any], *inputs: Tensor) -> Any | None:
    """``call(*inputs)``, the fused Triton pass ``kernel``; None where it fails to import,
    compile or launch at these shapes, after one warning naming the kernel, the shapes and the
    reason: the caller then runs its torch code, now and at these shapes from then on. Where
    an input needs its gradient, the pass's backward runs once at each new set of shapes
    first, so that a backward kernel's failure falls back too. Under ``torch.compile`` errors
    propagate (the compiled graph holds the custom op), and so does running out of memory."""
    if torch.compiler.is_compiling():
        return call(*inputs)
    key = (
        kernel,
        tuple(tuple(t.shape) for t in inputs),
        tuple(t.dtype for t in inputs),
        str(inputs[0].device),
    )
    if key in _FUSED_FAILED:
        return None
    try:
        grads = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
        if grads and key not in _FUSED_PROVEN:
            _backward_once(call, inputs)
            _FUSED_PROVEN.add(key)
        out = call(*inputs)
        _FUSED_RAN[kernel] += 1
        return out
    except torch.OutOfMemoryError:
        raise  # the torch code needs more memory, not less: no fall back
    except Exception as e:  # noqa: BLE001 - any failure of the kernel: the torch code runs
        shapes = " ".join("x".join(map(str, t.shape)) for t in inputs)
        lines = str(e).strip().splitlines() or [""]
        why = f"{type(e).__name__}: {lines[0][:200]}".rstrip(": ")
        _FUSED_FAILED[key] = why
        log.warning(
            "the Triton kernel of the %s pass failed at shapes %s on %s (%s); that pass runs as "
            "torch code there",
            kernel,
            shapes,
            key[3],
            why,
        )
        return None


def _backward_once(call: Callable[..., Any], inputs: tuple[Tensor, ...]) -> None:
    """The fused pass forward and backward on detached copies of ``inputs``."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        out = call(*leaves)
        outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]
        wrt = [t for t in leaves if t.requires_grad]
        if outs and wrt:
            loss = sum(o.float().sum() for o in outs)
            torch.autograd.grad(loss, wrt, allow_unused=True)


def ran() -> dict[str, int]:
    """How many passes each backend ran since :func:`reset_ran` (backends that ran none left
    out)."""
    return {k: v for k, v in _RAN.items() if v}


def fused_ran() -> dict[str, int]:
    """How many times each of :func:`run_fused`'s kernels ran (and did not fall back) since
    :func:`reset_ran`, by its name (``routed``, ``gate``, ``squash``, ``e_step``, ...)."""
    return {k: v for k, v in _FUSED_RAN.items() if v}


def reset_ran() -> None:
    """Start a new tally for :func:`ran` and :func:`fused_ran`."""
    _RAN.clear()
    _FUSED_RAN.clear()
