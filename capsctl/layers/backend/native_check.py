"""The checks of a compiled library (capsctl/layers/backend/native.py) before it is loaded and
used.

Before loading: the library and its folder belong to this user and no other user can write to
them (:func:`capsctl.user_cache.not_private`), and the file matches the size and checksum
recorded atomically next to it when it was built (:func:`verify`, :func:`write_checksum`), so
that a truncated file (which would kill the process with SIGBUS when its pages are read) or
another user's is never loaded.

Before use: the self-test (:func:`self_test`) runs every function of csrc/ (the vote-sized
passes, the LayerNorm and EM's M-step rest), forward and backward, on small inputs
against the same math written here as plain torch code (autograd for the gradients). A
library that a broken or fake compiler built, or one whose loops were miscompiled, fails here
and is never used: the torch code runs instead.
The inputs come from a private generator (the global random state is untouched); every output
buffer starts as NaN, so a loop that writes nothing fails too. Letters and layouts as in
capsctl/layers/backend/bindings.py. Of capsctl it imports only the leaf capsctl.user_cache
(native.py calls it).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from capsctl.user_cache import not_private

__all__ = ["SelfTestError", "self_test", "verify", "write_checksum"]

# (a, x, c, m): the sizes compiled in (4x4 poses and 16-d vectors with 32, 16 and 10 parents),
# 4x4 poses with a run-time parent count and a shape of run-time sizes only
VOTE_SHAPES = ((4, 4, 4, 32), (4, 4, 4, 16), (4, 4, 4, 10), (4, 4, 4, 3))
VOTE_SHAPES += ((1, 16, 16, 32), (1, 16, 16, 16), (1, 16, 16, 10), (2, 3, 5, 2))
J, B = 3, 5  # children, sites
RTOL = 1e-3  # of the largest reference value: float32 with -ffast-math's reassociated sums

Ref = Callable[..., tuple[Tensor, ...]]


class SelfTestError(RuntimeError):
    """A pass of the library gave other numbers than the torch code (the message says which)."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _sum_file(library: Path) -> Path:
    """The checksum written next to ``library`` when it was built: ``<sha256> <bytes>``."""
    return library.with_name(library.name + ".sha256")


def verify(library: Path) -> str | None:
    """Why the cached ``library`` cannot be loaded (it is missing, another user's, truncated
    or changed since it was built), or None: its size and checksum match the record."""
    why = not_private(library, folder=False)
    if why is not None:
        return "missing" if not library.exists() else f"it {why}"
    try:
        digest, size = _sum_file(library).read_text().split()
    except (OSError, ValueError):
        return "it has no checksum"
    if library.stat().st_size != int(size) or _sha256(library) != digest:
        return "it does not match its checksum (truncated or changed since it was built)"
    return None


def write_checksum(library: Path, built: Path) -> None:
    """Record the checksum of ``built`` (to be renamed to ``library``), atomically."""
    fd, tmp = tempfile.mkstemp(prefix=".sum-", dir=library.parent)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(f"{_sha256(built)} {built.stat().st_size}\n")
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, _sum_file(library))
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _nan(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)


def _check(name: str, got: Sequence[Tensor], want: Sequence[Tensor]) -> None:
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        w = w.detach().float()
        scale = max(float(w.abs().max()), 1e-6)
        err = float((g.float() - w).abs().max()) if bool(torch.isfinite(g).all()) else float("inf")
        if not err <= RTOL * scale:
            raise SelfTestError(f"{name}, output {k}, differs from the torch code by {err:.3g}")


def _votes(x: Tensor, wc: Tensor, m: int) -> Tensor:
    j, bsz, a, xd = x.shape
    d = a * (wc.shape[2] // m)
    return torch.bmm(x.reshape(j, bsz * a, xd), wc).view(j, bsz, d, m)  # [J, B, d, m]


def _grads(outputs: Sequence[Tensor], inputs: Sequence[Tensor], g: torch.Generator) -> tuple:
    """Random upstream gradients of ``outputs`` and the gradients of ``inputs`` they give."""
    ups = [torch.randn(o.shape, generator=g) for o in outputs]
    return tuple(ups), torch.autograd.grad(outputs, inputs, ups, allow_unused=False)


def _run(lib: ctypes.CDLL, fn: str, tensors: Sequence[Tensor | None], dims: Sequence[int]) -> None:
    getattr(lib, f"capsctl_{fn}")(*map(_ptr, tensors), *dims)


def _routed(lib: ctypes.CDLL, shape: tuple[int, ...], g: torch.Generator) -> None:
    a, xd, c, m = shape
    d, dims = a * c, (J, B, a, xd, c, m, 0, B)
    x, wc = torch.randn(J, B, a, xd, generator=g), torch.randn(J, xd, c * m, generator=g) * 0.5
    pq = torch.randn(B, d, m, generator=g) * 0.5
    ins = [t.requires_grad_() for t in (x, wc, pq)]
    v = _votes(x, wc, m)  # [J, B, d, m]
    r = torch.softmax((v * pq).sum(2), -1)  # [J, B, m]
    s = (r.unsqueeze(2) * v).sum(0)  # [B, d, m]
    got = (_nan(B, d, m), _nan(J, B, m))
    _run(lib, "routed_forward", (x, wc, pq, *got), dims)
    _check(f"routed_forward{shape}", got, (s, r))
    (gq,), want = _grads([s], ins, g)
    gx, gp, gw = _nan(J, B, a, xd), _nan(B, d, m), _nan(J, xd, c * m)
    wt = wc.detach().transpose(1, 2).contiguous()  # [J, c*m, x]
    _run(lib, "routed_backward", (x, wc, wt, pq, r.detach(), gq, gx, gp, gw), dims)
    _check(f"routed_backward{shape}", (gx, gw, gp), want)


def _squash(s: Tensor) -> Tensor:
    n = s.norm(dim=1, keepdim=True)  # [B, 1, m]
    return s * (n / (1 + n * n))  # [B, d, m]


def _agreement(lib: ctypes.CDLL, shape: tuple[int, ...], g: torch.Generator) -> None:
    """Routing by agreement, T = 3 iterations, against Procedure 1 written out in torch."""
    a, xd, c, m = shape
    d, iters = a * c, 3
    x, wc = torch.randn(J, B, a, xd, generator=g), torch.randn(J, xd, c * m, generator=g) * 0.5
    ins = [t.requires_grad_() for t in (x, wc)]
    v = _votes(x, wc, m)  # [J, B, d, m]
    sums, rs = [v.sum(0) / m], []  # [B, d, m] each, [J, B, m] each
    poses = [_squash(sums[0])]
    for _ in range(1, iters):
        rs.append(torch.softmax((v * sum(poses)).sum(2), -1))  # [J, B, m]
        sums.append((rs[-1].unsqueeze(2) * v).sum(0))  # [B, d, m]
        poses.append(_squash(sums[-1]))
    ups, want = _grads(poses, ins, g)
    wt = wc.detach().transpose(1, 2).contiguous()  # [J, c*m, x]
    for keep in (1, 0):  # the block's votes kept, or built again for each use
        dims = (J, B, a, xd, c, m, iters, 2, keep, 0, B)  # blocks of 2 sites
        got = (_nan(iters, B, d, m), _nan(iters, B, d, m), _nan(iters - 1, J, B, m))
        if not keep:  # the caller gives the uniform pass's sums
            got[0][0] = sums[0].detach()
        _run(lib, "agreement_forward", (x, wc, *got), dims)
        want_fwd = (torch.stack(sums), torch.stack(poses), torch.stack(rs))
        _check(f"agreement_forward{shape} keep={keep}", got, want_fwd)
        gx, gw = _nan(J, B, a, xd), _nan(J, xd, c * m)
        ts = (x, wc, wt, got[0], got[2], torch.stack(ups), gx, gw)
        _run(lib, "agreement_backward", ts, dims)
        _check(f"agreement_backward{shape} keep={keep}", (gx, gw), want)


def _weighted(lib: ctypes.CDLL, shape: tuple[int, ...], g: torch.Generator) -> None:
    a, xd, c, m = shape
    d, dims = a * c, (J, B, a, xd, c, m, 0, B)
    x, wc = torch.randn(J, B, a, xd, generator=g), torch.randn(J, xd, c * m, generator=g)
    r = torch.rand(J, B, m, generator=g)
    ins = [t.requires_grad_() for t in (x, wc, r)]
    s = (r.unsqueeze(2) * _votes(x, wc, m)).sum(0)  # [B, d, m]
    got = _nan(B, d, m)
    _run(lib, "weighted_forward", (x, wc, r, got), dims)
    _check(f"weighted_forward{shape}", [got], [s])
    (gq,), want = _grads([s], ins, g)
    gx, gr, gw = _nan(J, B, a, xd), _nan(J, B, m), _nan(J, xd, c * m)
    wt = wc.detach().transpose(1, 2).contiguous()  # [J, c*m, x]
    _run(lib, "weighted_backward", (x, wc, wt, r, gq, gx, gr, gw), dims)
    _check(f"weighted_backward{shape}", (gx, gw, gr), want)


def _gated(lib: ctypes.CDLL, shape: tuple[int, ...], g: torch.Generator) -> None:
    a, xd, c, m = shape
    d, dims = a * c, (J, B, a, xd, c, m, 0, B)
    x, wc = torch.randn(J, B, a, xd, generator=g), torch.randn(J, xd, c * m, generator=g)
    wr, br = torch.randn(J, a * xd, m, generator=g) * 0.5, torch.randn(J, m, generator=g)
    act = torch.rand(B, J, generator=g)
    ins = [t.requires_grad_() for t in (act, x, wc, wr, br)]
    logits = torch.baddbmm(br.unsqueeze(1), x.reshape(J, B, a * xd), wr)  # [J, B, m]
    cs = torch.softmax(logits, -1)  # [J, B, m]
    mass = cs * act.t().unsqueeze(-1)  # [J, B, m]
    s, tot = (mass.unsqueeze(2) * _votes(x, wc, m)).sum(0), mass.sum(0)  # [B, d, m], [B, m]
    got = (_nan(B, d, m), _nan(B, m), _nan(J, B, m))
    _run(lib, "gated_forward", (x, wc, wr, br, act, *got), dims)
    _check(f"gated_forward{shape}", got, (s, tot, cs))
    (gs, gt), (gact, gx, *gweights) = _grads([s, tot], ins, g)
    out = (_nan(B, J), _nan(J, B, a, xd), _nan(wc.numel() + wr.numel() + br.numel()))
    wt = wc.detach().transpose(1, 2).contiguous()  # [J, c*m, x]
    _run(lib, "gated_backward", (x, wc, wt, wr, cs.detach(), act, gs, gt, *out), dims)
    flat = torch.cat([t.reshape(-1) for t in gweights])  # gwc, gwr, gbr as the loops lay them
    _check(f"gated_backward{shape}", out, (gact, gx, flat))


def _em_inputs(shape: tuple[int, ...], g: torch.Generator) -> tuple[Tensor, ...]:
    a, xd, c, m = shape
    x, wc = torch.randn(J, B, a, xd, generator=g), torch.randn(J, xd, c * m, generator=g) * 0.5
    return x, wc, torch.randn(B, a * c, m, generator=g) * 0.5  # shift [B, d, m]


def _em_moments(lib: ctypes.CDLL, shape: tuple[int, ...], g: torch.Generator) -> None:
    a, xd, c, m = shape
    d, dims = a * c, (J, B, a, xd, c, m, 0, B)
    x, wc, shift = _em_inputs(shape, g)
    r, act = torch.rand(B, J, m, generator=g), torch.rand(B, J, generator=g)
    ins = [t.requires_grad_() for t in (r, act, x, wc)]
    u = _votes(x, wc, m) - shift  # [J, B, d, m]
    ra = (r * act.unsqueeze(-1)).transpose(0, 1).unsqueeze(2)  # [J, B, 1, m]
    out = torch.stack([(ra * u).sum(0), (ra * u * u).sum(0)])  # [2, B, d, m]
    mass = ra.squeeze(2).sum(0)  # [B, m]
    got = (_nan(2, B, d, m), _nan(B, m))
    _run(lib, "em_moments_forward", (x, wc, shift, r, act, *got), dims)
    _check(f"em_moments_forward{shape}", got, (out, mass))
    (gs, gm), want = _grads([out, mass], ins, g)
    res = (_nan(B, J, m), _nan(B, J), _nan(J, B, a, xd), _nan(J, xd, c * m))
    wt = wc.detach().transpose(1, 2).contiguous()  # [J, c*m, x]
    _run(lib, "em_moments_backward", (x, wc, wt, shift, r, act, gs, gm, *res), dims)
    _check(f"em_moments_backward{shape}", res, want)


def _em_quad(lib: ctypes.CDLL, shape: tuple[int, ...], g: torch.Generator) -> None:
    a, xd, c, m = shape
    d, dims = a * c, (J, B, a, xd, c, m, 0, B)
    x, wc, shift = _em_inputs(shape, g)
    qp = torch.randn(2, B, d, m, generator=g)
    ins = [t.requires_grad_() for t in (qp, x, wc)]
    u = _votes(x, wc, m) - shift  # [J, B, d, m]
    q = (qp[0] * u + qp[1] * u * u).sum(2).transpose(0, 1)  # [J, B, m] -> [B, J, m]
    got = _nan(B, J, m)
    _run(lib, "em_quad_forward", (x, wc, shift, qp, got), dims)
    _check(f"em_quad_forward{shape}", [got], [q])
    (gq,), want = _grads([q], ins, g)
    res = (_nan(2, B, d, m), _nan(J, B, a, xd), _nan(J, xd, c * m))
    wt = wc.detach().transpose(1, 2).contiguous()  # [J, c*m, x]
    _run(lib, "em_quad_backward", (x, wc, wt, shift, qp, gq.contiguous(), *res), dims)
    _check(f"em_quad_backward{shape}", res, want)


def _layer_norm(lib: ctypes.CDLL, d: int, g: torch.Generator) -> None:
    rows, eps = 7, 1e-5
    x, w, b = (torch.randn(*s, generator=g) for s in ((rows, d), (d,), (d,)))
    ins = [t.requires_grad_() for t in (x, w, b)]
    y = F.layer_norm(x, (d,), w, b, eps)
    got, mean, rstd = _nan(rows, d), _nan(rows), _nan(rows)
    lib.capsctl_layer_norm_forward(*map(_ptr, (x, w, b, got, mean, rstd)), d, eps, 0, rows)
    _check(f"layer_norm_forward(d={d})", [got], [y])
    (gy,), (gx_ref, *gwb) = _grads([y], ins, g)
    gx, acc = _nan(rows, d), torch.zeros(2, d, dtype=torch.float64)  # [gw; gb]
    lib.capsctl_layer_norm_backward(*map(_ptr, (x, w, mean, rstd, gy, gx, acc)), d, 0, rows)
    _check(f"layer_norm_backward(d={d})", (gx, acc[0], acc[1]), (gx_ref, *gwb))


def _em_mstep_reference(s, mass, shift, bu, ba, lam, eps, veps):  # type: ignore[no-untyped-def]
    """EM's M-step rest (csrc/em_mstep.cpp's comment) over ``s[2, B, d, m]``, ``mass[B, m]``,
    ``shift[B, d, m]``: ``mu[B, d, m]``, ``act[B, m]``, ``qp[2, B, d, m]``, ``c[B, m]``."""
    inv = 1.0 / (mass + eps)  # [B, m]
    m1 = s[0] * inv[:, None]  # [B, d, m]
    sw = (mass * inv)[:, None]  # [B, 1, m]
    delta = m1 + shift * (sw - 1.0)
    var = s[1] * inv[:, None] - 2.0 * delta * m1 + delta * delta * sw + veps
    lv = torch.log(var)
    pre = lam * (ba - (bu + 0.5 * lv).sum(1) * mass)  # [B, m]
    c = (
        F.logsigmoid(pre)
        - 0.5 * (delta * delta / var).sum(1)
        - 0.5 * (lv + 1.8378770664093453).sum(1)
    )
    return shift + delta, torch.sigmoid(pre), torch.stack((-2.0 * delta / var, 1.0 / var)), c


def _em_mstep(lib: ctypes.CDLL, d: int, m: int, g: torch.Generator) -> None:
    bsz, consts = 5, (0.3, 1e-7, 5e-4)
    mass = torch.rand(bsz, m, generator=g) * 3.0 + 0.1
    s1 = torch.randn(bsz, d, m, generator=g) * mass[:, None] * 0.3
    s2 = (torch.rand(bsz, d, m, generator=g) + 0.5) * mass[:, None] + s1 * s1 / mass[:, None]
    s, shift = torch.stack((s1, s2)), torch.randn(bsz, d, m, generator=g) * 0.1
    bu, ba = torch.randn(m, generator=g), torch.randn(m, generator=g)
    ins = [t.requires_grad_() for t in (s, mass, bu, ba)]
    want = _em_mstep_reference(s, mass, shift, bu, ba, *consts)
    got = (_nan(bsz, d, m), _nan(bsz, m), _nan(2, bsz, d, m), _nan(bsz, m))
    lib.capsctl_em_mstep_forward(
        *map(_ptr, (s, mass, shift, bu, ba, *got)), bsz, d, m, *consts, 0, bsz
    )
    _check(f"em_mstep_forward(d={d}, m={m})", got, want)
    ups, grads = _grads(want, ins, g)
    g_s, g_mass, acc = _nan(2, bsz, d, m), _nan(bsz, m), torch.zeros(2, m, dtype=torch.float64)
    lib.capsctl_em_mstep_backward(
        *map(_ptr, (s, mass, shift, bu, ba, *ups, g_s, g_mass, acc)), bsz, d, m, *consts, 0, bsz
    )
    _check(f"em_mstep_backward(d={d}, m={m})", (g_s, g_mass, acc[0], acc[1]), grads)


def _rows_first(t: Tensor, sites: int) -> Tensor:
    """Standard ``[b*sites, 16]`` -> rows-first ``[b, 4, sites, 4]`` (as passes/rows_first.py)."""
    return t.reshape(-1, sites, 4, 4).permute(0, 2, 1, 3).contiguous()  # [b, a, sites, x]


def _standard(t: Tensor, sites: int) -> Tensor:
    """Rows-first ``[b, 4, sites, 4]`` -> standard ``[b*sites, 16]``."""
    return t.permute(0, 2, 1, 3).reshape(-1, 16)  # [b, sites, a, x] -> [b*sites, d]


def _layout_norm(lib: ctypes.CDLL, rows_in: bool, rows_out: bool, g: torch.Generator) -> None:
    bsz, sites, eps = 2, 16, 1e-5
    count = bsz * sites
    std, w, b = (torch.randn(*s, generator=g) for s in ((count, 16), (16,), (16,)))
    x = (_rows_first(std, sites) if rows_in else std).contiguous()
    ins = [t.requires_grad_() for t in (x, w, b)]
    y = F.layer_norm(_standard(x, sites) if rows_in else x, (16,), w, b, eps)  # [count, d]
    y = _rows_first(y, sites) if rows_out else y
    got, mean, rstd = _nan(*y.shape), _nan(count), _nan(count)
    lay = (sites, int(rows_in), int(rows_out))
    lib.capsctl_layer_norm_forward_layout(
        *map(_ptr, (x, w, b, got, mean, rstd)), *lay, eps, 0, count
    )
    name = f"layer_norm_layout(rows_in={rows_in}, rows_out={rows_out})"
    _check(name, [got], [y])
    (gy,), (gx_ref, *gwb) = _grads([y], ins, g)
    gx, acc = _nan(*x.shape), torch.zeros(2, 16, dtype=torch.float64)  # [gw; gb]
    ptrs = map(_ptr, (x, w, mean, rstd, gy.contiguous(), gx, acc))
    lib.capsctl_layer_norm_backward_layout(*ptrs, *lay, 0, count)
    _check(name + " backward", (gx, acc[0], acc[1]), (gx_ref, *gwb))


def self_test(lib: ctypes.CDLL) -> None:
    """Run every pass of the bound library ``lib`` once against the torch code; raises
    :class:`SelfTestError` naming the first pass that differs. A few milliseconds. Autocast is
    off inside, so that the torch code it compares with runs in float32 wherever it is called."""
    g = torch.Generator().manual_seed(0)
    # float32 torch code to compare with, also when the first pass runs under autocast
    with (
        torch.inference_mode(False),
        torch.enable_grad(),
        torch.autocast("cpu", enabled=False),
    ):
        for shape in VOTE_SHAPES:
            for check in (_routed, _agreement, _weighted, _gated, _em_moments, _em_quad):
                check(lib, shape, g)
        for d in (16, 7):
            _layer_norm(lib, d, g)
        for d, m in ((16, 32), (16, 10), (3, 5)):
            _em_mstep(lib, d, m, g)
        for rows_in in (False, True):
            for rows_out in (False, True):
                _layout_norm(lib, rows_in, rows_out, g)
