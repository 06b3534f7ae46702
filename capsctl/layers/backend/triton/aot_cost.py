"""A cost model of the Triton kernels on an H100 SXM, and the budgets a compiled variant must
keep (docs/GPU-KERNELS.md).

Modelled time of a launch = ``max(bytes / (0.8 * 3.35e12), FLOPs / rate) * 1e6 + 5`` µs
(docs/GPU.md's public H100 figures: HBM3 3.35 TB/s at about 80%; a dense bf16 tensor-core rate
of 989 TFLOP/s and tf32 of 494 TFLOP/s at 55%; 67 TFLOP/s in float32 without tensor cores; 5 µs
a launch). The tensor-core rates count only where the variant's PTX has MMA instructions
(``mma``, ``wgmma``, ``tcgen05.mma``): bf16 for 16-bit inputs, tf32 for float32; else 67.

Bytes: every distinct tensor argument of the launch once (its elements times their size): what
the kernel must read or write at least. Re-reads through L2 and the read-modify-write of
atomic adds are not charged (the PTX's atomic counts and the budgets show those).

FLOPs, with ``V = J B m a c`` vote entries (``J`` children, ``B`` parent sites, ``m`` parents,
``a x c`` parent poses) and ``X`` the child pose width (``x``): building the votes is ``2X``
per entry; a weighted sum or an agreement 2, a product 1. Per vote entry:

- routed forward ``2X + 4`` (votes, agreement, weighted sum); weighted forward ``2X + 2``;
- routed/weighted backward, first kernel (``pass_backward``): ``2X + 2`` (votes again, ``dR``),
  routed ``+ 2`` if ``dP``; the input and weight gradients (``pass_input_grad``,
  ``pass_weight_grad``, no votes): ``1`` (``R G``), routed ``+ 2`` (``dA P``), ``+ 2X`` for
  ``dX`` or ``dW``;
- EM moments forward ``2X + 6`` (votes, shift, ``k U``, ``k U^2``); quadratic form ``2X + 5``;
- EM backward, first kernel (``em_backward``): ``2X + 5`` (votes, shift, the coefficients'
  gradients); the input and weight gradients (``em_input_grad``, ``em_weight_grad``): ``4X + 5``
  each (votes, shift, ``dV``, ``dX`` or ``dW``).
- EM's E-step fused into the moments (em_estep.py), ``R`` built again from the quadratic form
  (4) in every kernel: the statistics ``2X + 5``; the moments ``2X + 9``; the backward's
  ``T`` and ``dact`` (``em_estep_rowdot``) ``2X + 9`` (the quadratic form, ``g``); the
  operands' gradients (``em_estep_parent_grad``) ``2X + 13`` (``+ dQ U``, ``dQ U^2``); the
  input and weight gradients ``4X + 17`` (``R``, ``g`` and both terms of ``dV`` on top of the
  product's ``4X + 1``).

The softmax and other per-``(j, b, m)`` terms are ``1/(a c)`` of these and left out.

Self-routing's gate kernels (gate.py) have no votes: per coefficient entry ``(j, b, m)``, with
``D`` the child pose's size, the forward's logits are ``2D`` and its softmax and mass 5
(``2D + 5``); the backward's ``d act`` 2, softmax backward 5 and, where it computes ``dX``, ``2D``.
Dynamic routing's squash (squash.py), per entry of ``s[R, D]``: forward 3 (``|s|^2`` and the
scaling), backward 6 (``|s|^2``, ``s . G`` and ``f G + k s``). EM's E-step (estep.py), per
assignment entry of ``R`` rows of ``m``: forward 4 (``z``, the max or the shift, the exponential
and the sum or the division), ``sum R G`` 2, backward 5 (``R (G - t)``, ``-dz / 2``, ``dc``).
EM's M-step rest (mstep.py), per parent pose entry ``(b, j, h)``: about 20 forward (moments,
variance, its logarithm and inverse, costs, ``qp``, ``c``) and 60 backward (that again and
the gradients); elementwise work, far below the bytes' time. The reductions over a conv
child's windows (overlap.py): 1 per entry gathered (``CHILDREN K^2 E``, an upper bound: edge
children fall in fewer windows), 4 for the log-sum-exp; far below the bytes' time too.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BUDGETS",
    "H100",
    "NO_PRODUCTS",
    "broken_budgets",
    "flop_rate",
    "launch_cost",
    "launch_dims",
    "modelled_us",
    "op_us",
]

#: H100 SXM figures of docs/GPU.md (public spec sheet) and the shares of them planned on.
H100 = {
    "hbm_bytes_per_s": 3.35e12,
    "hbm_efficiency": 0.8,
    "bf16_flops": 989e12,
    "tf32_flops": 494e12,
    "tensor_core_efficiency": 0.55,
    "fp32_flops": 67e12,
    "launch_us": 5.0,
}
#: Kernels without a matrix product, of which the ``mma`` budget asks nothing: the squash's
#: (a norm and a scaling per capsule), the E-step's (a softmax per child entry) and the M-step's
#: (elementwise per parent).
NO_PRODUCTS = (
    "squash_forward",
    "squash_backward",
    "estep_forward",
    "estep_rowdot",
    "estep_backward",
    "m_step_forward",
    "m_step_backward",
    "overlap_reduce",
    "overlap_lse",
)
#: What every variant must keep on sm_90a (:func:`broken_budgets`).
BUDGETS = {
    "arch": "sm_90a",
    "spill_bytes": 0,
    "stack_bytes": 0,
    "registers": 168,
    "acq_rel_atomics": 0,
    "compile_s": 30.0,
    "mma": "present",
}
_ITEMSIZE = {"float64": 8, "float32": 4, "int32": 4, "int64": 8, "bfloat16": 2, "float16": 2}


def _flags(launch: Any) -> dict[str, Any]:
    return {**dict(launch.scalars), **dict(launch.constexprs)}


def _per_vote(kernel: str, f: dict[str, Any]) -> int:
    """FLOPs per vote entry of a launch (module docstring)."""
    x = int(f["XD"])
    if kernel == "pass_forward":
        return 2 * x + 4 if f["ROUTED"] else 2 * x + 2
    if kernel == "pass_backward":
        return 2 * x + 2 + (2 * int(bool(f["NEED_P"])) if f["ROUTED"] else 0)
    if kernel in ("pass_input_grad", "pass_weight_grad"):
        return 1 + (2 if f["ROUTED"] else 0) + 2 * x
    if kernel == "em_forward":
        return 2 * x + 5 if f["QUAD"] else 2 * x + 6
    if kernel == "em_backward":
        return 2 * x + 5
    if kernel in ("em_input_grad", "em_weight_grad"):
        return 4 * x + 5
    if kernel == "em_estep_stats":
        return 2 * x + 5
    if kernel in ("em_estep_moments", "em_estep_rowdot"):
        return 2 * x + 9
    if kernel == "em_estep_parent_grad":
        return 2 * x + 13
    if kernel in ("em_estep_input_grad", "em_estep_weight_grad"):
        return 4 * x + 17
    raise ValueError(f"no cost model for kernel {kernel!r}")


def launch_dims(launch: Any) -> tuple[str, ...]:
    """The size arguments of a launch's kernel: ``J, B, M, A, C, XD`` for the vote kernels,
    ``J, B, M, D`` for self-routing's gate."""
    if launch.kernel.startswith("gate_"):
        return ("J", "B", "M", "D")
    if launch.kernel.startswith("squash_"):
        return ("R", "D")
    if launch.kernel in ("estep_forward", "estep_rowdot"):
        return ("R", "M")
    if launch.kernel == "estep_backward":
        return ("J", "M")
    if launch.kernel.startswith("m_step_"):
        return ("B", "M", "D")
    if launch.kernel.startswith("overlap_"):
        return ("CHILDREN", "N", "K", "S")
    return ("J", "B", "M", "A", "C", "XD")


def _flops(kernel: str, f: dict[str, Any], grid: tuple[int, ...]) -> int:
    """A launch's FLOPs (module docstring)."""
    if kernel.startswith("squash_"):
        return (3 if kernel == "squash_forward" else 6) * int(f["R"]) * int(f["D"])
    if kernel == "estep_forward":
        return 4 * int(f["R"]) * int(f["M"])
    if kernel == "estep_rowdot":
        return 2 * int(f["R"]) * int(f["M"])
    if kernel == "estep_backward":
        return 5 * int(grid[0]) * int(f["J"]) * int(f["M"])  # a program per site
    if kernel.startswith("m_step_"):
        per = 20 if kernel == "m_step_forward" else 60
        return per * int(f["B"]) * int(f["M"]) * int(f["D"])
    if kernel.startswith("overlap_"):  # per gathered entry: a sum or max; lse 4
        gathered = int(f["CHILDREN"]) * int(f["K"]) ** 2 * int(f.get("E", 1))
        return gathered * (4 if kernel == "overlap_lse" else 1)
    j, b, m = int(f["J"]), int(f["B"]), int(f["M"])
    if kernel.startswith("gate_"):
        d = int(f["D"])
        if kernel == "gate_forward":
            return (2 * d + 5) * j * b * m
        return (7 + (2 * d if f["NEED_X"] else 0)) * j * b * m
    votes = j * b * m * int(f["A"]) * int(f["C"])
    return _per_vote(kernel, f) * votes


def launch_cost(launch: Any) -> dict[str, Any]:
    """``{"bytes", "flops", "dtype"}`` of a :class:`~capsctl.layers.backend.triton.aot.Launch`
    (``dtype``: the element type of its child poses ``x``, or of the weights ``w`` (``wr``) for a
    kernel that reads no poses, which picks the tensor-core rate)."""
    f = _flags(launch)
    seen: dict[int, int] = {}
    dtype = "float32"
    names = [t[0] for t in launch.tensors]
    poses = ("x_ptr", "w_ptr", "wr_ptr", "s_ptr", "q_ptr", "r_ptr", "src_ptr", "zmax_ptr")
    pose = next(n for n in poses if n in names)
    for name, shape, dt, ident in launch.tensors:
        numel = 1
        for n in shape:
            numel *= int(n)
        seen[ident] = numel * _ITEMSIZE[dt]
        dtype = dt if name == pose else dtype
    return {
        "bytes": sum(seen.values()),
        "flops": _flops(launch.kernel, f, launch.grid),
        "dtype": dtype,
    }


def flop_rate(dtype: str, mma: bool) -> tuple[float, str]:
    """FLOP/s and its name: a tensor-core rate (``bf16`` for 16-bit inputs, ``tf32`` for
    float32) at 55% where the PTX has MMAs, else float32 without tensor cores."""
    if not mma:
        return H100["fp32_flops"], "fp32"
    kind = "bf16" if dtype in ("bfloat16", "float16") else "tf32"
    return H100[f"{kind}_flops"] * H100["tensor_core_efficiency"], kind


def modelled_us(nbytes: float, flops: float, rate: float) -> float:
    """``max(bytes / (0.8 * 3.35e12), flops / rate)`` in µs, plus 5 µs of launch (*estimated*:
    a model, not a measurement)."""
    bandwidth = H100["hbm_bytes_per_s"] * H100["hbm_efficiency"]
    return max(nbytes / bandwidth, flops / rate) * 1e6 + H100["launch_us"]


def op_us(op: Any) -> float:
    """Modelled µs of one torch operator of a step (an aot_ops.py ``OpCost``): its bytes at
    the HBM's rate or its FLOPs at the tensor cores' (matrix products and convolutions) or
    float32's, whichever is longer, plus a launch (*estimated*)."""
    return modelled_us(op.bytes, op.flops, flop_rate(op.dtype, op.product)[0])


def broken_budgets(row: dict[str, Any], kernel: str | None = None) -> list[str]:
    """The :data:`BUDGETS` a compiled variant's row breaks (a variant that did not compile in
    time breaks ``compile_s``; one that failed, ``compiles``; a figure that could not be read
    counts as broken). The compile budget is checked on the compile's CPU seconds
    (``compile_cpu_s``, the worker's and ptxas's) where given, which the load of a shared
    machine does not inflate as it does the wall seconds (``compile_s``). ``mma`` is asked of
    every kernel with a matrix product (all but the squash's, :data:`NO_PRODUCTS`); the kernel
    is ``kernel`` or the row's ``kernel``."""
    if row.get("error"):
        return ["compiles"]
    if row.get("timed_out"):
        return ["compile_s"]
    figures = {k: row.get(k) for k in ("spill_bytes", "stack_bytes", "registers")}
    figures["acq_rel_atomics"] = row.get("acq_rel_atomics")
    figures["compile_s"] = row.get("compile_cpu_s", row.get("compile_s"))
    out = [k for k, v in figures.items() if v is None or v > BUDGETS[k]]  # None: unknown
    if (kernel or row.get("kernel")) in NO_PRODUCTS:
        return out
    return out + (["mma"] if not row.get("mma") else [])
