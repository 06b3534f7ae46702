"""One device resolver for every command.

``auto`` picks CUDA when available, then Apple's MPS, then the CPU. Explicit names are checked:
``cpu``, ``cuda``, ``cuda:N`` (N must exist) and ``mps``; anything else, or a device this machine
does not have, is a :class:`~capsctl.errors.UsageError` that says what to use instead.

:func:`flush_denormals` is the scope in which training and the bench run on a CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from capsctl.errors import UsageError

__all__ = [
    "autocast",
    "cpu_bf16_units",
    "denormals_flushed",
    "faster_in_bf16",
    "flush_denormals",
    "in_float32",
    "native_bf16",
    "resolve_amp",
    "resolve_device",
]

T = TypeVar("T")


def resolve_device(name: str) -> torch.device:
    """``auto``, ``cpu``, ``cuda[:N]`` or ``mps`` -> a usable :class:`torch.device`."""
    text = name.strip().lower()
    if text == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {name}: unknown; use auto, cpu, cuda, cuda:N or mps") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {name}: no CUDA device is available here; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(
                f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                "use cuda:0 or a lower index"
            )
        return dev
    if dev.type == "mps":
        if not _mps_available():
            raise UsageError(f"--device {name}: no MPS device is available here; use --device cpu")
        return dev
    raise UsageError(f"--device {name}: unknown; use auto, cpu, cuda, cuda:N or mps")


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def cpu_bf16_units() -> str:
    """The bf16 units of this CPU that torch's kernels use: ``"amx"`` (AMX tiles: oneDNN's bf16
    matrix products and convolutions run several times faster than in float32),
    ``"avx512_bf16"`` (AVX-512 BF16 alone: bf16 dot products, but converting to and from float32
    costs more than they save) or ``""`` (none)."""
    cpu = torch.cpu
    try:
        if cpu._is_amx_tile_supported():
            return "amx"
        if cpu._is_avx512_bf16_supported() or torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return "avx512_bf16"
    except (AttributeError, RuntimeError):
        pass
    return ""


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 natively: a CUDA device torch reports bf16 support for,
    or a CPU with AVX-512 BF16 or AMX (oneDNN's bf16 support)."""
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device.type == "cpu":
        return bool(cpu_bf16_units())
    return False


def faster_in_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether training on ``device`` is faster under bf16 autocast than in float32, and why
    (what ``train.amp: auto`` follows): a CUDA device with bf16, a CPU with AMX. A CPU with
    AVX-512 BF16 but no AMX trains slower in bf16: on a 2-core Xeon of that kind ResNet-18's
    step at batch 32 took 1.30-1.62x as long in bf16 as in float32, and every capsule model but
    EM's was slower too (docs/PERFORMANCE.md, "Precision")."""
    if device.type == "cpu":
        units = cpu_bf16_units()
        if units == "amx":
            return True, "the cpu has AMX"
        if units:
            return False, "the cpu has no AMX, so bf16 trains slower"
        return False, "the cpu has no native bf16"
    if native_bf16(device):
        return True, f"the {device.type} has native bf16"
    return False, f"the {device.type} has no native bf16"


def resolve_amp(amp: bool | str, device: torch.device) -> tuple[bool, str]:
    """``train.amp`` (``true``, ``false`` or ``auto``) on ``device``: whether training runs
    under bf16 autocast, and why (for the line that starts training). ``auto`` is bf16 where
    it trains faster (:func:`faster_in_bf16`)."""
    if amp is True:
        return True, "bf16 autocast (train.amp: true)"
    if amp is False:
        return False, "float32 (train.amp: false)"
    faster, why = faster_in_bf16(device)
    if faster:
        return True, f"bf16 autocast (train.amp: auto; {why})"
    return False, f"float32 (train.amp: auto; {why})"


def autocast(device: torch.device, amp: bool) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on ``device`` when ``amp``, else nothing."""
    if not amp:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def in_float32(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in float32, also under autocast: autocast off, and every floating-point
    tensor among ``args`` (also inside a tuple, such as the capsules a read-out takes) cast to
    float32. Outside autocast it is ``fn(*args)``.

    For the read-outs that turn class capsules into logits: a few hundred multiply-adds per
    image, whose sums must not keep bf16's rounding. The shared head's bias gradient, for one,
    is the sum of every class logit's gradient, which cancels to zero (softmax cross-entropy's
    gradients sum to zero over the classes): in bf16 what is left is the rounding of its terms
    (``2**-8`` of them, relative), in float32 it is ``2**-24`` of them."""
    tensors = [a for a in _flat(args) if isinstance(a, torch.Tensor)]
    if not tensors or not torch.is_autocast_enabled(tensors[0].device.type):
        return fn(*args)
    with torch.autocast(device_type=tensors[0].device.type, enabled=False):
        return fn(*(_float32(a) for a in args))


def _flat(args: tuple[Any, ...]) -> Iterator[Any]:
    for a in args:
        if isinstance(a, tuple):
            yield from _flat(a)
        else:
            yield a


def _float32(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return a.float() if a.is_floating_point() else a
    if isinstance(a, tuple):
        items = [_float32(x) for x in a]
        return type(a)(*items) if hasattr(a, "_fields") else type(a)(items)
    return a


def denormals_flushed() -> bool:
    """Whether this thread's CPU arithmetic treats subnormal floats as zero
    (``torch.set_flush_denormal``)."""
    # 1e-39 is below float32's smallest normal number (1.18e-38): a subnormal
    return float((torch.tensor([1e-39], dtype=torch.float32) * 1.0).item()) == 0.0


@contextlib.contextmanager
def flush_denormals(device: torch.device) -> Iterator[None]:
    """Within this block, CPU arithmetic flushes subnormal floats to zero; restored after it.

    Gradients that decay towards zero (self-routing's logits reach 1e-34 after a few steps) make
    subnormal operands, which x86 CPUs handle in microcode at tens of times the normal cost: one
    matrix product of self-routing's backward took 260 ms instead of 8 ms on an Intel Xeon, and
    its training step 2x longer. Values below 1.2e-38 change no result a float32 network can
    show. Only CPU work is affected (GPUs have their own mode), so on other devices this does
    nothing; where the CPU has no such mode (``torch.set_flush_denormal`` returns False) neither.
    The mode is per thread: set here on the calling thread, it reaches torch's worker threads
    and the compiled routing loops' threads, which start from it.
    """
    if device.type != "cpu" or denormals_flushed():
        yield
        return
    changed = torch.set_flush_denormal(True)
    try:
        yield
    finally:
        if changed:
            torch.set_flush_denormal(False)
