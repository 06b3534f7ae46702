"""Compile captured Triton variants for a GPU architecture without a GPU, and read what the
hardware would get: registers, spills, stack and shared memory, and a few PTX counts.

:class:`Compiler` hands each variant (a :meth:`capsctl.layers.backend.triton.aot.Launch.spec`)
to a worker process that runs ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch,
32))`` with the launch's options (its ``num_warps`` and ``num_stages``; Triton's defaults, 4
warps and 3 stages, where it gives none), then ``cuobjdump
--dump-resource-usage`` (shipped with Triton) on the cubin for registers, stack and shared
memory, reads spill stores from ptxas's ``-v`` report (which Triton prints when
``TRITON_DUMP_PTXAS_LOG`` is set) and counts instructions in the PTX.
A variant whose compile uses more CPU seconds than the timeout (the worker's and ptxas's, so
that a loaded machine does not stop compiles a quiet one finishes; or four times the timeout of
wall time) has its worker killed and is reported as timed out; the next variant gets a fresh
worker. The worker runs without ``TRITON_INTERPRET`` and with
``TRITON_CACHE_DIR`` set to the cache folder given (so a fresh folder gives compile seconds from
an empty cache). Triton names capability 90 ``sm_90a`` and 100 ``sm_100a``.

Nothing here imports Triton at import time; the worker does.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = [
    "ARCHS",
    "WALL_FACTOR",
    "WARM_UP",
    "Compiler",
    "arch_name",
    "arch_number",
    "compile_variant",
    "ptx_counts",
    "ptxas_log",
    "resource_usage",
    "spills",
    "tree_cpu_s",
]

#: Architectures by the names Triton's NVIDIA backend gives them.
ARCHS = {"sm_80": 80, "sm_90a": 90, "sm_100a": 100}
_MARK = "capsctl-aot "  # prefix of the worker's answer lines (anything else is noise)
_READY_S = 180.0  # seconds a worker may take to import Triton and the kernels
#: A compile's limit is CPU seconds; wall seconds stop it at this many times the limit.
WALL_FACTOR = 4.0
#: A variant compiled once per architecture before any other (:func:`serve`): the weighted
#: forward of one child with scalar poses.
WARM_UP = {
    "kernel": "pass_forward",
    "signature": {
        **{k: "*fp32" for k in ("x_ptr", "w_ptr", "p_ptr", "r_ptr", "q_ptr", "s_ptr")},
        **{"J": "i32", "B": "i32", "JN": "i32", "scale": "fp32"},
        **{k: "constexpr" for k in ("M", "A", "C", "XD", "ROUTED", "COEF", "ACC", "DT")},
        **{k: "constexpr" for k in ("DOT", "I64", "BB", "KP", "AP", "MP", "MF", "CP")},
    },
    "constexprs": {"M": 1, "A": 1, "C": 16, "XD": 1, "ROUTED": False, "COEF": 0}
    | {"ACC": "tl.fp32", "DT": "tl.fp32", "DOT": "tf32x3", "I64": False}
    | {"BB": 1, "KP": 8, "AP": 1, "MP": 1, "MF": 1, "CP": 16},
    "divisible": ["x_ptr", "w_ptr", "p_ptr", "r_ptr", "q_ptr", "s_ptr"],
}
_RESOURCES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTX = {
    "atomics": re.compile(r"^\s*(?:@!?%p\w+\s+)?(?:atom|red)\.", re.M),
    "acq_rel_atomics": re.compile(r"^\s*(?:@!?%p\w+\s+)?(?:atom|red)\.[\w.:]*acq_rel", re.M),
    "mma": re.compile(r"\b(?:mma\.sync|wgmma\.mma_async|tcgen05\.mma)\b"),
    "int64_offsets": re.compile(r"\b(?:mul|mad)\.lo\.[su]64\b"),
    "global_loads": re.compile(r"\bld\.global\b"),
    "vector_loads": re.compile(r"\bld\.global[\w.:]*?\.v[248]\b"),
}


def arch_number(name: str | int) -> int:
    """The compute capability of ``sm_80``, ``sm_90``/``sm_90a``, ``100``... (an int)."""
    digits = re.fullmatch(r"(?:sm_)?(\d+)a?", str(name).strip().lower())
    if not digits:
        raise ValueError(f"not a CUDA architecture: {name!r} (sm_80, sm_90a, sm_100a)")
    return int(digits.group(1))


def arch_name(number: int) -> str:
    """Triton's name of a capability: ``sm_80``, ``sm_90a``, ``sm_100a``."""
    return f"sm_{number}" + ("a" if number >= 90 else "")


def ptx_counts(ptx: str) -> dict[str, int]:
    """Static instruction counts in PTX: atomics (``atom``/``red``) and those with acq_rel
    semantics, tensor-core MMAs (``mma.sync``, ``wgmma``, ``tcgen05.mma``), 64-bit integer
    multiplies (``mul``/``mad .lo.s64``: offsets computed in int64), global loads and vector
    global loads; ``ptx_bytes``: the PTX's size."""
    out = {k: len(rx.findall(ptx)) for k, rx in _PTX.items()}
    out["ptx_bytes"] = len(ptx.encode())
    return out


def resource_usage(cubin: bytes) -> dict[str, int]:
    """``cuobjdump --dump-resource-usage`` of a cubin: registers, stack, static shared memory
    and local memory (spills) per thread."""
    import triton

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        tool = triton.knobs.nvidia.cuobjdump.path
        res = subprocess.run(
            [tool, "--dump-resource-usage", str(path)], capture_output=True, text=True, check=True
        )
    found = _RESOURCES.search(res.stdout)
    if not found:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {res.stdout[-500:]!r}")
    reg, stack, shared, local = map(int, found.groups())
    return {"registers": reg, "stack_bytes": stack, "static_shared_bytes": shared,
            "local_bytes": local}  # fmt: skip


def ptxas_log(ptx: str, arch: int) -> str:
    """``ptxas -v``'s report of PTX (for a kernel Triton took from its cache, whose log it
    did not print), with Triton's own ptxas for ``arch``."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        cmd = [get_ptxas(arch).path, "-v", "--regAllocOptLevel=2", f"--gpu-name={arch_name(arch)}"]
        res = subprocess.run(
            [*cmd, str(src), "-o", str(src.with_suffix(".o"))], capture_output=True, text=True
        )
    return res.stderr + res.stdout


def spills(log: str) -> dict[str, int | None]:
    """Spill stores and loads (bytes a thread) in ptxas's ``-v`` report (None if absent)."""
    found = _SPILLS.search(log)
    if not found:
        return {"spill_bytes": None, "spill_load_bytes": None}
    return {"spill_bytes": int(found.group(2)), "spill_load_bytes": int(found.group(3))}


def _kernel(name: str) -> Any:
    from capsctl.layers.backend.triton import (
        em,
        em_estep,
        estep,
        gate,
        kernels,
        mstep,
        overlap,
        squash,
    )

    table = {"pass_forward": kernels.pass_forward, "pass_backward": kernels.pass_backward}
    table |= {"pass_weight_grad": kernels.pass_weight_grad}
    table |= {"pass_input_grad": kernels.pass_input_grad}
    table |= {"em_forward": em.em_forward, "em_backward": em.em_backward}
    table |= {"em_input_grad": em.em_input_grad, "em_weight_grad": em.em_weight_grad}
    table |= {"gate_forward": gate.gate_forward, "gate_backward": gate.gate_backward}
    table |= {"squash_forward": squash.squash_forward, "squash_backward": squash.squash_backward}
    table |= {"estep_forward": estep.estep_forward, "estep_rowdot": estep.estep_rowdot}
    table |= {"estep_backward": estep.estep_backward}
    table |= {"m_step_forward": mstep.m_step_forward, "m_step_backward": mstep.m_step_backward}
    table |= {name: getattr(em_estep, name) for name in em_estep.__all__}
    table |= {name: getattr(overlap, name) for name in overlap.__all__}
    return table[name]


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (ptxas) so far."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def compile_variant(spec: dict[str, Any], arch: int) -> dict[str, Any]:
    """Compile one variant (a ``Launch.spec()``) for capability ``arch`` in this process and
    read its resources: registers, spills, stack, shared memory, compile seconds (wall, and
    CPU: this process's and ptxas's, which a loaded machine does not inflate), PTX counts."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _kernel(spec["kernel"])
    names = list(fn.arg_names)
    const = {
        k: tl.dtype(v[3:]) if isinstance(v, str) and v.startswith("tl.") else v
        for k, v in spec["constexprs"].items()
    }
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in spec["divisible"]}
    src = ASTSource(fn, spec["signature"], const, attrs)
    options = dict(spec.get("options") or {})  # num_warps, num_stages of the launch
    log = io.StringIO()  # Triton prints ptxas's -v log here (TRITON_DUMP_PTXAS_LOG)
    start, cpu = time.perf_counter(), _cpu_s()
    with contextlib.redirect_stdout(log):
        k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    seconds, cpu = time.perf_counter() - start, _cpu_s() - cpu
    ptx = k.asm["ptx"]
    target = re.search(r"^\.target\s+(\S+)", ptx, re.M)
    return {
        **resource_usage(k.asm["cubin"]),
        **spills(log.getvalue() or ptxas_log(ptx, arch)),
        "shared_bytes": int(k.metadata.shared),
        "num_warps": int(k.metadata.num_warps),
        "num_stages": int(k.metadata.num_stages),
        "compile_s": round(seconds, 2),
        "compile_cpu_s": round(cpu, 2),
        "ptx_target": target.group(1) if target else None,
        **ptx_counts(ptx),
    }


def serve() -> None:
    """The worker: one JSON request a line on stdin (``{"spec", "arch"}``), one answer a line
    on stdout after :data:`_MARK` (an ``error`` key where the compile failed). The first
    request for an architecture first compiles :data:`WARM_UP` for it, so that no variant's
    seconds include the compiler's one-time start (loading its libraries, asking ptxas its
    version)."""
    _kernel("pass_forward")  # import Triton and the kernels before saying ready
    _answer({"ready": True})
    warm: set[int] = set()
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if int(req["arch"]) not in warm:
                compile_variant(WARM_UP, int(req["arch"]))
                warm.add(int(req["arch"]))
            out = compile_variant(req["spec"], int(req["arch"]))
        except Exception as exc:  # a compile error is a result of the report, not a crash
            out = {"error": f"{type(exc).__name__}: {exc}"[-2000:]}
        _answer(out)


def _answer(obj: dict[str, Any]) -> None:
    sys.stdout.write(_MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


class Compiler:
    """Compiles variants in a worker process, each within ``timeout`` seconds, with Triton's
    cache in ``cache_dir``. Use as a context manager (the worker ends with the block)."""

    def __init__(self, cache_dir: str | os.PathLike[str], timeout: float = 300.0) -> None:
        self.cache_dir, self.timeout = str(cache_dir), float(timeout)
        self._proc: subprocess.Popen[bytes] | None = None
        self._buf = b""
        self._log: Any = None  # the worker's stderr, a temporary file

    def __enter__(self) -> Compiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the worker, if one runs."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def _start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = self.cache_dir
        env["TRITON_DUMP_PTXAS_LOG"] = "1"  # spills: ptxas -v's report, printed by Triton
        root = str(Path(__file__).resolve().parents[4])  # the folder holding capsctl/
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        code = "from capsctl.layers.backend.triton.aot_compile import serve; serve()"
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed with the worker)
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, env=env,
        )  # fmt: skip
        self._buf = b""
        if self._read(_READY_S) is None:
            why = self._log_tail()
            self.close()
            raise RuntimeError("the compile worker did not start: " + why)

    def _log_tail(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-1500:]

    def _read(self, seconds: float, cpu_limit: float | None = None) -> dict[str, Any] | None:
        """The worker's next answer; None when it ends, takes longer than ``seconds`` or its
        process tree has used ``cpu_limit`` CPU seconds more than when asked."""
        assert self._proc is not None and self._proc.stdout is not None
        fd, deadline = self._proc.stdout.fileno(), time.monotonic() + seconds
        cpu_end = None if cpu_limit is None else tree_cpu_s(self._proc.pid) + cpu_limit
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                text = line.decode(errors="replace")
                if text.startswith(_MARK):
                    return json.loads(text[len(_MARK) :])
            left = deadline - time.monotonic()
            if left <= 0 or (cpu_end is not None and tree_cpu_s(self._proc.pid) > cpu_end):
                return None
            if not select.select([fd], [], [], min(left, 0.5))[0]:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._buf += chunk

    def compile(self, spec: dict[str, Any], arch: int) -> dict[str, Any]:
        """:func:`compile_variant` in the worker; ``{"timed_out": True, "compile_s",
        "compile_cpu_s"}`` once the compile has used ``timeout`` CPU seconds (on a machine
        without ``/proc``, or past :data:`WALL_FACTOR` times ``timeout`` of wall time: seconds
        of wall time), ``{"error": ...}`` if it fails."""
        if self._proc is None:
            self._start()
        assert self._proc is not None and self._proc.stdin is not None
        start, cpu = time.perf_counter(), tree_cpu_s(self._proc.pid)
        self._proc.stdin.write((json.dumps({"spec": spec, "arch": arch}) + "\n").encode())
        self._proc.stdin.flush()
        by_cpu = cpu > 0  # /proc readable
        wall = self.timeout * (WALL_FACTOR if by_cpu else 1.0)
        out = self._read(wall, self.timeout if by_cpu else None)
        if out is not None:
            return out
        died = self._proc.poll() is not None
        used = tree_cpu_s(self._proc.pid) - cpu
        why = self._log_tail()
        self.close()
        if died:
            return {"error": "the compile worker died: " + why}
        spent = {"compile_s": round(time.perf_counter() - start, 2)}
        return {"timed_out": True, **spent, "compile_cpu_s": round(used, 2) if by_cpu else None}


def _stat(pid: int | str) -> list[str]:
    """Fields of ``/proc/PID/stat`` after the command's name (state first)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rfind(")") + 2 :].split()


def tree_cpu_s(pid: int) -> float:
    """CPU seconds used by process ``pid``, its finished children and its running children
    (ptxas), from ``/proc``; 0.0 where ``/proc`` cannot be read."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        own = _stat(pid)
    except OSError:
        return 0.0
    ticks = sum(int(v) for v in own[11:15])  # utime, stime, cutime, cstime
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or entry.name == str(pid):
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            child = _stat(entry.name)
            if int(child[1]) == pid:
                ticks += int(child[11]) + int(child[12])
    return ticks / tick
