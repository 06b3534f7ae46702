// The calling convention of the library's extern "C" functions, and its version: the one place
// the version is written (capsctl/layers/backend/native.py reads it from this file and refuses
// a library that reports another; abi.cpp reports it).
//
// Every pass function takes its pointers, then the sizes J, B, a, x, c, m and the sites
// [b0, b1); a backward pass also takes the weights transposed, wt[J, c*m, x], after w (read by
// the loops of 16-d pose vectors where gx is wanted; may be null otherwise), and the calling
// thread's weight-gradient accumulator as its last pointer (zeroed by the loops). The
// LayerNorm's functions (layer_norm.cpp) take rows [r0, r1) instead. Routing by agreement
// (agreement.cpp) takes the iterations T, the sites of a block and whether the block keeps its
// votes (1) or builds them again for each use (0) between m and b0.
#pragma once

#define CAPSCTL_KERNELS_ABI 7
