// The loop every vote-sized pass runs (for_pairs: each block of parent sites, each child's
// votes at those sites) and the gradients of the child poses and weights from the votes'
// gradients (VoteGrads), shared by routed.cpp, weighted.cpp, gated.cpp and em.cpp; and the
// dispatch of a pass to the sizes compiled in (CAPSCTL_DISPATCH).
#pragma once

#include <algorithm>
#include <cstdint>

#include "votes.h"

namespace {

// The gradients of x and w from the votes' gradients g[a, c, m] of the pairs (j, b) of one
// block of sites (backward_block of them). Per pair (grad_x, grad_w) in general; for 16-d pose
// vectors, whose weights (16 x c*m floats per child) outgrow the first-level cache, per block:
// the block's gradients are kept (slot) and both products run once per child over the whole
// block (block), each weight row read once per block instead of once per site.
template <int A, int X, int C, int M>
struct VoteGrads {
  static constexpr bool kBlock = A == 1 && X == 16;
  // the sites of a block (backward_block): the passes run for_pairs with the same number
  static constexpr int64_t kSites = backward_block<A, X>();
  // Sites whose dX block() sums at once, their accumulators in registers: 16 vectors of 16
  // floats take 16 of AVX-512's 32 registers; without AVX-512, 4 sites' 8 vectors of 8 floats
  // take 8 of AVX2's 16 (16 vectors of 16 floats lived on the stack: dX took 4.7x the forward
  // pass on an AVX2 CPU, J=288, B=1568, one thread).
#if defined(__AVX512F__)
  static constexpr int64_t kGxRows = BT;
#else
  static constexpr int64_t kGxRows = 4;
#endif
  static_assert(kSites % kGxRows == 0, "block() takes a block's dX kGxRows sites at a time");
  const Shape<A, X, C, M>& sh;
  const float* __restrict x;
  const float* __restrict wt;  // the weights transposed, [J, c*m, x] (kBlock with gx only)
  float* __restrict gx;
  float* __restrict gw;
  int64_t nb, b0;
  Scratch buf;  // the block's votes' gradients [kSites, dm] (one slot without kBlock)

  VoteGrads(const Shape<A, X, C, M>& s, const float* x_, const float* wt_, float* gx_,
            float* gw_, int64_t nb_, int64_t b0_)
      : sh(s), x(x_), wt(wt_), gx(gx_), gw(gw_), nb(nb_), b0(b0_),
        buf(kBlock ? kSites * s.dm() : s.dm()) {}

  bool wanted() const { return gx != nullptr || gw != nullptr; }
  // where the gradient of pair (j, b) goes
  float* slot(int64_t b) const {
    return kBlock ? buf.data() + ((b - b0) % kSites) * sh.dm() : buf.data();
  }

  // where the gradient of the pair (j, lo + i) goes, for a block that starts at lo (any lo)
  float* slot_at(int64_t i) const { return kBlock ? buf.data() + i * sh.dm() : buf.data(); }

  void pair(int64_t j, int64_t b, const float* __restrict wj, const float* __restrict g) const {
    if constexpr (!kBlock) {
      const int64_t ax = sh.ax();
      if (gx != nullptr) {
        if constexpr (A == 4 && X == 4 && C > 0 && M > 0) {
          grad_x16(wj, g, gx + (j * nb + b) * ax, sh);
        } else {
          grad_x(wj, g, gx + (j * nb + b) * ax, sh);
        }
      }
      if (gw != nullptr) {
        float* __restrict gwj = gw + j * sh.x() * sh.cm();
        if (b == b0) std::fill(gwj, gwj + sh.x() * sh.cm(), 0.f);  // the thread's first site
        grad_w(x + (j * nb + b) * ax, g, gwj, sh);
      }
    }
  }

  void block(int64_t j, int64_t lo, int64_t hi, const float* __restrict wj) const {
    if constexpr (kBlock) {
      if (!wanted()) return;
      const int64_t cm = sh.cm(), rows = hi - lo;
      const float* __restrict g = buf.data();  // [kSites, cm], the first hi - lo rows
      const float* __restrict xb = x + (j * nb + lo) * X;  // [rows, 16]
      if (gx != nullptr) {
        const float* __restrict wtj = wt + j * cm * X;  // w_j^T [cm, 16]
        for (int64_t r0 = 0; r0 < rows; r0 += kGxRows) {  // kGxRows sites, in registers
          const float* __restrict gr = g + r0 * cm;
          float* __restrict gxb = gx + (j * nb + lo + r0) * X;
          // gx[r, :] = g[r, :] @ w_j^T: the votes' product's register tile, rows of c*m
          if (rows - r0 >= kGxRows) {
            vote_rows<kGxRows, 0>(gr, wtj, gxb, cm, X);
          } else {
            for (int64_t r = 0; r < rows - r0; ++r)
              vote_rows<1, 0>(gr + r * cm, wtj, gxb + r * X, cm, X);
          }
        }
      }
      if (gw != nullptr) {
        float* __restrict gwj = gw + j * X * cm;
#if !defined(__AVX512F__)
        // without AVX-512: strips of 8 columns, half of the 16 pose entries at a time, so
        // that the 8 accumulators stay in AVX2 registers (16 x 16 floats spilled)
        for (int64_t t0 = 0; t0 < cm; t0 += 8) {
          for (int64_t k0 = 0; k0 < X; k0 += 8) {
            v8 acc[8];
            for (int64_t k = 0; k < 8; ++k)
              acc[k] = lo == b0 ? v8{} : load8(gwj + (k0 + k) * cm + t0);
            for (int64_t r = 0; r < rows; ++r) {
              const v8 gv = load8(g + r * cm + t0);
#pragma GCC unroll 8
              for (int64_t k = 0; k < 8; ++k) acc[k] += xb[r * X + k0 + k] * gv;
            }
            for (int64_t k = 0; k < 8; ++k)
              __builtin_memcpy(gwj + (k0 + k) * cm + t0, &acc[k], sizeof(v8));
          }
        }
#else
        for (int64_t t0 = 0; t0 < cm; t0 += TC) {  // cm = 16 * m: whole strips
          float acc[X][TC];  // from 0 at the thread's first block
          for (int64_t k = 0; k < X; ++k)
            for (int64_t t = 0; t < TC; ++t) acc[k][t] = lo == b0 ? 0.f : gwj[k * cm + t0 + t];
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t k = 0; k < X; ++k) {
              const float xv = xb[r * X + k];
#pragma omp simd
              for (int64_t t = 0; t < TC; ++t) acc[k][t] += xv * g[r * cm + t0 + t];
            }
          }
          for (int64_t k = 0; k < X; ++k)
            for (int64_t t = 0; t < TC; ++t) gwj[k * cm + t0 + t] = acc[k][t];
        }
#endif
      }
    }
  }
};

// The loop every pass shares: for each block of sites in [b0, b1), start(lo, hi); then for each
// child j, the votes of the block's sites (into vb), site(j, b, wj, v) for each site b with its
// votes v[a, c, m], then done(j, lo, hi, wj). want_votes == false skips the votes' product (a
// pass that needs none).
// The done() of a pass with nothing to finish per child and block.
constexpr auto no_done = [](int64_t, int64_t, int64_t, const float*) {};

template <int64_t BS = BT, class S, class Start, class Site, class Done>
inline void for_pairs(const float* __restrict x, const float* __restrict w, const Dims& dd,
                      const S& sh, float* __restrict vb, bool want_votes, int64_t b0, int64_t b1,
                      Start start, Site site, Done done) {
  const int64_t dm = sh.dm(), ax = sh.ax(), wn = sh.x() * sh.cm();
  for (int64_t lo = b0; lo < b1; lo += BS) {
    const int64_t hi = std::min(b1, lo + BS);
    start(lo, hi);
    for (int64_t j = 0; j < dd.j; ++j) {
      const float* __restrict wj = w + j * wn;
      if (want_votes) block_votes(x + (j * dd.b + lo) * ax, wj, vb, (hi - lo) * sh.a(), sh);
      for (int64_t b = lo; b < hi; ++b) site(j, b, wj, vb + (b - lo) * dm);
      done(j, lo, hi, wj);
    }
  }
}

}  // namespace

// Runs f<A, X, C, M>() with the sizes fixed at compile time for 4x4 pose matrices, 16-d pose
// vectors and the usual parent counts (32 and 16 capsule types, 10 classes), at run time
// otherwise. 16 types (mnist-caps, multimnist-caps) compiled in made their routed pass 1.2-1.5x
// (16-d vectors) and 1.5-2.8x (4x4 matrices) faster than the run-time loops (J=144, B=2304).
#define CAPSCTL_DISPATCH(f, ...)                          \
  do {                                                    \
    const bool square = dd.a == 4 && dd.x == 4 && dd.c == 4; \
    const bool vec16 = dd.a == 1 && dd.x == 16 && dd.c == 16; \
    if (square && dd.m == 32) {                           \
      f<4, 4, 4, 32>(__VA_ARGS__);                        \
    } else if (square && dd.m == 16) {                    \
      f<4, 4, 4, 16>(__VA_ARGS__);                        \
    } else if (square && dd.m == 10) {                    \
      f<4, 4, 4, 10>(__VA_ARGS__);                        \
    } else if (square) {                                  \
      f<4, 4, 4, 0>(__VA_ARGS__);                         \
    } else if (vec16 && dd.m == 32) {                     \
      f<1, 16, 16, 32>(__VA_ARGS__);                      \
    } else if (vec16 && dd.m == 16) {                     \
      f<1, 16, 16, 16>(__VA_ARGS__);                      \
    } else if (vec16 && dd.m == 10) {                     \
      f<1, 16, 16, 10>(__VA_ARGS__);                      \
    } else if (vec16) {                                   \
      f<1, 16, 16, 0>(__VA_ARGS__);                       \
    } else {                                              \
      f<0, 0, 0, 0>(__VA_ARGS__);                         \
    }                                                     \
  } while (0)
