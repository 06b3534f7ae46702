"""Chunk sizes of the routed passes per kind of device (capsctl/layers/backend/chunks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from capsctl.errors import UsageError
from capsctl.layers import chunks
from capsctl.layers.backend.chunks import (
    chunk_bytes,
    last_level_cache,
    tile_shape,
    vote_chunk_bytes,
)


def test_a_cpu_keeps_its_cache_sized_chunks() -> None:
    assert chunk_bytes(torch.empty(1), 2 * 2**20) == 2 * 2**20


def test_an_accelerator_gets_chunks_of_tens_of_mebibytes() -> None:
    """On a device with kernel launches of microseconds and TB/s of bandwidth a chunk of a few
    MiB is read in well under a launch: chunks there are at least 32 MiB."""
    on_device = torch.empty(1, device="meta")
    assert chunk_bytes(on_device, 2 * 2**20) >= 32 * 2**20


def test_a_larger_budget_makes_fewer_tiles() -> None:
    # J=288 children, B=1568 sites, m=32 types, d=16, float32: 2 KiB of votes per site
    small = tile_shape(288, 1568, 32, 16, 4, budget=2 * 2**20)
    large = tile_shape(288, 1568, 32, 16, 4, budget=64 * 2**20)
    tiles = [-(-288 // jc) * -(-1568 // bc) for jc, bc in (small, large)]
    assert tiles[1] < tiles[0]
    for jc, bc in (small, large):
        assert jc * bc * 32 * 16 * 4 <= max(64 * 2**20, 2 * 2**20)


def _cache_folder(root: Path, entries: list[tuple[str, str]]) -> str:
    for i, (level, size) in enumerate(entries):
        index = root / f"index{i}"
        index.mkdir(parents=True)
        (index / "level").write_text(level + "\n")
        (index / "size").write_text(size + "\n")
    return str(root)


def test_the_last_level_cache_is_read_from_sysfs(tmp_path: Path) -> None:
    root = _cache_folder(
        tmp_path / "a", [("1", "32K"), ("1", "32K"), ("2", "512K"), ("3", "32768K")]
    )
    assert last_level_cache(root) == 32 * 2**20
    assert last_level_cache(_cache_folder(tmp_path / "b", [("2", "1M"), ("1", "48K")])) == 2**20
    # unreadable or absent: an assumed 16 MiB
    assert last_level_cache(_cache_folder(tmp_path / "c", [("x", "??")])) == 16 * 2**20
    assert last_level_cache(str(tmp_path / "none")) == 16 * 2**20


def test_a_cpu_chunk_is_a_sixteenth_of_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CAPSCTL_CHUNK_MIB", raising=False)
    cpu = torch.empty(1)
    monkeypatch.setattr(chunks, "last_level_cache", lambda: 32 * 2**20)
    assert vote_chunk_bytes(cpu) == 2 * 2**20
    monkeypatch.setattr(chunks, "last_level_cache", lambda: 8 * 2**20)
    assert vote_chunk_bytes(cpu) == 2**20  # never below 1 MiB
    monkeypatch.setattr(chunks, "last_level_cache", lambda: 2**30)
    assert vote_chunk_bytes(cpu) == 16 * 2**20  # nor above 16 MiB
    assert vote_chunk_bytes(cpu, 700) == 700  # a module's fixed size wins
    assert vote_chunk_bytes(torch.empty(1, device="meta"), 700) == 64 * 2**20


def test_the_environment_sets_the_chunk_on_every_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunks, "last_level_cache", lambda: 32 * 2**20)
    cpu = torch.empty(1)
    monkeypatch.setenv("CAPSCTL_CHUNK_MIB", "8")
    assert vote_chunk_bytes(cpu) == 8 * 2**20
    monkeypatch.setenv("CAPSCTL_CHUNK_MIB", " 0.5 ")
    assert vote_chunk_bytes(cpu) == 2**19  # the user's choice, not clamped
    assert vote_chunk_bytes(cpu, 700) == 700
    assert vote_chunk_bytes(torch.empty(1, device="meta")) == 2**19  # an accelerator's too
    monkeypatch.delenv("CAPSCTL_CHUNK_MIB")
    assert vote_chunk_bytes(torch.empty(1, device="meta")) == 64 * 2**20
    monkeypatch.setenv("CAPSCTL_CHUNK_MIB", "8")
    for bad in ("0", "-2", "lots", "inf", "nan"):
        monkeypatch.setenv("CAPSCTL_CHUNK_MIB", bad)
        with pytest.raises(UsageError, match="CAPSCTL_CHUNK_MIB must be a positive number"):
            vote_chunk_bytes(cpu)


def test_the_environment_changes_the_tiles_of_a_routed_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The routed pass takes its budget from the variable (fewer sites per tile when small)."""
    monkeypatch.setenv("CAPSCTL_CHUNK_MIB", "64")
    x = torch.empty(1)
    big = chunks.tile_shape(288, 1568, 32, 16, 4, budget=chunks.tile_budget(x))
    monkeypatch.setenv("CAPSCTL_CHUNK_MIB", "1")
    small = chunks.tile_shape(288, 1568, 32, 16, 4, budget=chunks.tile_budget(x))
    assert small[0] * small[1] < big[0] * big[1]


@pytest.mark.parametrize("bad", ["abc", "0", "-2", "1.5", "two"])
def test_a_bad_routing_thread_count_is_a_usage_error(
    bad: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CAPSCTL_ROUTING_THREADS", bad)
    with pytest.raises(UsageError) as info:
        chunks.site_workers(torch.zeros(1))
    message = str(info.value)
    assert "CAPSCTL_ROUTING_THREADS" in message and repr(bad) in message
    assert "positive whole number" in message and "\n" not in message


def test_an_empty_routing_thread_count_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPSCTL_ROUTING_THREADS", " ")
    assert chunks.site_workers(torch.zeros(1)) == max(1, torch.get_num_threads())
    monkeypatch.setenv("CAPSCTL_ROUTING_THREADS", " 3 ")
    assert chunks.site_workers(torch.zeros(1)) == 3
