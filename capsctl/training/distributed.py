"""Training under ``torchrun``: process-group facts and the collective steps it needs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

__all__ = ["Distributed"]


@dataclass
class Distributed:
    """Process-group facts for a run started by ``torchrun`` (one process: a no-op).

    ``torchrun --nproc_per_node=N -m capsctl train ...`` sets ``RANK``, ``WORLD_SIZE`` and
    ``LOCAL_RANK``; each process then trains on its slice of every global batch with
    DistributedDataParallel (gloo on CPU, NCCL on CUDA) and only rank 0 writes files and logs.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    initialized_here: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device: torch.device) -> Distributed:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls(device=device)
        import torch.distributed as tdist

        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device.type == "cuda":
            device = torch.device("cuda", local)
            torch.cuda.set_device(device)
        here = False
        if not tdist.is_initialized():
            tdist.init_process_group("nccl" if device.type == "cuda" else "gloo")
            here = True
        return cls(rank, world, local, device, here)

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.world_size == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.local_rank] if self.device.type == "cuda" else None
        _standard_strides(model)
        return DistributedDataParallel(model, device_ids=ids)

    def any_flags(self, *flags: bool) -> tuple[bool, ...]:
        """Logical OR of each flag over all processes."""
        if self.world_size == 1:
            return tuple(bool(f) for f in flags)
        import torch.distributed as tdist

        t = torch.tensor([float(f) for f in flags], device=self.device)
        tdist.all_reduce(t)
        return tuple(bool(v > 0) for v in t.tolist())

    def sum_stats(self, loss_sum: Tensor, correct: Tensor, seen: int) -> tuple[Tensor, Tensor, int]:
        if self.world_size == 1:
            return loss_sum, correct, seen
        import torch.distributed as tdist

        t = torch.stack(
            [
                loss_sum.double(),
                correct.double(),
                torch.tensor(float(seen), device=self.device, dtype=torch.float64),
            ]
        )
        tdist.all_reduce(t)
        return t[0], t[1].round().long(), int(t[2].item())

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as tdist

            tdist.barrier()

    def close(self) -> None:
        if self.initialized_here:
            import torch.distributed as tdist

            tdist.destroy_process_group()


def _standard_strides(model: nn.Module) -> None:
    """Give a 1x1 kernel (``[o, i, 1, 1]``) the channels-last strides its gradient has. Such a
    kernel is contiguous in both formats, so it keeps the standard strides ``[i, 1, 1, 1]``
    when the model goes channels-last, but the convolution's backward pass on channels-last
    features returns its gradient with ``[i, 1, i, i]``; DDP compares strides literally and
    warned "Grad strides do not match bucket view strides" at every step. Only the strides of
    size-1 dimensions change, never the memory order."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Conv2d) and module.kernel_size == (1, 1):
                w = module.weight
                if w.is_contiguous(memory_format=torch.channels_last):
                    relaid = torch.empty_like(w, memory_format=torch.channels_last)
                    module.weight.data = relaid.copy_(w)
