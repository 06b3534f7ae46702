"""The Triton kernels' launches captured without a GPU, for an ahead-of-time report.

:func:`capture_step` runs one training step of a model (forward, cross-entropy, backward) on
fake CPU tensors (``torch._subclasses.FakeTensorMode``: shapes, dtypes and strides, no data,
no arithmetic) with the fused passes forced on (``dispatch.use("triton")``). The custom ops of
ops.py and em_ops.py run their own Python code (their fake implementations are bypassed), so
every buffer they allocate and every argument they pass is the real one; only the kernels'
launches (``kernel[grid](...)``) are replaced by a recorder. Each :class:`Launch` keeps what
Triton specializes a compiled variant on, as its JIT launcher would: each argument's type
(pointer element type, ``i32``/``i64``, ``fp32``), the divisibility by 16 of integers and of
pointers (a CUDA allocation is 256-byte aligned, so a pointer's alignment is its storage offset
in bytes), integers equal to 1 (turned into constants), and the constexprs. Launches with the
same :attr:`Launch.key` are one compiled variant (capsctl/layers/backend/triton/aot_compile.py
compiles them); the tensors' sizes feed the cost model (aot_cost.py).

Under bf16 autocast the step runs with CPU autocast (``torch.autocast("cpu")``), since fake
CUDA tensors cannot run autograd without a device; the routing passes cast their inputs to
float32 themselves (capsctl/layers/capsules.py, routers/selfrouting.py, routers/em/), so the
kernels see the dtypes a CUDA step gives them.

Nothing here imports Triton or the kernels at import time.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from capsctl.layers.backend import dispatch
from capsctl.layers.backend.triton.aot_compile import ARCHS, Compiler, arch_name, arch_number
from capsctl.layers.backend.triton.aot_cost import (
    BUDGETS,
    H100,
    broken_budgets,
    launch_cost,
    modelled_us,
    op_us,
)
from capsctl.layers.backend.triton.aot_ops import OpCost, recording
from capsctl.layers.backend.triton.aot_report import (
    Variant,
    budget_summary,
    describe,
    group_variants,
    step_summary,
    step_table,
    variant_row,
)

__all__ = [
    "ARCHS",
    "BUDGETS",
    "H100",
    "KERNEL_NAMES",
    "Compiler",
    "Launch",
    "OpCost",
    "Variant",
    "arch_name",
    "arch_number",
    "broken_budgets",
    "budget_summary",
    "capture_step",
    "capturing",
    "describe",
    "group_variants",
    "launch_cost",
    "modelled_us",
    "op_us",
    "step_summary",
    "step_table",
    "variant_row",
]

#: The JIT kernels a launch can name, by module of capsctl/layers/backend/triton/.
KERNEL_NAMES = {
    "kernels": ("pass_forward", "pass_backward", "pass_input_grad", "pass_weight_grad"),
    "em": ("em_forward", "em_backward", "em_input_grad", "em_weight_grad"),
    "em_estep": (
        "em_estep_stats",
        "em_estep_moments",
        "em_estep_rowdot",
        "em_estep_parent_grad",
        "em_estep_input_grad",
        "em_estep_weight_grad",
    ),
    "gate": ("gate_forward", "gate_backward"),
    "squash": ("squash_forward", "squash_backward"),
    "estep": ("estep_forward", "estep_rowdot", "estep_backward"),
    "mstep": ("m_step_forward", "m_step_backward"),
    "overlap": ("overlap_reduce", "overlap_lse"),
}
# launch options a variant is compiled with (the rest of a launch's keywords are arguments)
_OPTIONS = ("num_warps", "num_stages")
# Triton's names of torch's dtypes, in pointer signatures ("*fp32")
_TRITON_TYPES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float64: "fp64",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
}


@dataclass(frozen=True)
class Launch:
    """One captured launch: ``kernel`` (its name), ``grid``; ``signature`` (parameter, Triton
    type or ``"constexpr"``), ``constexprs`` (parameter, value; a Triton dtype as its name such
    as ``"tl.fp32"``), ``divisible`` (parameters specialized as divisible by 16), and for the
    cost model ``tensors`` (parameter, shape, dtype, identity: one tensor passed twice counts
    once) and ``scalars`` (parameter, value) as passed; ``options``: the launch options given
    (``num_warps``, ``num_stages``), which the variant is compiled with."""

    kernel: str
    grid: tuple[int, ...]
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, Any], ...]
    divisible: tuple[str, ...]
    tensors: tuple[tuple[str, tuple[int, ...], str, int], ...]
    scalars: tuple[tuple[str, Any], ...]
    options: tuple[tuple[str, int], ...] = ()

    @property
    def key(self) -> str:
        """What Triton compiles one variant for: kernel, signature, constexprs, divisibility."""
        spec = json.dumps(self.spec(), sort_keys=True)
        return f"{self.kernel}-{hashlib.sha1(spec.encode()).hexdigest()[:10]}"

    def spec(self) -> dict[str, Any]:
        """The JSON-able description aot_compile.py compiles."""
        return {
            "kernel": self.kernel,
            "signature": dict(self.signature),
            "constexprs": dict(self.constexprs),
            "divisible": list(self.divisible),
            "options": dict(self.options),
        }

    def value(self, name: str) -> Any:
        """A scalar or constexpr argument by name (integers equal to 1 are constexprs)."""
        return {**dict(self.scalars), **dict(self.constexprs)}[name]


def _plain(value: Any) -> Any:
    """A constexpr as JSON: Triton dtypes by name, numbers and booleans as they are."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return f"tl.{value.name}"  # a triton.language dtype: "tl.fp32"


def _specialized(value: Any) -> tuple[str, Any]:
    """Triton's own specialization of a non-tensor argument: ``(type, "D" | "" | None)``, or
    ``("constexpr", 1)`` for an integer equal to 1."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return native_specialize_impl(BaseBackend, value, False, True, True)


def _launch_of(kernel: Any, grid: Sequence[int], args: tuple, kwargs: dict) -> Launch:
    """The :class:`Launch` of ``kernel[grid](*args, **kwargs)`` (a JIT or interpreted
    function: both keep the Python function as ``.fn``)."""
    params = inspect.signature(kernel.fn).parameters
    given = dict(zip(list(params)[: len(args)], args, strict=True))
    bound = {**{p.name: p.default for p in params.values()}, **given, **kwargs}
    sig, const, div, tensors, scalars = [], [], [], [], []
    for p in params.values():
        v = bound[p.name]
        if "constexpr" in str(p.annotation):
            sig.append((p.name, "constexpr"))
            const.append((p.name, _plain(v)))
        elif isinstance(v, torch.Tensor):
            sig.append((p.name, "*" + _TRITON_TYPES[v.dtype]))
            if (v.storage_offset() * v.element_size()) % 16 == 0:
                div.append(p.name)
            tensors.append((p.name, tuple(v.shape), str(v.dtype).removeprefix("torch."), id(v)))
        else:
            kind, spec = _specialized(v)
            sig.append((p.name, kind))
            if kind == "constexpr":
                const.append((p.name, v))
            else:
                scalars.append((p.name, v))
                div += [p.name] if spec == "D" else []
    options = tuple((k, int(kwargs[k])) for k in _OPTIONS if k in kwargs)
    return Launch(
        kernel.fn.__name__, tuple(grid), tuple(sig), tuple(const), tuple(div), tuple(tensors),
        tuple(scalars), options,
    )  # fmt: skip


class _Recorder:
    """Stands in for a JIT kernel: ``kernel[grid](...)`` records a :class:`Launch` and runs
    nothing (the outputs keep what their allocation left in them)."""

    def __init__(self, kernel: Any, out: list[Launch]) -> None:
        self.kernel, self.out = kernel, out
        self.fn = kernel.fn

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return functools.partial(self._record, grid)

    def _record(self, grid: Any, *args: Any, **kwargs: Any) -> None:
        self.out.append(_launch_of(self.kernel, grid, args, kwargs))


def _python_ops_mode() -> Any:
    """A dispatch mode under which the ``capsctl::triton_*`` ops run their Python code (the
    CPU kernel) also on fake tensors, instead of their fake implementations."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class PythonOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func.namespace == "capsctl" and func.__name__.startswith("triton_"):
                keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
                return func.redispatch(keys, *args, **(kwargs or {}))
            return func(*args, **(kwargs or {}))

    return PythonOps()


@contextlib.contextmanager
def _patched(items: Sequence[tuple[Any, str, Any]]) -> Iterator[None]:
    old = [(obj, name, getattr(obj, name)) for obj, name, _ in items]
    try:
        for obj, name, value in items:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(old):
            setattr(obj, name, value)


@contextlib.contextmanager
def capturing() -> Iterator[list[Launch]]:
    """Inside the block the passes take the Triton kernels on any CPU tensor (the dispatch's
    device check and self-test skipped, and the one-time proof of a pass's backward), the
    custom ops run their own code and each kernel launch is appended to the list yielded, not
    run."""
    from capsctl.layers.backend.triton import (  # noqa: F401
        em,
        em_estep,
        em_ops,
        estep,
        estep_moments_ops,
        estep_ops,
        gate,
        gate_ops,
        kernels,
        mstep,
        mstep_ops,
        ops,
        overlap,
        overlap_ops,
        squash,
        squash_ops,
    )

    launches: list[Launch] = []
    modules = {"kernels": kernels, "em": em, "gate": gate, "squash": squash, "estep": estep}
    modules["mstep"] = mstep
    modules["em_estep"] = em_estep
    modules["overlap"] = overlap
    # the launches a GPU gets: not the interpreter's (ops.kernel_meta widens 16-bit products
    # for it)
    items = [(dispatch, "triton_status", lambda device: ""), (ops, "interpreted", lambda: False)]
    # a pass's backward proven once at new shapes (dispatch.run_fused) runs in a training's
    # first step only, not in the step modelled here
    items += [(dispatch, "_backward_once", lambda call, inputs: None)]
    items += [(dispatch, "_FUSED_PROVEN", set())]
    for mod, names in KERNEL_NAMES.items():
        items += [(modules[mod], n, _Recorder(getattr(modules[mod], n), launches)) for n in names]
    with _patched(items), dispatch.use("triton"), _python_ops_mode():
        yield launches


def capture_step(
    net: nn.Module,
    images: Sequence[int],
    classes: int,
    amp: bool = False,
    ops: list[OpCost] | None = None,
) -> list[Launch]:
    """The kernel launches of one training step of ``net`` (forward on a batch of fake images
    of shape ``images`` = ``(batch, channels, height, width)``, cross-entropy against
    ``classes`` labels, backward), in float32 or under bf16 autocast (``amp``); ``ops``: a list
    that receives every torch operator of the step beside the kernels, with its FLOPs and bytes
    (aot_ops.py). ``net`` is turned into fake tensors in place (its values are lost: rebuild it
    to use it again)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True):
        warnings.simplefilter("ignore")  # data_ptr() of fake tensors, read by layout.py
        net.to_empty(device="cpu")
        x = torch.empty(*images)
        y = torch.zeros(images[0], dtype=torch.long).clamp(max=classes - 1)
        # the operators are recorded below the mode that runs the passes' Python code
        with recording() as seen, capturing() as launches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                logits = net(x)
            F.cross_entropy(logits.float(), y).backward()
    if ops is not None:
        ops.extend(seen)
    return launches
