// The routed pass of inverted dot-product attention routing (Tsai et al., ICLR 2020) as fused
// loops: one child at a block of parent sites at a time, its votes held in a few KiB of scratch,
// so that building the votes, the agreement, the softmax over parents and the weighted sum run
// from the core's first two cache levels instead of as a dozen separate passes over vote-sized
// tiles.
//
// Same math, letters and layouts as capsctl/layers/passes/routed.py (its chunked pass is the
// reference these loops are tested against):
//   x[J, B, a, x]   child poses            w[J, x, c, m]  weights (parent type innermost)
//   pq[B, a, c, m]  scale * parent poses   s[B, a, c, m]  sum_J R V
//   r[J, B, m]      R = softmax_m(sum_{a,c} V pq)
// Backward, from gq[B, a, c, m] = d loss / d S:
//   dR = sum_d V gq; dA = R (dR - sum_m R dR); gp = sum_J dA V (the caller multiplies by scale);
//   dV = R gq + dA pq; gx = dV W^T; gw = sum_B X^T dV.
// Every function handles the sites [b0, b1) of the batch; the caller runs disjoint ranges in
// parallel threads, each with its own gw accumulator. Built by capsctl/layers/backend/native.py.

#include <algorithm>
#include <cstdint>

#include "pairs.h"

namespace {

template <int A, int X, int C, int M>
void forward(const float* __restrict x, const float* __restrict w, const float* __restrict pq,
             float* __restrict s, float* __restrict r, const Dims& dd, int64_t b0, int64_t b1) {
  constexpr int64_t BF = forward_block<A, X>();
  const Shape<A, X, C, M> sh(dd);
  const int64_t d = sh.d(), m = sh.m(), dm = sh.dm();
  const Scratch scratch(BF * dm + m);
  float* __restrict lg = scratch.data() + BF * dm;
  auto start = [&](int64_t lo, int64_t hi) { std::fill(s + lo * dm, s + hi * dm, 0.f); };
  auto site = [&](int64_t j, int64_t b, const float*, const float* __restrict v) {
    dot_d(v, pq + b * dm, lg, sh);
    softmax(lg, m);
    float* __restrict rj = r + (j * dd.b + b) * m;
    for (int64_t k = 0; k < m; ++k) rj[k] = lg[k];
    add_weighted(s + b * dm, lg, v, d, m);
  };
  for_pairs<BF>(x, w, dd, sh, scratch.data(), true, b0, b1, start, site, no_done);
}

template <int A, int X, int C, int M>
void backward(const float* __restrict x, const float* __restrict w, const float* __restrict wt,
              const float* __restrict pq, const float* __restrict r, const float* __restrict gq,
              float* __restrict gx, float* __restrict gw, float* __restrict gp, const Dims& dd,
              int64_t b0, int64_t b1) {
  const Shape<A, X, C, M> sh(dd);
  const VoteGrads<A, X, C, M> vg(sh, x, wt, gx, gw, dd.b, b0);
  const int64_t d = sh.d(), m = sh.m(), dm = sh.dm();
  constexpr int64_t BS = backward_block<A, X>();
  const Scratch scratch(BS * dm + 2 * m);
  float* __restrict dr = scratch.data() + BS * dm;
  float* __restrict da = dr + m;
  auto start = [&](int64_t lo, int64_t hi) {
    if (gp != nullptr) std::fill(gp + lo * dm, gp + hi * dm, 0.f);
  };
  auto site = [&](int64_t j, int64_t b, const float* __restrict wj, const float* __restrict v) {
    const float* __restrict rj = r + (j * dd.b + b) * m;
    const float* __restrict gqb = gq + b * dm;
    const float* __restrict pqb = pq + b * dm;
    dot_d(v, gqb, dr, sh);
    float dot = 0.f;
    for (int64_t k = 0; k < m; ++k) dot += rj[k] * dr[k];
    for (int64_t k = 0; k < m; ++k) da[k] = rj[k] * (dr[k] - dot);
    if (gp != nullptr) add_weighted(gp + b * dm, da, v, d, m);
    if (!vg.wanted()) return;
    float* __restrict gv = vg.slot(b);
    for (int64_t i = 0; i < d; ++i) {
#pragma omp simd
      for (int64_t k = 0; k < m; ++k)
        gv[i * m + k] = rj[k] * gqb[i * m + k] + da[k] * pqb[i * m + k];
    }
    vg.pair(j, b, wj, gv);
  };
  auto done = [&](int64_t j, int64_t lo, int64_t hi, const float* wj) { vg.block(j, lo, hi, wj); };
  for_pairs<BS>(x, w, dd, sh, scratch.data(), true, b0, b1, start, site, done);
}

}  // namespace

extern "C" {

void capsctl_routed_forward(const float* x, const float* w, const float* pq, float* s, float* r,
                            int64_t j, int64_t b, int64_t a, int64_t xd, int64_t c, int64_t m,
                            int64_t b0, int64_t b1) {
  const Dims dd{j, b, a, xd, c, m};
  CAPSCTL_DISPATCH(forward, x, w, pq, s, r, dd, b0, b1);
}

void capsctl_routed_backward(const float* x, const float* w, const float* wt, const float* pq,
                             const float* r, const float* gq, float* gx, float* gp, float* gw,
                             int64_t j, int64_t b, int64_t a, int64_t xd, int64_t c, int64_t m,
                             int64_t b0, int64_t b1) {
  const Dims dd{j, b, a, xd, c, m};
  CAPSCTL_DISPATCH(backward, x, w, wt, pq, r, gq, gx, gw, gp, dd, b0, b1);
}

}  // extern "C"
