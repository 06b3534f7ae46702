"""How much vote-sized work one chunk holds, per kind of device.

The routed passes (capsctl/layers/routing.py, weighted_pass.py, em_kernels.py, self_routing.py)
never hold the vote tensor: they build it chunk by chunk. On a CPU a chunk is sized to stay in
the last-level cache (a few MiB: each module's own constant), because every pass over a chunk
then runs at cache speed instead of memory speed.

On an accelerator the trade-off is different. Each chunk costs a handful of kernel launches
(about 5-10 us each), and memory bandwidth is three orders of magnitude higher than a CPU
core's: a 2 MiB chunk is read in about half a microsecond at the 4.8 TB/s of an H200, so small
chunks would leave the device idle between launches. A chunk must be a few tens of MiB before
its memory traffic outweighs the launch overhead; at :data:`DEVICE_CHUNK_BYTES` = 64 MiB it
takes about 14 us at that bandwidth (about as long as two launches), while the few
chunk-sized buffers stay a negligible share of the device's memory. Beyond that, larger
chunks only add memory: the passes are bandwidth-bound either way.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["DEVICE_CHUNK_BYTES", "chunk_bytes"]

DEVICE_CHUNK_BYTES = 64 * 2**20


def chunk_bytes(like: Tensor, cpu_bytes: int) -> int:
    """Bytes of votes per chunk for tensors on ``like``'s device: ``cpu_bytes`` on a CPU,
    :data:`DEVICE_CHUNK_BYTES` on an accelerator."""
    return cpu_bytes if like.device.type == "cpu" else DEVICE_CHUNK_BYTES
