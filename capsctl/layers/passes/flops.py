"""A tally of the routing's elementwise multiply-accumulates, for FLOP counts.

:class:`torch.utils.flop_counter.FlopCounterMode` counts matrix products and convolutions but
not the elementwise work that makes up much of a routing procedure (agreements, weighted sums
of votes, means, variances and likelihoods computed as products and sums). Each routing kernel
reports that work here, computed from its shapes (2 FLOPs per multiply-accumulate), and
:func:`capsctl.compare.flops.count_flops` adds it to the counter's total.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_TALLIES: list[list[int]] = []


@contextlib.contextmanager
def routing_flop_tally() -> Iterator[list[int]]:
    """Inside the block, kernels add their routing FLOPs to the yielded one-element list."""
    tally = [0]
    _TALLIES.append(tally)
    try:
        yield tally
    finally:
        _TALLIES.remove(tally)


def add_routing_flops(flops: int) -> None:
    """Report ``flops`` of elementwise routing work (a no-op unless a tally is open)."""
    for tally in _TALLIES:
        tally[0] += int(flops)
