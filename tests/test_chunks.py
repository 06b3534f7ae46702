"""Chunk sizes of the routed passes per kind of device (capsctl/layers/chunks.py)."""

from __future__ import annotations

import torch

from capsctl.layers.chunks import chunk_bytes
from capsctl.layers.routing import _tiles


def test_a_cpu_keeps_its_cache_sized_chunks() -> None:
    assert chunk_bytes(torch.empty(1), 2 * 2**20) == 2 * 2**20


def test_an_accelerator_gets_chunks_of_tens_of_mebibytes() -> None:
    """On a device with kernel launches of microseconds and TB/s of bandwidth a chunk of a few
    MiB is read in well under a launch: chunks there are at least 32 MiB."""
    on_device = torch.empty(1, device="meta")
    assert chunk_bytes(on_device, 2 * 2**20) >= 32 * 2**20


def test_a_larger_budget_makes_fewer_tiles() -> None:
    # J=288 children, B=1568 sites, m=32 types, d=16, float32: 2 KiB of votes per site
    small = _tiles(288, 1568, 32, 16, 4, budget=2 * 2**20)
    large = _tiles(288, 1568, 32, 16, 4, budget=64 * 2**20)
    tiles = [-(-288 // jc) * -(-1568 // bc) for jc, bc in (small, large)]
    assert tiles[1] < tiles[0]
    for jc, bc in (small, large):
        assert jc * bc * 32 * 16 * 4 <= max(64 * 2**20, 2 * 2**20)
