"""Fused CPU loops for the routed and weighted passes, compiled on first use
(capsctl/layers/routing_kernels.cpp).

The chunked routed pass (capsctl/layers/routing.py) runs each tile of votes as about a dozen
torch kernels, every one a full pass over a tile in the cache. The same math written as one loop
nest over (site, child) pairs keeps a pair's votes (``a*c*m`` floats, 2 KiB for 4x4 poses and
32 parents) in the first-level cache from their product to the weighted sum. It is plain C++
with no dependency (not even torch's headers): built here with the system's C++ compiler in
about a second, cached per source, compiler and CPU, loaded with :mod:`ctypes` (which releases
the GIL during a call, so the threads of capsctl/layers/chunks.py run their sites in parallel).

Used for float32 tensors on a CPU outside tracing and ``torch.compile``, when a compiler is found
(``$CXX``, else ``c++``, ``g++`` or ``clang++``). Without one, or with ``CAPSCTL_NATIVE=0``, every
pass runs the torch code it always had: the same results, more slowly.
:func:`native_status` says which is in use and why. Build flags: ``-O3 -march=native`` (the
library is cached per CPU), ``-ffast-math`` (reassociated sums and glibc's vectorized ``expf``,
which halve the time; results agree with the torch code to float32 rounding, tested). The
compiler may assume finite inputs: a NaN still propagates through the arithmetic, but a pass
over non-finite poses is not guaranteed to give what the torch code gives.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from capsctl.layers.chunks import run_spans, site_spans, site_workers

__all__ = [
    "CACHE_ENV",
    "NATIVE_ENV",
    "native_disabled",
    "native_status",
    "native_summary",
    "routed_backward",
    "routed_forward",
    "usable",
    "em_moments_backward",
    "em_moments_forward",
    "em_quad_backward",
    "em_quad_forward",
    "weighted_backward",
    "weighted_forward",
]

#: Environment variable: ``0`` turns the compiled loops off (the torch code runs instead).
NATIVE_ENV = "CAPSCTL_NATIVE"
#: Environment variable: folder of compiled libraries (default ``$XDG_CACHE_HOME/capsctl`` or
#: ``~/.cache/capsctl``, then a temporary folder where neither can be written).
CACHE_ENV = "CAPSCTL_CACHE"
SOURCE = Path(__file__).with_name("routing_kernels.cpp")
FLAGS = (
    "-O3",
    "-march=native",
    "-ffast-math",
    "-fopenmp-simd",
    "-std=c++17",
    "-shared",
    "-fPIC",
)
ABI = 1
COMPILE_TIMEOUT_S = 300

_STATE: dict[str, object] = {"off": 0}
_LOCK = threading.Lock()
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


@contextlib.contextmanager
def native_disabled() -> Iterator[None]:
    """Run the torch code instead of the compiled loops inside the block (tests, comparisons)."""
    with _LOCK:
        _STATE["off"] = int(_STATE["off"]) + 1  # type: ignore[call-overload]
    try:
        yield
    finally:
        with _LOCK:
            _STATE["off"] = int(_STATE["off"]) - 1  # type: ignore[call-overload]


def _cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV, "").strip()
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or str(Path.home() / ".cache")
    return Path(base) / "capsctl"


def _compiler() -> str | None:
    env = os.environ.get("CXX", "").strip()
    if env:
        return shutil.which(env)
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _cpu_key() -> str:
    """What ``-march=native`` depends on: the machine, its CPU model and feature flags."""
    parts = [platform.machine()]
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        if line.startswith(("model name", "flags", "Features", "CPU part")):
            parts.append(line)
            if len(parts) >= 3:
                break
    return "\n".join(parts)


def _build(cxx: str) -> Path:
    """The compiled library for this source, compiler and CPU: from the cache, else built
    into it (written under a temporary name and renamed, so that concurrent builds and an
    interrupted one never leave a partial file under the final name)."""
    version = subprocess.run(
        [cxx, "--version"], capture_output=True, text=True, timeout=60, check=False
    ).stdout
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode()):
        digest.update(part)
    digest.update(_cpu_key().encode())
    name = f"routing_kernels-{digest.hexdigest()[:16]}.so"
    folders = [_cache_dir() / "kernels", Path(tempfile.gettempdir()) / "capsctl-kernels"]
    for folder in folders:
        if (folder / name).is_file():
            return folder / name
    errors = []
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
            os.close(fd)
        except OSError as exc:
            errors.append(f"{folder}: {exc.strerror}")
            continue
        try:
            cmd = [cxx, *FLAGS, str(SOURCE), "-o", tmp, "-lm"]
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False
            )
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["no message"])[-1]
                raise RuntimeError(f"{Path(cxx).name} failed: {last}")
            os.replace(tmp, folder / name)
            return folder / name
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    raise RuntimeError("no writable cache folder (" + "; ".join(errors) + ")")


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.capsctl_kernels_abi.restype = ctypes.c_int
    if lib.capsctl_kernels_abi() != ABI:
        raise RuntimeError("the compiled library reports another ABI version")
    lib.capsctl_routed_forward.argtypes = [_PTR] * 5 + [_I64] * 8
    lib.capsctl_routed_forward.restype = None
    lib.capsctl_routed_backward.argtypes = [_PTR] * 8 + [_I64] * 8
    lib.capsctl_routed_backward.restype = None
    lib.capsctl_weighted_forward.argtypes = [_PTR] * 4 + [_I64] * 8
    lib.capsctl_weighted_forward.restype = None
    lib.capsctl_weighted_backward.argtypes = [_PTR] * 7 + [_I64] * 8
    lib.capsctl_weighted_backward.restype = None
    for name, ptrs in (
        ("em_moments_forward", 6),
        ("em_moments_backward", 10),
        ("em_quad_forward", 5),
        ("em_quad_backward", 8),
    ):
        fn = getattr(lib, f"capsctl_{name}")
        fn.argtypes = [_PTR] * ptrs + [_I64] * 8
        fn.restype = None
    return lib


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    """The library and a one-line status (built once per process; never raises)."""
    if os.environ.get(NATIVE_ENV, "").strip() == "0":
        return None, f"off ({NATIVE_ENV}=0)"
    cxx = _compiler()
    if cxx is None:
        return None, "off (no C++ compiler found; set CXX or install g++)"
    try:
        path = _build(cxx)
        return _bind(ctypes.CDLL(str(path))), f"on ({path})"
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, f"off ({exc})"


def native_status() -> str:
    """``"on (<library>)"`` or ``"off (<why>)"``: whether the routed passes on a CPU run the
    compiled loops (builds them on the first call)."""
    return _load()[1]


def native_summary() -> str:
    """What runs the routed passes on a CPU, for reports: ``"compiled loops"`` or
    ``"torch code (<why>)"``."""
    lib, status = _load()
    return "compiled loops" if lib is not None else "torch code " + status.removeprefix("off ")


def usable(*tensors: Tensor) -> bool:
    """Whether the compiled loops can run a pass over these tensors: all float32 on a CPU,
    not inside tracing or ``torch.compile``, not disabled, and the library built."""
    if int(_STATE["off"]) or torch.compiler.is_compiling() or torch.jit.is_tracing():  # type: ignore[call-overload]
        return False
    if not all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors):
        return False
    return _load()[0] is not None


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _library() -> ctypes.CDLL:
    lib = _load()[0]
    if lib is None:
        raise RuntimeError(f"the compiled routing loops are {native_status()}")
    return lib


def _spans(x: Tensor) -> list[tuple[int, int]]:
    """Sites split evenly between the threads of capsctl/layers/chunks.py."""
    bsz = x.shape[1]
    workers = site_workers(x)
    return site_spans(bsz, -(-bsz // workers), workers)


def _gw_sum(gws: list[Tensor]) -> Tensor | None:
    """The threads' weight-gradient accumulators, added in a fixed order."""
    for extra in gws[1:]:
        gws[0].add_(extra)
    return gws[0] if gws else None


def routed_forward(x: Tensor, wc: Tensor, pq: Tensor, c: int) -> tuple[Tensor, Tensor]:
    """``S[B, d, m]`` and ``R[J, B, m]`` of child poses ``x[J, B, a, x]``, weights
    ``wc[J, x, c*m]`` and ``pq[B, d, m]`` (``scale * P``, site-major), all contiguous."""
    lib = _library()
    j, bsz, a, xd = x.shape
    m = pq.shape[2]
    s = x.new_empty(bsz, a * c, m)  # [B, d, m]
    r = x.new_empty(j, bsz, m)  # [J, B, m]
    args = (_ptr(x), _ptr(wc), _ptr(pq), _ptr(s), _ptr(r), j, bsz, a, xd, c, m)

    def part(_: int, lo: int, hi: int) -> None:
        lib.capsctl_routed_forward(*args, lo, hi)

    run_spans(part, _spans(x))
    return s, r


def routed_backward(
    x: Tensor,
    wc: Tensor,
    pq: Tensor,
    r: Tensor,
    gq: Tensor,
    c: int,
    needs: tuple[bool, bool, bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Gradients ``gx[J, B, a, x]``, ``gw[J, x, c*m]`` and ``gp[B, d, m]`` (without the
    agreement's scale) of the routed pass, from ``gq[B, d, m] = d loss / d S`` and the
    forward's ``R[J, B, m]``; each only when ``needs`` says so. One ``gw`` accumulator per
    thread, added in a fixed order."""
    lib = _library()
    j, bsz, a, xd = x.shape
    m = pq.shape[2]
    spans = _spans(x)
    gx = torch.empty_like(x) if needs[0] else None  # [J, B, a, x]
    gws = [torch.zeros_like(wc) for _ in spans] if needs[1] else []  # [J, x, c*m] each
    gp = x.new_empty(bsz, a * c, m) if needs[2] else None  # [B, d, m]
    dims = (j, bsz, a, xd, c, m)

    def part(i: int, lo: int, hi: int) -> None:
        gw = gws[i] if gws else None
        ptrs = (x, wc, pq, r, gq, gx, gw, gp)
        lib.capsctl_routed_backward(*(_ptr(t) for t in ptrs), *dims, lo, hi)

    run_spans(part, spans)
    return gx, _gw_sum(gws), gp


def weighted_forward(x: Tensor, wc: Tensor, r: Tensor, c: int) -> Tensor:
    """``S[B, d, m] = sum_J R V`` of child poses ``x[J, B, a, x]``, weights ``wc[J, x, c*m]``
    and given coefficients ``r[J, B, m]``, all contiguous (capsctl/layers/weighted_pass.py)."""
    lib = _library()
    j, bsz, a, xd = x.shape
    m = r.shape[2]
    s = x.new_empty(bsz, a * c, m)  # [B, d, m]
    args = (_ptr(x), _ptr(wc), _ptr(r), _ptr(s), j, bsz, a, xd, c, m)

    def part(_: int, lo: int, hi: int) -> None:
        lib.capsctl_weighted_forward(*args, lo, hi)

    run_spans(part, _spans(x))
    return s


def weighted_backward(
    x: Tensor, wc: Tensor, r: Tensor, gq: Tensor, c: int, needs: tuple[bool, bool, bool]
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Gradients ``gx[J, B, a, x]``, ``gw[J, x, c*m]`` and ``gr[J, B, m]`` of the weighted
    pass from ``gq[B, d, m] = d loss / d S``; each only when ``needs`` says so."""
    lib = _library()
    j, bsz, a, xd = x.shape
    m = r.shape[2]
    spans = _spans(x)
    gx = torch.empty_like(x) if needs[0] else None  # [J, B, a, x]
    gws = [torch.zeros_like(wc) for _ in spans] if needs[1] else []  # [J, x, c*m] each
    gr = torch.empty_like(r) if needs[2] else None  # [J, B, m]
    dims = (j, bsz, a, xd, c, m)

    def part(i: int, lo: int, hi: int) -> None:
        gw = gws[i] if gws else None
        ptrs = (x, wc, r, gq, gx, gw, gr)
        lib.capsctl_weighted_backward(*(_ptr(t) for t in ptrs), *dims, lo, hi)

    run_spans(part, spans)
    return gx, _gw_sum(gws), gr


def _em_run(name: str, x: Tensor, tensors: tuple[Tensor | None, ...], c: int, m: int) -> None:
    """``capsctl_<name>(*tensors, J, B, a, x, c, m, b0, b1)`` over the threads' sites."""
    fn = getattr(_library(), f"capsctl_{name}")
    j, bsz, a, xd = x.shape
    ptrs = [_ptr(t) for t in tensors]

    def part(_: int, lo: int, hi: int) -> None:
        fn(*ptrs, j, bsz, a, xd, c, m, lo, hi)

    run_spans(part, _spans(x))


def em_moments_forward(x: Tensor, wc: Tensor, shift: Tensor, r: Tensor, act: Tensor) -> Tensor:
    """EM's M-step moments ``S[2, B, d, m] = sum_J r a (u, u^2)``, ``u = V - shift``, of child
    poses ``x[J, B, a, x]``, weights ``wc[J, x, c*m]``, ``shift[B, d, m]``, assignments
    ``r[B, m, J]`` and activations ``act[B, J]``, all contiguous
    (:class:`capsctl.layers.em_kernels.VoteMoments`)."""
    m = r.shape[1]
    c = wc.shape[2] // m
    out = x.new_empty(2, x.shape[1], shift.shape[1], m)  # [2, B, d, m]
    _em_run("em_moments_forward", x, (x, wc, shift, r, act, out), c, m)
    return out


def em_moments_backward(
    x: Tensor,
    wc: Tensor,
    shift: Tensor,
    r: Tensor,
    act: Tensor,
    gs: Tensor,
    needs: tuple[bool, bool, bool, bool],
) -> tuple[Tensor | None, ...]:
    """Gradients of ``r[B, m, J]``, ``act[B, J]``, ``x`` and ``wc`` from ``gs[2, B, d, m]``;
    each only when ``needs`` says so."""
    m = r.shape[1]
    c = wc.shape[2] // m
    spans = _spans(x)
    gr = torch.empty_like(r) if needs[0] else None  # [B, m, J]
    ga = torch.empty_like(act) if needs[1] else None  # [B, J]
    gx = torch.empty_like(x) if needs[2] else None  # [J, B, a, x]
    gws = [torch.zeros_like(wc) for _ in spans] if needs[3] else []  # [J, x, c*m] each
    fn = _library().capsctl_em_moments_backward
    j, bsz, a, xd = x.shape

    def part(i: int, lo: int, hi: int) -> None:
        ts = (x, wc, shift, r, act, gs, gr, ga, gx, gws[i] if gws else None)
        fn(*(_ptr(t) for t in ts), j, bsz, a, xd, c, m, lo, hi)

    run_spans(part, spans)
    return gr, ga, gx, _gw_sum(gws)


def em_quad_forward(x: Tensor, wc: Tensor, shift: Tensor, qp: Tensor) -> Tensor:
    """EM's E-step quadratic form ``Q[B, m, J] = sum_d (q u + p u^2)`` with
    ``qp[2, B, d, m]`` (:class:`capsctl.layers.em_kernels.VoteQuad`), all contiguous."""
    m = qp.shape[3]
    c = wc.shape[2] // m
    out = x.new_empty(x.shape[1], m, x.shape[0])  # [B, m, J]
    _em_run("em_quad_forward", x, (x, wc, shift, qp, out), c, m)
    return out


def em_quad_backward(
    x: Tensor,
    wc: Tensor,
    shift: Tensor,
    qp: Tensor,
    gq: Tensor,
    needs: tuple[bool, bool, bool],
) -> tuple[Tensor | None, ...]:
    """Gradients of ``qp``, ``x`` and ``wc`` from ``gq[B, m, J]``; each only when ``needs``
    says so."""
    m = qp.shape[3]
    c = wc.shape[2] // m
    spans = _spans(x)
    gqp = torch.empty_like(qp) if needs[0] else None  # [2, B, d, m]
    gx = torch.empty_like(x) if needs[1] else None  # [J, B, a, x]
    gws = [torch.zeros_like(wc) for _ in spans] if needs[2] else []  # [J, x, c*m] each
    fn = _library().capsctl_em_quad_backward
    j, bsz, a, xd = x.shape

    def part(i: int, lo: int, hi: int) -> None:
        ts = (x, wc, shift, qp, gq, gqp, gx, gws[i] if gws else None)
        fn(*(_ptr(t) for t in ts), j, bsz, a, xd, c, m, lo, hi)

    run_spans(part, spans)
    return gqp, gx, _gw_sum(gws)
