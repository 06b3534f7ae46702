"""FLOPs of one forward pass, counted by :class:`torch.utils.flop_counter.FlopCounterMode`.

FLOPs are ``2 x`` multiply-accumulates of one forward pass per image. That counter counts
matrix products and convolutions (``mm``, ``addmm``, ``bmm``, ``convolution``...); the
routing's elementwise multiply-accumulates (agreement dot products, coefficient-weighted sums
of votes, EM's means, variances and likelihoods) are added as each routing algorithm reports
them (:mod:`capsctl.layers.flops`). Softmax, LayerNorm, BatchNorm and activations are not
counted. A plain forward pass is what our model
computes; concurrent routing skips the routed passes that cannot reach the output (with T=2
only the class layer is routed). ``all_passes=True`` counts ``model(x, trace=True)``, which
computes every pass of every layer, as the authors' implementation does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from capsctl.errors import UsageError

__all__ = ["FLOPS_NOTE", "count_flops"]

FLOPS_NOTE = (
    "FLOPs = 2 x multiply-accumulates, counted by torch.utils.flop_counter.FlopCounterMode for "
    "one forward pass (batch 2, divided by 2, eval mode) for convolutions and matrix products "
    "(conv, mm, addmm, bmm), plus the routing's elementwise multiply-accumulates (agreements, "
    "weighted sums of votes, EM statistics) as each routing algorithm reports them; softmax, "
    "normalization and activations are not counted; gflops_all_passes also counts the routed "
    "passes that cannot reach the output (every pass, as the authors' code computes them)"
)


def count_flops(model: nn.Module, input_shape: Sequence[int], *, all_passes: bool = False) -> float:
    """GFLOPs (``2 x`` multiply-accumulates, per image) of one forward pass of ``model``.

    ``input_shape`` is one image's ``(C, H, W)``. The model runs in eval mode under
    ``torch.no_grad`` on a batch of 2 (so batch-size-1 special cases do not matter) and the
    count is halved; its training mode is restored afterwards. ``all_passes=True`` calls
    ``model(x, trace=True)`` (capsule nets: every routing pass is computed). Counted: what
    :class:`~torch.utils.flop_counter.FlopCounterMode` counts (convolutions and matrix
    products) plus the routing's elementwise multiply-accumulates reported by the routing
    kernels (:mod:`capsctl.layers.flops`).
    """
    from torch.utils.flop_counter import FlopCounterMode

    from capsctl.layers import dispatch, routing_flop_tally

    shape = [int(v) for v in input_shape]
    if len(shape) != 3 or min(shape) < 1:
        raise UsageError(f"input shape must be (channels, height, width), got {tuple(shape)}")
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    dtype = first.dtype if first is not None and first.is_floating_point() else torch.float32
    x = torch.randn(2, *shape, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    was_training = model.training
    model.eval()
    try:
        counter = FlopCounterMode(display=False)
        # the torch code, whose matrix products the counter sees (the compiled loops and the
        # fused kernels build the votes where it cannot): the same count whatever would run
        with torch.no_grad(), dispatch.use("chunked"), counter, routing_flop_tally() as routing:
            if all_passes:
                model(x, trace=True)
            else:
                model(x)
    finally:
        model.train(was_training)
    return (counter.get_total_flops() + routing[0]) / 2 / 1e9
