"""Every torch operator of a captured training step, with its FLOPs and bytes: the rest of a
model's step beside its routing kernels, for a modelled step (*estimated*) that treats the
capsule models and ResNet-18 alike.

:func:`recording` is a dispatch mode that sees each ATen operator a step runs on fake tensors
(capsctl/layers/backend/triton/aot.py's :func:`~capsctl.layers.backend.triton.aot.capture_step`
enters it below the mode that runs the fused passes' Python code, so the operators inside a
pass, such as the sum of its spans, are seen and the kernels are not). Each operator gives one
:class:`OpCost`:

- ``flops``: torch's own formulas (``torch.utils.flop_counter``: matrix products and
  convolutions, forward and backward); 0 for every other operator;
- ``bytes``: every tensor it reads or writes once (inputs and outputs), as a GPU kernel must at
  least; views and allocations (no data moves) are left out, a fill shaped after another
  tensor (``new_zeros``, ``zeros_like``, ...) writes its output without reading that tensor,
  and an ``out=`` tensor counts once, as the result;
- ``product``: a matrix product or convolution (tensor cores on a GPU), and ``dtype``, the
  element type of its first floating-point input.

aot_cost.py's :func:`~capsctl.layers.backend.triton.aot_cost.op_us` turns one into modelled
microseconds with the same constants as the kernels' (docs/GPU.md's H100).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["OpCost", "recording"]

# operators that allocate without writing: no data moves
_ALLOCATIONS = ("empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided")
# fills shaped after another tensor, whose data they do not read: only the output is written
_FILLS_LIKE = ("new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like")
# views that ATen does not tag as views (no alias information): no data moves either
# (``_unsafe_view`` is what ``reshape`` of a fresh result runs, e.g. after a matrix product)
_UNTAGGED_VIEWS = ("_unsafe_view", "_reshape_alias")


@dataclass(frozen=True)
class OpCost:
    """One operator of a step (module docstring)."""

    op: str
    flops: int
    bytes: int
    dtype: str
    product: bool


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _cost(func: Any, args: tuple, kwargs: dict, out: Any) -> OpCost | None:
    """The operator's :class:`OpCost`, or None where it moves no data."""
    from torch.utils.flop_counter import flop_registry

    name = func.__name__.split(".")[0]
    if func.namespace != "aten" or func.is_view or name in _ALLOCATIONS + _UNTAGGED_VIEWS:
        return None
    # an ``out=`` tensor is the result, written once: not read as an input too
    ins, outs = _tensors((args, {k: v for k, v in kwargs.items() if k != "out"})), _tensors(out)
    if name in _FILLS_LIKE:
        ins = []  # the input gives the shape and dtype only
    nbytes = sum(t.numel() * t.element_size() for t in ins + outs)
    formula = flop_registry.get(func._overloadpacket)
    flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
    floats = [t for t in ins if t.is_floating_point()]
    dtype = str(floats[0].dtype).removeprefix("torch.") if floats else "float32"
    return OpCost(name, flops, nbytes, dtype, formula is not None)


class _Recorder(TorchDispatchMode):
    def __init__(self, out: list[OpCost]) -> None:
        super().__init__()
        self.out = out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        cost = _cost(func, args, kwargs, result)
        if cost is not None:
            self.out.append(cost)
        return result


@contextlib.contextmanager
def recording() -> Iterator[list[OpCost]]:
    """Inside the block every ATen operator that moves data is appended to the list yielded."""
    ops: list[OpCost] = []
    with _Recorder(ops):
        yield ops
