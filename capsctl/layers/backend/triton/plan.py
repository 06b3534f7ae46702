"""Launch shapes of the routed and the weighted pass's kernels (kernels.py), chosen by shape.

Pure Python: no Triton, no tensors. :func:`launch_plan` takes the pass's sizes (letters of
capsctl/layers/passes/routed.py: ``J`` children, ``B`` parent sites, ``m`` parents, ``a x c``
parent poses, ``x`` child pose width) and the inputs' element size, and gives

- the padded sizes of the vote tile (tiles.py): ``AP``, ``MP``, ``CP`` (powers of two, with
  ``MP*CP`` at least the MMA's K, so that ``dX = dV W^T`` is a tensor-core product) and ``KP``
  (the child pose width padded to the MMA's K: 16 for 16-bit inputs, 8 for float32, 4 for
  float64);
- for the site-major kernels (forward, ``dA``/``dP``/``dR``, ``dX``): ``BB`` sites a block, sized
  so that a ``[BB, AP, MP, CP]`` tile holds :data:`TILE_PER_THREAD` elements a thread of 4 warps
  at most, and the children split into spans of ``JN`` so that the grid has :data:`PROGRAMS`
  programs or more where the sites alone give fewer. The forward and the first backward kernel
  also hold one child's weights ``[KP, MP*CP]`` (counted at their element size against
  float32's): their warps are the fewest that keep both the tile and the weights within
  :data:`TILE_PER_THREAD` a thread (16 for dynamic routing's 16-wide poses in float32). Where
  one child's weights for every parent outgrow the widest block (:data:`WEIGHTS_MAX`: 36-wide
  vectors, ``[64, 32*64]``), those two kernels take ``MP`` in blocks of ``parents`` (the
  grid's first dimension counts them fastest) and the routed pass is composed of two
  launches each way (kernels.py);
- for EM's E-step kernels (em_estep.py; the assignments need no sum over ``m`` once the
  log-normalizer is known): ``e_parents`` parents a program, the most that keep the tile
  ``[BB, AP, e_parents, CP]`` within :data:`TILE_PER_THREAD` a thread of 4 warps (all 128
  padded parents of 100 classes of 6x6 poses spilled at 16 warps);
- for the input-gradient kernel (``dX = dV W^T``, site-major): ``MB`` parents a product, the
  most that keep the weights' block ``[MB*CP, KP]`` and the tile ``[BB, AP, MB, CP]`` within
  :data:`TILE_PER_THREAD` a thread of 4 warps, and for float32 inputs a product's K
  (``MB*CP``) of :data:`TF32X3_K` at most; where the kernel builds the block's votes as
  well (EM's input gradient: two products a block), ``MB`` keeps the tile within
  :data:`CHAINED_PER_THREAD` a thread;
- for the weight-gradient kernel (child-major): ``BB`` sites a block, :data:`W_ROWS` pose rows
  (``BB*AP``: the sum over sites is the product's inner dimension, so at least the MMA's K),
  ``MB`` parents a program (its tile and its ``[KP, MB*CP]`` sum within
  :data:`TILE_PER_THREAD` a thread of 4 warps where one parent allows), and the sites split
  into spans of ``BN`` so that the grid has :data:`PROGRAMS` programs or more.

The table of warps: a tile of ``T = BB*AP*MP*CP`` elements takes ``T / (32 * warps)``
registers a thread; the site-major kernels keep three or four such tiles live (the sum, the
votes, the parents' poses and gradient), so :data:`TILE_PER_THREAD` of 16 keeps them near 64
registers of the 168 allowed.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CHAINED_PER_THREAD",
    "MMA_K",
    "PROGRAMS",
    "TF32X3_K",
    "TILE_PER_THREAD",
    "WEIGHTS_MAX",
    "W_ROWS",
    "LaunchPlan",
    "launch_plan",
    "next_pow2",
]

#: The MMA's inner dimension by element size in bytes (Triton's minimum K of ``tl.dot``).
MMA_K = {2: 16, 4: 8, 8: 4}
#: Programs a grid aims at: two per streaming multiprocessor of an H100 (132).
PROGRAMS = 264
#: Elements of one ``[BB, AP, MP, CP]`` tile a thread holds at most.
TILE_PER_THREAD = 16
#: Elements a thread holds of a tile whose block chains two products (votes, then ``dX``).
CHAINED_PER_THREAD = 4
#: Children a span of the site-major kernels keeps at least (the span's sum is written once).
MIN_SPAN = 8
#: Pose rows ``(b, a)`` a block of the weight-gradient kernel sums over (its product's K).
W_ROWS = 32
_WARPS = (4, 8, 16)
#: The input-gradient product's K (``MB*CP``) at most, for float32 inputs: their products run
#: as three tf32 products (``tf32x3``), whose split operands a thread holds at once (at 256,
#: self-routing's 32 parents of 6x6 poses, 246 registers on sm_90a; at 64, 92).
TF32X3_K = 64
#: One child's weights ``[KP, parents*CP]`` a site-major program holds at most, in float32
#: elements: :data:`TILE_PER_THREAD` a thread of the widest block (16 warps).
WEIGHTS_MAX = TILE_PER_THREAD * 32 * _WARPS[-1]


def next_pow2(n: int) -> int:
    """The smallest power of two at least ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, int(n) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class LaunchPlan:
    """The kernels' launch shapes for one pass (module docstring)."""

    kp: int
    ap: int
    mp: int
    cp: int
    block: int  # BB of the site-major kernels
    parents: int  # parents a program of the forward and the first backward kernel holds
    span: int  # JN: children a program of the site-major kernels loops over
    spans: int  # child spans (the grid's second dimension)
    warps: int
    e_parents: int  # parents a program of EM's E-step kernels holds (em_estep.py)
    e_warps: int
    x_parents: int  # MB: parents a product of the input-gradient kernel sums over
    x_warps: int
    xv_parents: int  # MB of an input-gradient kernel that builds the block's votes too
    w_block: int  # BB of the weight-gradient kernel
    w_parents: int  # MB: parents a program of the weight-gradient kernel owns
    w_span: int  # BN: sites a program of the weight-gradient kernel loops over
    w_spans: int  # site spans (the grid's second dimension)
    w_warps: int
    stages: int = 2

    def grid(self, bsz: int) -> tuple[int, int]:
        """The site-major kernels' grid: (site blocks, child spans)."""
        return (_cdiv(bsz, self.block), self.spans)

    @property
    def wide(self) -> bool:
        """Whether one program of the forward and the first backward kernel holds fewer than
        every parent, so that the routed pass is composed of weighted launches."""
        return self.parents < self.mp

    def parent_grid(self, bsz: int, m: int) -> tuple[int, int]:
        """The forward's and the first backward kernel's grid for ``m`` parents: (site blocks
        times blocks of :attr:`parents`, the latter counted fastest; child spans)."""
        return (_cdiv(bsz, self.block) * _cdiv(m, self.parents), self.spans)

    def e_grid(self, bsz: int, m: int) -> tuple[int, int]:
        """EM's E-step kernels' grid for ``m`` parents: (site blocks times blocks of
        :attr:`e_parents`, counted fastest; child spans)."""
        return (_cdiv(bsz, self.block) * _cdiv(m, self.e_parents), self.spans)

    def w_grid(self, j: int) -> tuple[int, int, int]:
        """The weight-gradient kernel's grid: (children, site spans, parent blocks)."""
        return (j, self.w_spans, self.mp // self.w_parents)

    def pads(self) -> dict[str, int]:
        """The padded sizes as the kernels' constexprs."""
        return {"KP": self.kp, "AP": self.ap, "MP": self.mp, "CP": self.cp}


def _warps_for(tile: int) -> int:
    """The fewest warps of :data:`_WARPS` that hold ``tile`` elements at
    :data:`TILE_PER_THREAD` a thread (the most, when none does)."""
    for w in _WARPS:
        if tile <= TILE_PER_THREAD * 32 * w:
            return w
    return _WARPS[-1]


def launch_plan(
    j: int,
    bsz: int,
    m: int,
    a: int,
    c: int,
    xd: int,
    itemsize: int,
    span: int = 0,
    block: int = 0,
) -> LaunchPlan:
    """The launch shapes of a pass over ``x[J, B, a, x]``, ``w[J, x, m, c]`` with inputs of
    ``itemsize`` bytes (2, 4 or 8); ``span`` and ``block`` (> 0, for tests) fix the children a
    span and the sites a block (rounded up to a power of two) of the site-major kernels, and
    the weight-gradient kernel then takes one block of sites a span."""
    kmin = MMA_K[itemsize]
    kp = max(next_pow2(xd), kmin)
    ap, mp, cp = next_pow2(a), next_pow2(m), next_pow2(c)
    while mp * cp < 16:  # dX = dV W^T sums over (m, c): a product's K
        cp *= 2
    parents = mp  # of the forward and the first backward kernel: as many as their weights allow
    while parents > 1 and kp * parents * cp * itemsize // 4 > WEIGHTS_MAX:
        parents //= 2
    per_site = ap * parents * cp
    if block:
        bb = next_pow2(block)
    else:  # as many sites as a tile of 16 elements a thread of 4 warps holds, at least one
        bb = max(1, min(next_pow2(bsz), (TILE_PER_THREAD * 32 * _WARPS[0]) // per_site))
    weights = max(1, kp * parents * cp * itemsize // 4)  # one child's W, in float32 elements
    warps = _warps_for(max(bb * per_site, weights))
    room = TILE_PER_THREAD * 32 * _WARPS[0]
    # EM's E-step (its assignments need no sum over m once the log-normalizer is known): a
    # block of sites' tile within 4 warps' room
    emb = mp
    while emb > 1 and bb * ap * emb * cp > room:
        emb //= 2
    e_warps = _warps_for(bb * ap * emb * cp)
    xmb = mp
    while xmb > 1 and (xmb * cp * kp * itemsize // 4 > room or bb * ap * xmb * cp > room):
        xmb //= 2
    if xmb < mp:  # several blocks of parents: half the block (100 classes held 188 registers)
        xmb = max(1, xmb // 2)
    while itemsize == 4 and xmb > 1 and xmb * cp > TF32X3_K:
        xmb //= 2
    x_warps = _warps_for(max(bb * ap * xmb * cp, xmb * cp * kp * itemsize // 4))
    xvmb = xmb
    while xvmb > 1 and bb * ap * xvmb * cp > CHAINED_PER_THREAD * 32 * x_warps:
        xvmb //= 2
    blocks = _cdiv(bsz, bb)
    if span:
        jn = span
    else:
        want = max(1, min(_cdiv(PROGRAMS, blocks), _cdiv(j, MIN_SPAN)))
        jn = _cdiv(j, want)
    # the weight gradient: rows (b, a) are the product's K (float32 products: 8 at least)
    k_rows = MMA_K[4 if itemsize == 2 else itemsize]
    w_block = next_pow2(max(_cdiv(k_rows, ap), _cdiv(W_ROWS, ap), block))
    mb = max(1, min(mp, room // (w_block * ap * cp), room // (kp * cp)))
    nmb = mp // mb
    if block:
        w_span = w_block
    else:
        want = max(1, min(_cdiv(PROGRAMS, j * nmb), _cdiv(bsz, 4 * w_block)))
        w_span = _cdiv(_cdiv(bsz, want), w_block) * w_block
    w_warps = _warps_for(max(w_block * ap * mb * cp, kp * mb * cp))
    return LaunchPlan(
        kp=kp, ap=ap, mp=mp, cp=cp, block=bb, parents=parents, span=jn, spans=_cdiv(j, jn),
        warps=warps,
        e_parents=emb, e_warps=e_warps, x_parents=xmb, x_warps=x_warps, xv_parents=xvmb,
        w_block=w_block, w_parents=mb, w_span=w_span,
        w_spans=_cdiv(bsz, w_span), w_warps=w_warps,
    )  # fmt: skip
