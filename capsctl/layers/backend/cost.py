"""Fused or dense on a CUDA device: which one a vote-sized pass runs, from a cost model.

On a GPU a pass over the votes ``V[J, B, a, m, c] = X W`` (letters of
capsctl/layers/passes/routed.py; ``x`` the child pose width) runs either the fused Triton
kernels (the votes built on chip and never stored, built again in the backward) or the dense
torch expression (the votes materialized once through cuBLAS and read back). Per training
step of the pass, with ``V`` vote entries of ``e`` bytes:

- fused: ``2x + 4`` FLOPs a vote entry forward (the votes, the agreement, the weighted sum)
  and ``3 (2x) + 5`` backward (the votes again; ``dX`` and ``dW``, each a product of the
  votes' size; the coefficients' gradient), all at the tensor cores' rate, the inputs read
  once;
- dense: ``2x`` forward and ``4x`` backward at cuBLAS's rate (the same products, once each),
  and the votes' bytes at the memory's rate: written once and read twice forward, read twice
  and their gradient written once and read twice backward, ``8 V e`` bytes (both passes
  also read the child poses and the weights forward and backward); it keeps the
  votes and their gradient, ``2 V e`` bytes, which must fit :data:`DENSE_BUDGET_BYTES`
  (``CAPSCTL_DENSE_BUDGET_MB``).

The rates are the H100 figures the ahead-of-time report models with
(capsctl/layers/backend/triton/aot_cost.py, docs/GPU.md): a bf16 or tf32 tensor-core rate at
55% for the fused products (float32 products run as three tf32 ones), float32's 67 TFLOP/s
for cuBLAS in float32 (torch's default: no TF32), HBM at 80% of 3.35 TB/s. The fused pass is
compute bound and the dense one memory bound, so the line between them moves with a GPU's
FLOPs per byte. On an H100 the model finds the fused pass cheaper in float32 at every size and
in bf16 up to child pose widths of about 1,600, past every bundled model's (36 at most): the
dense pass is there for shapes beyond them.

Pure Python: no torch, no Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

from capsctl.environment import positive
from capsctl.layers.backend.triton.aot_cost import H100

__all__ = [
    "BUDGET_ENV",
    "DENSE_BUDGET_BYTES",
    "VoteShape",
    "cuda_path",
    "dense_budget",
    "dense_bytes",
    "dense_us",
    "fused_us",
]

#: Bytes the dense pass may keep for its votes and their gradient, by default (1 GiB).
DENSE_BUDGET_BYTES = 1 << 30
#: Environment variable: the dense pass's budget in MiB instead.
BUDGET_ENV = "CAPSCTL_DENSE_BUDGET_MB"


@dataclass(frozen=True)
class VoteShape:
    """The sizes of a pass's votes: ``j`` children, ``b`` parent sites, ``m`` parents,
    ``a x c`` parent poses, ``x`` the child pose width."""

    j: int
    b: int
    m: int
    a: int
    c: int
    x: int

    @classmethod
    def of(cls, x_shape: tuple[int, ...], w_shape: tuple[int, ...]) -> VoteShape:
        """From the child poses ``x[J, B, a, x]`` and weights ``w[J, x, m, c]``, the sizes as
        given: no ``int()``, which would fix a traced (symbolic) batch size for good; only the
        cost model reads them as numbers, on a CUDA device outside tracing."""
        j, b, a, xd = x_shape
        return cls(j=j, b=b, m=w_shape[2], a=a, c=w_shape[3], x=xd)

    @property
    def entries(self) -> int:
        """``V = J B m a c``, the vote entries."""
        return self.j * self.b * self.m * self.a * self.c


def _rates(itemsize: int) -> tuple[float, float]:
    """FLOP/s of the fused products and of cuBLAS's for inputs of ``itemsize`` bytes."""
    tensor = H100["tensor_core_efficiency"]
    if itemsize == 2:
        rate = H100["bf16_flops"] * tensor
        return rate, rate
    if itemsize == 4:
        return H100["tf32_flops"] * tensor / 3, H100["fp32_flops"]
    return H100["fp32_flops"] / 2, H100["fp32_flops"] / 2  # float64


def _bandwidth() -> float:
    return H100["hbm_bytes_per_s"] * H100["hbm_efficiency"]


def _input_bytes(shape: VoteShape, itemsize: int) -> int:
    """The child poses and the weights, read forward and backward by either pass."""
    elements = shape.j * shape.b * shape.a * shape.x + shape.j * shape.x * shape.m * shape.c
    return 2 * elements * itemsize


def fused_us(shape: VoteShape, itemsize: int) -> float:
    """Modelled µs of the fused pass's training step (module docstring)."""
    flops = (2 * shape.x + 4 + 3 * 2 * shape.x + 5) * shape.entries
    return max(flops / _rates(itemsize)[0], _input_bytes(shape, itemsize) / _bandwidth()) * 1e6


def dense_us(shape: VoteShape, itemsize: int) -> float:
    """Modelled µs of the dense pass's training step (module docstring)."""
    flops = 6 * shape.x * shape.entries
    nbytes = 8 * shape.entries * itemsize + _input_bytes(shape, itemsize)
    return (flops / _rates(itemsize)[1] + nbytes / _bandwidth()) * 1e6


def dense_bytes(shape: VoteShape, itemsize: int) -> int:
    """Bytes the dense pass keeps: the votes and their gradient."""
    return 2 * shape.entries * itemsize


def dense_budget() -> int:
    """:data:`DENSE_BUDGET_BYTES`, or ``CAPSCTL_DENSE_BUDGET_MB`` MiB where that is set (a
    positive number; a bad value is a UsageError naming it)."""
    mib = positive(BUDGET_ENV)
    return DENSE_BUDGET_BYTES if mib is None else int(mib * (1 << 20))


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def cuda_path(shape: VoteShape, itemsize: int, budget: int | None = None) -> tuple[str, str]:
    """``("triton" | "dense", reason)``: the cheaper pass by the model where the dense one's
    votes fit ``budget`` bytes (:func:`dense_budget` by default), else the fused one."""
    budget = dense_budget() if budget is None else budget
    fused, dense = fused_us(shape, itemsize), dense_us(shape, itemsize)
    need = dense_bytes(shape, itemsize)
    times = f"modelled {fused:.0f} µs fused, {dense:.0f} µs dense"
    if dense < fused and need <= budget:
        return "dense", f"materialized votes are cheaper here ({times}; {_size(need)} kept)"
    if dense < fused:
        return "triton", f"{times}, but the dense votes ({_size(need)}) pass the budget"
    return "triton", times
