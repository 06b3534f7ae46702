"""The compiled library of fused CPU loops: every vote-sized pass and the poses' LayerNorm
(capsctl/layers/backend/csrc/, one source per pass), built on first use, cached and loaded.

The chunked routed pass (capsctl/layers/passes/routed.py) runs each tile of votes as about a dozen
torch kernels, every one a full pass over a tile in the cache. The same math written as one loop
nest over (site, child) pairs keeps a pair's votes (``a*c*m`` floats, 2 KiB for 4x4 poses and
32 parents) in the first-level cache from their product to the weighted sum. It is plain C++
with no dependency (not even torch's headers): built here with the system's C++ compiler once
(each source in a process of its own, in parallel: about 20 s on two cores), cached per source,
compiler and CPU, loaded with :mod:`ctypes` (which releases
the GIL during a call, so the threads of capsctl/layers/backend/chunks.py run their sites in
parallel).

Only from a folder of this user's that no other user can write to (``$CAPSCTL_CACHE``, else
``$XDG_CACHE_HOME/capsctl`` or ``~/.cache/capsctl``, then ``$TMPDIR/capsctl-kernels-<uid>``;
another is refused with a warning), only a file that matches the checksum written next to it
when it was built (else it is rebuilt), and only after a self-test of every pass against the
torch code (capsctl/layers/backend/native_check.py). Warnings, and the notice of a first build,
go to the ``logging`` logger of this module (one line each on stderr when nothing is
configured).

Used for float32 tensors on a CPU outside tracing and ``torch.compile``, when a compiler is found
(``$CXX``, else ``c++``, ``g++`` or ``clang++``): capsctl/layers/backend/dispatch.py decides,
capsctl/layers/backend/bindings.py calls the library's functions. Without one, or with
``CAPSCTL_NATIVE=0``, every pass runs the torch code it always had: the same results, more
slowly.
:func:`native_status` says which is in use and why. Build flags: ``-O3 -march=native`` (the
library is cached per CPU; on x86-64 also ``-mprefer-vector-width=512``), ``-ffast-math``
(reassociated sums and glibc's vectorized ``expf``,
which halve the time; results agree with the torch code to float32 rounding, tested). The
compiler may assume finite inputs: a NaN still propagates through the arithmetic, but a pass
over non-finite poses is not guaranteed to give what the torch code gives.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from capsctl.environment import switch
from capsctl.layers.backend import native_check
from capsctl.user_cache import CACHE_ENV as USER_CACHE_ENV
from capsctl.user_cache import cache_root, not_private

__all__ = [
    "ABI",
    "CACHE_ENV",
    "HEADERS",
    "NATIVE_ENV",
    "SOURCES",
    "library",
    "loaded",
    "native_status",
    "native_summary",
]

#: Environment variable: ``0`` turns the compiled loops off (the torch code runs instead).
NATIVE_ENV = "CAPSCTL_NATIVE"
#: Environment variable: folder of compiled libraries (default ``$XDG_CACHE_HOME/capsctl`` or
#: ``~/.cache/capsctl``, then a private temporary folder where neither can be used).
CACHE_ENV = USER_CACHE_ENV
#: The folder of the C++ sources.
CSRC = Path(__file__).with_name("csrc")
#: The sources built into the one library: one per pass (and abi.cpp), the poses' LayerNorm.
SOURCES = tuple(sorted(CSRC.glob("*.cpp")))
#: The headers they include (part of the cache key, not compiled on their own).
HEADERS = tuple(sorted(CSRC.glob("*.h")))
FLAGS = (
    "-O3",
    "-march=native",
    "-ffast-math",
    "-fopenmp-simd",
    "-std=c++17",
    "-shared",
    "-fPIC",
)
# x86-64 only: let the compiler use 512-bit vectors where the CPU has them. GCC 12 and
# clang default to 256-bit ones on AVX-512 CPUs: on a 2-core Xeon, one thread, the routed
# pass of 16-d pose vectors took 47-53 ms (forward) and 226-231 ms (backward) that way,
# 40 and 128-134 ms with 512-bit vectors.
X86_FLAGS = ("-mprefer-vector-width=512",)
# The link step's flags: without -ffast-math, with which the compiler driver links
# crtfastmath.o, whose constructor turns on flush-to-zero and denormals-are-zero for the whole
# process that loads the library (every later float computation of the user's program, not
# only the loops'). Training flushes subnormals in its own scope (capsctl.devices).
LINK_FLAGS = ("-shared", "-fPIC")
COMPILE_TIMEOUT_S = 300


def _abi(header: Path) -> int:
    """The version of the functions' signatures, ``CAPSCTL_KERNELS_ABI`` of csrc/abi.h (the
    one place it is written)."""
    found = re.search(r"^#define CAPSCTL_KERNELS_ABI (\d+)$", header.read_text(), re.M)
    if found is None:
        raise RuntimeError(f"{header} does not define CAPSCTL_KERNELS_ABI")
    return int(found.group(1))


#: The version of the functions' signatures; a library that reports another is refused.
ABI = _abi(CSRC / "abi.h")

log = logging.getLogger(__name__)
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_F32 = ctypes.c_float
# The arguments of each extern "C" function (capsctl_<name>): a pass takes its pointers, then
# J, B, a, x, c, m and the sites [b0, b1) (csrc/abi.h); the LayerNorm's take rows.
_PASS_POINTERS = {
    "routed_forward": 5,
    "routed_backward": 9,
    "weighted_forward": 4,
    "weighted_backward": 8,
    "gated_forward": 8,
    "gated_backward": 11,
    "em_moments_forward": 7,
    "em_moments_backward": 12,
    "em_quad_forward": 5,
    "em_quad_backward": 9,
}
ARGTYPES: dict[str, list[type]] = {
    **{name: [_PTR] * n + [_I64] * 8 for name, n in _PASS_POINTERS.items()},
    "agreement_forward": [_PTR] * 5 + [_I64] * 11,
    "agreement_backward": [_PTR] * 8 + [_I64] * 11,
    "layer_norm_forward": [_PTR] * 6 + [_I64, _F32, _I64, _I64],
    "layer_norm_backward": [_PTR] * 7 + [_I64] * 3,
    "layer_norm_forward_layout": [_PTR] * 6 + [_I64] * 3 + [_F32, _I64, _I64],
    "layer_norm_backward_layout": [_PTR] * 7 + [_I64] * 5,
    "em_mstep_forward": [_PTR] * 9 + [_I64] * 3 + [_F32] * 3 + [_I64] * 2,
    "em_mstep_backward": [_PTR] * 12 + [_I64] * 3 + [_F32] * 3 + [_I64] * 2,
}


def _cache_dir() -> Path | None:
    """capsctl's cache folder (capsctl/user_cache.py); None where there is no home."""
    return cache_root()


def _folders() -> list[Path]:
    """Where the library may live, best first: the cache, then a private temporary folder."""
    cache = _cache_dir()
    temp = Path(tempfile.gettempdir()) / f"capsctl-kernels-{os.getuid()}"
    return ([cache / "kernels"] if cache is not None else []) + [temp]


def _compiler() -> list[str] | None:
    """The compiler command: ``$CXX`` (a command with arguments, e.g. ``ccache g++``), else
    ``c++``, ``g++`` or ``clang++``; its program as a full path; None where none is found."""
    words = shlex.split(os.environ.get("CXX", "").strip())
    if words:
        found = shutil.which(words[0])
        return None if found is None else [found, *words[1:]]
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return [found]
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


def build_flags(machine: str | None = None) -> tuple[str, ...]:
    """The compiler flags for ``machine`` (``platform.machine()`` by default): :data:`FLAGS`,
    plus :data:`X86_FLAGS` on x86-64."""
    arch = (machine if machine is not None else platform.machine()).lower()
    return FLAGS + (X86_FLAGS if arch in ("x86_64", "amd64") else ())


def _library_name(cxx: list[str]) -> str:
    """The library's file name: a digest of the sources, flags, compiler version and CPU."""
    version = subprocess.run(
        [*cxx, "--version"], capture_output=True, text=True, timeout=60, check=False
    ).stdout
    digest = hashlib.sha256()
    sources = (*SOURCES, *HEADERS)
    for source in sources:  # every file of csrc/, its name and its bytes
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    digest.update(" ".join(build_flags()).encode())
    digest.update(" ".join(LINK_FLAGS).encode())
    digest.update(version.encode())
    digest.update(_cpu_key().encode())
    return f"routing_kernels-{digest.hexdigest()[:16]}.so"


def _refuse(path: Path, why: str) -> None:
    log.warning(
        "not loading the compiled routing loops from %s: it %s; make it private "
        "(chown to yourself, chmod go-w) or set %s to a private folder",
        path,
        why,
        CACHE_ENV,
    )


def _open(path: Path) -> ctypes.CDLL:
    """Load, bind and self-test the library at ``path`` (RuntimeError where it fails)."""
    lib = _bind(ctypes.CDLL(str(path)))
    native_check.self_test(lib)
    return lib


def _build(cxx: list[str], library: Path) -> ctypes.CDLL:
    """Compile the library to a temporary file next to ``library``, load and self-test it,
    record its checksum and rename it to ``library`` (so that concurrent builds and an
    interrupted one never leave a partial file under the final name, and a library that fails
    its self-test is never cached). Each source compiles in a process of its own, as many at
    once as this process may use CPUs, then one link: on two cores about 20 s instead of
    26 s for one compiler process over every source."""
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=library.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(prefix=".objects-", dir=library.parent) as objects:
            outputs = [str(Path(objects) / f"{src.stem}.o") for src in SOURCES]
            compiles = [
                [*cxx, *build_flags(), "-c", str(src), "-o", out]
                for src, out in zip(SOURCES, outputs, strict=True)
            ]
            with ThreadPoolExecutor(max_workers=_build_workers()) as pool:
                for failed in pool.map(_compile, compiles):
                    if failed:
                        raise RuntimeError(f"{Path(cxx[0]).name} failed: {failed}")
            failed = _compile([*cxx, *LINK_FLAGS, *outputs, "-o", tmp, "-lm"])
            if failed:
                raise RuntimeError(f"{Path(cxx[0]).name} failed: {failed}")
        os.chmod(tmp, 0o755)  # the linker may have made it with the user's umask
        lib = _open(Path(tmp))
        native_check.write_checksum(library, Path(tmp))
        os.replace(tmp, library)
        return lib
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _build_workers() -> int:
    """Compiler processes at once: the CPUs this process may run on (at least one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _compile(cmd: list[str]) -> str:
    """Run one compiler command; "" when it succeeds, else the last line it printed."""
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False
    )
    if done.returncode == 0:
        return ""
    return (done.stderr.strip().splitlines() or ["no message"])[-1]


def _private_folders() -> Iterator[Path]:
    """The folders of :func:`_folders` this user owns and no other can write to, created
    (private) where missing; a warning for each one refused."""
    for folder in _folders():
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            continue  # cannot be made here (read-only, or a file in the way): the next one
        why = not_private(folder)
        if why is None:
            yield folder
        else:
            _refuse(folder, why)


def _cached_or_built(cxx: list[str]) -> tuple[ctypes.CDLL, Path]:
    """The verified library of the first private folder that has or can build one."""
    name = _library_name(cxx)
    errors = []
    for folder in _private_folders():
        library = folder / name
        why = native_check.verify(library)
        if why is None:
            try:
                return _open(library), library
            except (OSError, RuntimeError) as exc:
                why = f"it failed its self-test ({exc})"
        if not os.access(folder, os.W_OK):
            errors.append(f"{folder}: not writable")
            continue
        if why == "missing":
            log.warning(
                "compiling the routing loops for this CPU (once, about 20 s) into %s", folder
            )
        else:
            log.warning("rebuilding the compiled routing loops %s: %s", library, why)
        return _build(cxx, library), library
    raise RuntimeError("no private cache folder (" + "; ".join(errors or ["none found"]) + ")")


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.capsctl_kernels_abi.restype = ctypes.c_int
    if lib.capsctl_kernels_abi() != ABI:
        raise RuntimeError("the compiled library reports another ABI version")
    for name, argtypes in ARGTYPES.items():
        fn = getattr(lib, f"capsctl_{name}")
        fn.argtypes = argtypes
        fn.restype = None
    return lib


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    """The library and a one-line status (built once per process; raises only a UsageError for
    a ``CAPSCTL_NATIVE`` that is not a switch, capsctl/environment.py). A library
    that fails a check (capsctl/layers/backend/native_check.py) is not used: a warning, torch
    code."""
    if not switch(NATIVE_ENV, default=True):
        return None, f"off ({NATIVE_ENV}={os.environ[NATIVE_ENV].strip()})"
    cxx = _compiler()
    if cxx is None:
        return None, "off (no C++ compiler found; set CXX or install g++)"
    try:
        lib, path = _cached_or_built(cxx)
        return lib, f"on ({path})"
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as exc:
        status = f"off ({exc})"
    log.warning(
        "the compiled routing loops are %s; running the torch code instead (set %s=0 to skip them)",
        status,
        NATIVE_ENV,
    )
    return None, status


def native_status() -> str:
    """``"on (<library>)"`` or ``"off (<why>)"``: whether the routed passes on a CPU run the
    compiled loops (builds them on the first call)."""
    return _load()[1]


def native_summary() -> str:
    """What runs the routed passes on a CPU, for reports: ``"compiled loops"`` or
    ``"torch code (<why>)"``."""
    lib, status = _load()
    return "compiled loops" if lib is not None else "torch code " + status.removeprefix("off ")


def loaded() -> ctypes.CDLL | None:
    """The library, built and loaded on the first call; None where it cannot be used
    (:func:`native_status` says why)."""
    return _load()[0]


def library() -> ctypes.CDLL:
    """The loaded library (RuntimeError with the status where there is none)."""
    lib = _load()[0]
    if lib is None:
        raise RuntimeError(f"the compiled routing loops are {native_status()}")
    return lib
