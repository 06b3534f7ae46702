"""The Triton kernels' launch shapes (capsctl/layers/backend/triton/plan.py), pure Python: every
shape the bundled models route gets padded sizes a tensor-core product accepts, tiles within the
per-thread budget, and grids that cover every child and every site exactly once."""

from __future__ import annotations

import pytest

from capsctl.layers.backend.triton.plan import (
    CHAINED_PER_THREAD,
    MMA_K,
    TF32X3_K,
    TILE_PER_THREAD,
    W_ROWS,
    WEIGHTS_MAX,
    launch_plan,
    next_pow2,
)

# (J children, B sites, m parents, a x c parent poses, x child pose width): the class layer of
# cifar10-caps (4x4 matrices), a convolutional capsule layer, dynamic routing's 8 -> 16-wide
# vectors, its conv layer's 16-wide poses, and a single-site odd shape.
SHAPES = [
    (32 * 16, 128, 10, 4, 4, 4),
    (32 * 9, 128 * 36, 32, 4, 4, 4),
    (1152, 128, 10, 1, 16, 8),
    (288, 128 * 49, 32, 1, 16, 16),
    (288, 128 * 64, 32, 1, 36, 36),
    (32 * 64, 128, 100, 1, 36, 36),
    (32 * 9, 128 * 25, 32, 6, 6, 6),
    (7, 1, 3, 3, 5, 6),
    (8, 4, 1, 1, 4, 4),
]


def test_next_pow2() -> None:
    assert [next_pow2(n) for n in (0, 1, 2, 3, 4, 5, 17)] == [1, 1, 2, 4, 4, 8, 32]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_plans_fit_the_mma_and_the_register_budget(
    shape: tuple[int, int, int, int, int, int], itemsize: int
) -> None:
    j, bsz, m, a, c, xd = shape
    p = launch_plan(j, bsz, m, a, c, xd, itemsize)
    # padded sizes: powers of two, at least the true sizes, the products' K at least the MMA's
    for padded, true in [(p.kp, xd), (p.ap, a), (p.mp, m), (p.cp, c)]:
        assert padded >= true and padded == next_pow2(padded)
    assert p.kp >= MMA_K[itemsize]
    assert p.mp * p.cp >= 16
    # a site-major tile holds at most TILE_PER_THREAD elements a thread, unless one site is
    # already more than the widest block holds
    # so do one child's weights [KP, parents*CP] (16-bit ones count half), up to the widest
    # block; the forward and first backward kernels' blocks of parents split the padded m
    tile = p.block * p.ap * p.parents * p.cp
    assert tile <= TILE_PER_THREAD * 32 * p.warps or p.block == 1
    weights = p.kp * p.parents * p.cp * itemsize // 4
    assert weights <= TILE_PER_THREAD * 32 * p.warps or p.warps == 16
    assert weights <= WEIGHTS_MAX or p.parents == 1
    assert p.mp % p.parents == 0 and p.wide == (p.parents < p.mp)
    assert p.parent_grid(bsz, m) == (p.grid(bsz)[0] * -(-m // p.parents), p.spans)
    # EM's E-step kernels: blocks of parents whose tile fits the room of 4 warps
    assert p.mp % p.e_parents == 0
    assert p.block * p.ap * p.e_parents * p.cp <= TILE_PER_THREAD * 32 * 4 or p.e_parents == 1
    assert p.e_grid(bsz, m) == (p.grid(bsz)[0] * -(-m // p.e_parents), p.spans)
    # the input gradient sums over blocks of parents that split the padded m, each block's
    # weights [MB*CP, KP] and tile within the budget of its warps
    assert p.mp % p.x_parents == 0
    room = TILE_PER_THREAD * 32 * p.x_warps
    assert p.x_parents * p.cp * p.kp * itemsize // 4 <= room or p.x_parents == 1
    assert p.block * p.ap * p.x_parents * p.cp <= room or p.x_parents == 1
    assert itemsize != 4 or p.x_parents * p.cp <= TF32X3_K or p.x_parents == 1
    # a block that chains two products (EM's votes, then dX) keeps a smaller tile
    assert p.x_parents % p.xv_parents == 0
    chained = CHAINED_PER_THREAD * 32 * p.x_warps
    assert p.block * p.ap * p.xv_parents * p.cp <= chained or p.xv_parents == 1
    # the grids cover every child and every site, with no empty span
    assert p.span * p.spans >= j and p.span * (p.spans - 1) < j
    blocks, spans = p.grid(bsz)
    assert blocks * p.block >= bsz and (blocks - 1) * p.block < bsz
    assert spans == p.spans
    # the weight gradient: its rows (b, a) are a product's K, its parents split the padded m
    assert p.w_block * p.ap >= W_ROWS
    assert p.mp % p.w_parents == 0
    assert p.w_span % p.w_block == 0
    assert p.w_span * p.w_spans >= bsz and p.w_span * (p.w_spans - 1) < bsz
    assert p.w_grid(j) == (j, p.w_spans, p.mp // p.w_parents)


def test_small_batches_split_the_children_to_fill_the_gpu() -> None:
    # One site: the programs come from spans of children, at least 8 children each.
    p = launch_plan(1152, 1, 10, 1, 16, 8, 4)
    assert p.spans > 1 and p.span >= 8
    # Many sites: one span is enough.
    assert launch_plan(32 * 9, 128 * 36, 32, 4, 4, 4, 4).spans == 1


def test_fixed_span_and_block_are_kept_for_tests() -> None:
    p = launch_plan(40, 10, 10, 4, 4, 4, 4, span=3, block=3)
    assert (p.span, p.spans, p.block) == (3, 14, 4)
    assert p.w_span == p.w_block


def test_an_input_gradient_over_several_blocks_of_parents_takes_half_blocks() -> None:
    """Where one block of parents does not hold all of them (100 classes of 4x4 poses), the
    input-gradient kernel loops over blocks half the size that fits (its loop is not unrolled):
    at 64 parents a block it held 188 registers on sm_90a, at 32 it holds 126. Where one block
    holds every parent (32 types), nothing changes. (bf16 inputs: float32 ones also keep the
    product's K within TF32X3_K, below.)"""
    many = launch_plan(800, 128, 100, 4, 4, 4, 2)  # J, B, m, a, c, x, bf16
    assert (many.mp, many.x_parents, many.x_warps) == (128, 32, 4)
    one = launch_plan(288, 6272, 32, 4, 4, 4, 2)
    assert (one.mp, one.x_parents) == (32, 32)


def test_weights_too_wide_for_one_program_split_the_parents() -> None:
    """36-wide vectors (cifar100-dynamic's conv layer): one child's weights for its 32 parents
    are ``[64, 32*64]``, 16 times what 16 warps hold at 16 elements a thread; the forward and
    the first backward kernel take 2 parents a program in float32 and 4 in bf16 (which
    spilled 54 KB a thread on sm_90a when one program held all 32). 16-wide vectors keep every
    parent in one program."""
    wide = launch_plan(288, 128 * 64, 32, 1, 36, 36, 4)
    assert (wide.kp, wide.mp, wide.cp, wide.parents, wide.wide) == (64, 32, 64, 2, True)
    assert launch_plan(288, 128 * 64, 32, 1, 36, 36, 2).parents == 4
    narrow = launch_plan(288, 128 * 64, 32, 1, 16, 16, 4)
    assert (narrow.parents, narrow.wide) == (32, False)


def test_float32_input_gradients_keep_the_products_k_small() -> None:
    """Self-routing's conv layer of 6x6 poses, float32: one block of its 32 parents made the
    input gradient's product ``[8, 256] x [256, 8]`` as three tf32 products, 246 registers on
    sm_90a; blocks of 8 parents (K = 64) hold 92. bf16 products keep the whole block."""
    assert launch_plan(32 * 9, 128 * 25, 32, 6, 6, 6, 4).x_parents == 8
    assert launch_plan(32 * 9, 128 * 25, 32, 6, 6, 6, 2).x_parents == 32


def test_em_e_step_kernels_split_100_parents_of_6x6_poses() -> None:
    """cifar100-em's class layer: one program held all 128 padded parents of 6x6 poses
    (``[1, 8, 128, 8]`` tiles, 16 warps, 128 registers a thread) and spilled on sm_90a; the
    E-step's kernels take 32 parents a program at 4 warps. 32 parents fit in one block."""
    p = launch_plan(32 * 25, 128, 100, 6, 6, 6, 4)
    assert (p.mp, p.e_parents, p.e_warps, p.e_grid(128, 100)) == (128, 32, 4, (512, p.spans))
    assert launch_plan(32 * 9, 128 * 25, 32, 6, 6, 6, 4).e_parents == 32
