// The weighted pass (capsctl/layers/passes/weighted.py): s[B, a, c, m] = sum_J r V with given
// coefficients r[J, B, m] (self-routing), and its backward: dR = sum_d V gq, dV = r gq.
// Same loops and layouts as routed.cpp.

#include <algorithm>
#include <cstdint>

#include "pairs.h"

namespace {

template <int A, int X, int C, int M>
void weighted_forward(const float* __restrict x, const float* __restrict w,
                      const float* __restrict r, float* __restrict s, const Dims& dd,
                      int64_t b0, int64_t b1) {
  constexpr int64_t BF = forward_block<A, X>();
  const Shape<A, X, C, M> sh(dd);
  const int64_t d = sh.d(), m = sh.m(), dm = sh.dm();
  const Scratch scratch(BF * dm);
  auto start = [&](int64_t lo, int64_t hi) { std::fill(s + lo * dm, s + hi * dm, 0.f); };
  auto site = [&](int64_t j, int64_t b, const float*, const float* __restrict v) {
    add_weighted(s + b * dm, r + (j * dd.b + b) * m, v, d, m);
  };
  for_pairs<BF>(x, w, dd, sh, scratch.data(), true, b0, b1, start, site, no_done);
}

template <int A, int X, int C, int M>
void weighted_backward(const float* __restrict x, const float* __restrict w,
                       const float* __restrict wt, const float* __restrict r,
                       const float* __restrict gq, float* __restrict gx, float* __restrict gw,
                       float* __restrict gr, const Dims& dd, int64_t b0, int64_t b1) {
  const Shape<A, X, C, M> sh(dd);
  const VoteGrads<A, X, C, M> vg(sh, x, wt, gx, gw, dd.b, b0);
  const int64_t d = sh.d(), m = sh.m(), dm = sh.dm();
  constexpr int64_t BS = backward_block<A, X>();
  const Scratch scratch(BS * dm);
  auto start = [](int64_t, int64_t) {};
  auto site = [&](int64_t j, int64_t b, const float* __restrict wj, const float* __restrict v) {
    const float* __restrict rj = r + (j * dd.b + b) * m;
    const float* __restrict gqb = gq + b * dm;
    if (gr != nullptr) dot_d(v, gqb, gr + (j * dd.b + b) * m, sh);
    if (!vg.wanted()) return;
    float* __restrict gv = vg.slot(b);
    for (int64_t i = 0; i < d; ++i) {
#pragma omp simd
      for (int64_t k = 0; k < m; ++k) gv[i * m + k] = rj[k] * gqb[i * m + k];
    }
    vg.pair(j, b, wj, gv);
  };
  auto done = [&](int64_t j, int64_t lo, int64_t hi, const float* wj) { vg.block(j, lo, hi, wj); };
  for_pairs<BS>(x, w, dd, sh, scratch.data(), gr != nullptr, b0, b1, start, site, done);
}

}  // namespace

extern "C" {

void capsctl_weighted_forward(const float* x, const float* w, const float* r, float* s,
                              int64_t j, int64_t b, int64_t a, int64_t xd, int64_t c, int64_t m,
                              int64_t b0, int64_t b1) {
  const Dims dd{j, b, a, xd, c, m};
  CAPSCTL_DISPATCH(weighted_forward, x, w, r, s, dd, b0, b1);
}

void capsctl_weighted_backward(const float* x, const float* w, const float* wt, const float* r,
                               const float* gq, float* gx, float* gr, float* gw, int64_t j,
                               int64_t b, int64_t a, int64_t xd, int64_t c, int64_t m, int64_t b0,
                               int64_t b1) {
  const Dims dd{j, b, a, xd, c, m};
  CAPSCTL_DISPATCH(weighted_backward, x, w, wt, r, gq, gx, gw, gr, dd, b0, b1);
}

}  // extern "C"
