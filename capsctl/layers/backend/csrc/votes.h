// The building blocks every vote-sized pass shares (routed.cpp, weighted.cpp, gated.cpp,
// em.cpp): blocks of sites, aligned scratch, the pose and parent sizes (compile-time where
// fixed), the votes' product of a block of sites and the per-pair sums and products of the
// votes and their gradients. Letters and layouts as in capsctl/layers/passes/routed.py:
//   x[J, B, a, x]   child poses            w[J, x, c, m]  weights (parent type innermost)
// a pair's votes v[a, c, m] (d = a*c entries per parent type). Built by
// capsctl/layers/backend/native.py, whose cache key covers every header of this folder.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "simd16.h"

namespace {

// Sites per block: the loop over children runs once per block and builds the votes of the
// block's sites together (each child's weights are read once per block, a column strip at a
// time from the first-level cache), while the block's parents (pq, s, gq, gp: BT * a*c*m floats
// each) stay in the first two cache levels.
constexpr int64_t BT = 16;
// Sites per block of a forward pass (which keeps no per-site gradients): 64 for 16-d pose
// vectors, whose weights (32 KiB a child at 32 parent types) were read once per 16 sites
// (forward 33.6 -> 30.3 ms on one thread, J=288, 400 sites); BT otherwise (4x4 matrices: 64 made
// EM's forward passes 15-30% slower, their per-site sums outgrowing the first-level cache).
template <int A, int X>
constexpr int64_t forward_block() {
  return A == 1 && X == 16 ? 64 : BT;
}
// Sites per block of a backward pass: 64 for 16-d pose vectors too, whose weights, their
// transpose and their gradient (32 KiB each a child at 32 parent types, 27 MiB for the 288
// children of a conv layer) were read, and the gradient written, once per 16 sites from beyond
// the second-level cache (the routed backward pass of J=288, 800 sites on one thread: 208-219 ->
// 161-164 ms); BT otherwise.
template <int A, int X>
constexpr int64_t backward_block() {
  return A == 1 && X == 16 ? 64 : BT;
}
// Columns of the weights per strip of the votes' product: one 512-bit vector of floats.
constexpr int64_t TC = 16;

// Scratch of n floats on a 64-byte boundary: vectorized loops split their work by the alignment
// of their operands, so an unaligned scratch could change the order of a sum from call to call
// (and with it the last bits of a result); aligned, every site is computed alike in every run
// and on every thread.
struct Scratch {
  std::unique_ptr<float, decltype(&std::free)> p;
  explicit Scratch(int64_t n)
      : p(static_cast<float*>(std::aligned_alloc(64, ((n * 4 + 63) / 64) * 64)), &std::free) {}
  float* data() const { return p.get(); }
};

struct Dims {
  int64_t j, b, a, x, c, m;
};

// The pose and parent sizes, compile-time constants where the template argument is > 0 (so the
// loops over them unroll and the compiler keeps a pair's logits in registers), else read at run
// time.
template <int A, int X, int C, int M>
struct Shape {
  static constexpr int64_t kD = A > 0 && C > 0 ? A * C : 0;  // d and m, 0 where not constant
  static constexpr int64_t kM = M;
  static constexpr int64_t kX = X;  // x, 0 where not constant
  int64_t a_, x_, c_, m_;
  explicit Shape(const Dims& dd) : a_(dd.a), x_(dd.x), c_(dd.c), m_(dd.m) {}
  int64_t a() const {
    if constexpr (A > 0) return A;
    return a_;
  }
  int64_t x() const {
    if constexpr (X > 0) return X;
    return x_;
  }
  int64_t c() const {
    if constexpr (C > 0) return C;
    return c_;
  }
  int64_t m() const {
    if constexpr (M > 0) return M;
    return m_;
  }
  int64_t cm() const { return c() * m(); }
  int64_t d() const { return a() * c(); }
  int64_t dm() const { return a() * c() * m(); }
  int64_t ax() const { return a() * x(); }
};

// Rows of the votes' product whose accumulators live in registers at once: each weight vector
// loaded once serves kVoteRows rows, and the rows' multiply-adds form kVoteRows independent
// chains (one chain a row, as a plain loop over the rows compiles, waits out the latency of
// every multiply-add: the product ran at a quarter of the core's rate). 4 rows of 16 floats take
// 8 of AVX2's 16 registers; 8 rows take 8 of AVX-512's 32.
#if defined(__AVX512F__)
constexpr int64_t kVoteRows = 8;
#else
constexpr int64_t kVoteRows = 4;
#endif

// R rows of the votes from the strip of TC columns at t0: v[r, t0:t0+TC] = x[r, :] @ w_j[:, strip]
template <int64_t R, int64_t XN>
inline void vote_rows(const float* __restrict xr, const float* __restrict wj,
                      float* __restrict vr, int64_t x_n, int64_t cm) {
  const int64_t n = XN > 0 ? XN : x_n;
#if defined(__AVX512F__)
  v16 acc[R];
  const v16 w0 = load16(wj);
#pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r) acc[r] = xr[r * n] * w0;
  for (int64_t k = 1; k < n; ++k) {
    const v16 wv = load16(wj + k * cm);
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; ++r) acc[r] += xr[r * n + k] * wv;
  }
#pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r) __builtin_memcpy(vr + r * cm, &acc[r], sizeof(v16));
#else
  // two halves of eight floats a row (an array of 16-float vectors lived on the stack)
  v8 lo[R], hi[R];
  const v8 wl0 = load8(wj), wh0 = load8(wj + 8);
#pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r) {
    const float xv = xr[r * n];
    lo[r] = xv * wl0;
    hi[r] = xv * wh0;
  }
  for (int64_t k = 1; k < n; ++k) {
    const v8 wl = load8(wj + k * cm), wh = load8(wj + k * cm + 8);
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; ++r) {
      const float xv = xr[r * n + k];
      lo[r] += xv * wl;
      hi[r] += xv * wh;
    }
  }
#pragma GCC unroll 8
  for (int64_t r = 0; r < R; ++r) {
    __builtin_memcpy(vr + r * cm, &lo[r], sizeof(v8));
    __builtin_memcpy(vr + r * cm + 8, &hi[r], sizeof(v8));
  }
#endif
}

// votes v[r, c*m] = x[r, :] @ w_j[:, c*m] for the rows r = (site, a) of a block of sites:
// a strip of TC columns of w_j at a time, hot in the cache for every row, kVoteRows rows at once
template <class S>
inline void block_votes(const float* __restrict xb, const float* __restrict wj,
                        float* __restrict v, int64_t rows, const S& sh) {
  constexpr int64_t XN = S::kX;
  const int64_t x_n = sh.x(), cm = sh.cm();
  int64_t t0 = 0;
  for (; t0 + TC <= cm; t0 += TC) {
    int64_t r = 0;
    for (; r + kVoteRows <= rows; r += kVoteRows)
      vote_rows<kVoteRows, XN>(xb + r * x_n, wj + t0, v + r * cm + t0, x_n, cm);
    for (; r < rows; ++r) vote_rows<1, XN>(xb + r * x_n, wj + t0, v + r * cm + t0, x_n, cm);
  }
  const int64_t rest = cm - t0;  // columns after the last whole strip
  for (int64_t r = 0; rest > 0 && r < rows; ++r) {
    const float* __restrict xr = xb + r * x_n;
    float* __restrict vr = v + r * cm + t0;
    for (int64_t t = 0; t < rest; ++t) {
      float acc = xr[0] * wj[t0 + t];
      for (int64_t k = 1; k < x_n; ++k) acc += xr[k] * wj[k * cm + t0 + t];
      vr[t] = acc;
    }
  }
}

// out[m] = sum_{d} v[d, m] * q[d, m]
inline void dot_d(const float* __restrict v, const float* __restrict q, float* __restrict out,
                  int64_t d, int64_t m) {
  for (int64_t k = 0; k < m; ++k) out[k] = 0.f;
  for (int64_t i = 0; i < d; ++i) {
    const float* __restrict vi = v + i * m;
    const float* __restrict qi = q + i * m;
#pragma omp simd
    for (int64_t k = 0; k < m; ++k) out[k] += vi[k] * qi[k];
  }
}

// The same for compile-time sizes, as four partial sums over d (rows i, i+1, i+2, i+3) added at
// the end: four chains of multiply-adds side by side instead of one chain of d dependent ones
template <int64_t D, int64_t M>
inline void dot_d_fixed(const float* __restrict v, const float* __restrict q,
                        float* __restrict out) {
  constexpr int64_t P = 4;
  float part[P][M];
  for (int64_t p = 0; p < P; ++p) {
#pragma omp simd
    for (int64_t k = 0; k < M; ++k) part[p][k] = v[p * M + k] * q[p * M + k];
  }
  for (int64_t i = P; i < D; i += P) {
    for (int64_t p = 0; p < P; ++p) {
#pragma omp simd
      for (int64_t k = 0; k < M; ++k) part[p][k] += v[(i + p) * M + k] * q[(i + p) * M + k];
    }
  }
#pragma omp simd
  for (int64_t k = 0; k < M; ++k) out[k] = (part[0][k] + part[1][k]) + (part[2][k] + part[3][k]);
}

template <class S>
inline void dot_d(const float* __restrict v, const float* __restrict q, float* __restrict out,
                  const S& sh) {
  if constexpr (S::kD > 0 && S::kD % 4 == 0 && S::kM > 0) {
    dot_d_fixed<S::kD, S::kM>(v, q, out);
  } else {
    dot_d(v, q, out, sh.d(), sh.m());
  }
}

inline void softmax(float* __restrict l, int64_t m) {
  // the maximum as a vector reduction: std::max, which returns a reference, compiled to a
  // chain of compares and stores through the stack (a quarter of a routing pass of 16 parents)
  float mx = l[0];
#pragma omp simd reduction(max : mx)
  for (int64_t k = 1; k < m; ++k) mx = l[k] > mx ? l[k] : mx;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t k = 0; k < m; ++k) {
    l[k] = expf(l[k] - mx);
    sum += l[k];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t k = 0; k < m; ++k) l[k] *= inv;
}

// acc[d, m] += coef[m] * v[d, m]
inline void add_weighted(float* __restrict acc, const float* __restrict coef,
                         const float* __restrict v, int64_t d, int64_t m) {
  for (int64_t i = 0; i < d; ++i) {
#pragma omp simd
    for (int64_t k = 0; k < m; ++k) acc[i * m + k] += coef[k] * v[i * m + k];
  }
}

// From the votes' gradient gv[a, c, m] of one pair: gx[a, x] = gv W^T.
template <class S>
inline void grad_x(const float* __restrict wj, const float* __restrict gv, float* __restrict gxa,
                   const S& sh) {
  const int64_t a_n = sh.a(), x_n = sh.x(), cm = sh.cm();
  for (int64_t a = 0; a < a_n; ++a) {
    const float* __restrict ga = gv + a * cm;
    for (int64_t k = 0; k < x_n; ++k) {
      const float* __restrict wk = wj + k * cm;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t t = 0; t < cm; ++t) acc += ga[t] * wk[t];
      gxa[a * x_n + k] = acc;
    }
  }
}

// The first n < 16 floats at p in a vector, the other lanes zero (n a compile-time constant
// where it matters: the copy is then one masked or narrower load).
inline v16 load_part(const float* p, int64_t n) {
  v16 v = {};
  __builtin_memcpy(&v, p, n * sizeof(float));
  return v;
}

// grad_x for a 4x4 pose (a*x = 16) and a compile-time c*m: the 16 dot products of length c*m
// accumulated lane-wise, then summed by one tree, gx[a, x] written as one vector. A last strip
// of fewer than 16 columns (c*m = 40 for 10 parent types) is loaded zero-padded: summed lane by
// lane as one reduction each, those 16 dot products were 70% of the routed backward pass of a
// class capsule layer (a store-to-load stall per reduction).
template <class S>
inline void grad_x16(const float* __restrict wj, const float* __restrict gv,
                     float* __restrict gxa, const S& sh) {
  const int64_t cm = sh.cm();
#if !defined(__AVX512F__)
  // without AVX-512: 8-float vectors, two rows of the pose at a time (8 accumulators, 4
  // weight vectors and a gradient vector in AVX2's 16 registers; 16 vectors of 16 floats
  // lived on the stack), each accumulator's lanes summed at the end
  for (int a0 = 0; a0 < 4; a0 += 2) {
    v8 acc[8] = {};
    int64_t t = 0;
    for (; t + 8 <= cm; t += 8) {
      v8 w[4];
      for (int k = 0; k < 4; ++k) w[k] = load8(wj + k * cm + t);
      for (int a = 0; a < 2; ++a) {
        const v8 g = load8(gv + (a0 + a) * cm + t);
        for (int k = 0; k < 4; ++k) acc[a * 4 + k] += g * w[k];
      }
    }
    for (int i = 0; i < 8; ++i) {
      const int a = a0 + i / 4, k = i % 4;
      float sum = 0.f;
      for (int l = 0; l < 8; ++l) sum += acc[i][l];
      for (int64_t u = t; u < cm; ++u) sum += gv[a * cm + u] * wj[k * cm + u];  // c*m % 8
      gxa[a * 4 + k] = sum;
    }
  }
#else
  v16 acc[16] = {};
  int64_t t = 0;
  for (; t + 16 <= cm; t += 16) {
    v16 w[4];
    for (int k = 0; k < 4; ++k) w[k] = load16(wj + k * cm + t);
    for (int a = 0; a < 4; ++a) {
      const v16 g = load16(gv + a * cm + t);
      for (int k = 0; k < 4; ++k) acc[a * 4 + k] += g * w[k];
    }
  }
  if (t < cm) {
    v16 w[4];
    for (int k = 0; k < 4; ++k) w[k] = load_part(wj + k * cm + t, cm - t);
    for (int a = 0; a < 4; ++a) {
      const v16 g = load_part(gv + a * cm + t, cm - t);
      for (int k = 0; k < 4; ++k) acc[a * 4 + k] += g * w[k];
    }
  }
  const v16 out = lane_sums(acc);
  __builtin_memcpy(gxa, &out, sizeof out);
#endif
}

// ... and gw_j[x, c, m] += X^T gv (the child's weights' gradient, one site's share).
template <class S>
inline void grad_w(const float* __restrict xa, const float* __restrict gv, float* __restrict gwj,
                   const S& sh) {
  const int64_t a_n = sh.a(), x_n = sh.x(), cm = sh.cm();
  for (int64_t k = 0; k < x_n; ++k) {
    float* __restrict gwk = gwj + k * cm;
#pragma omp simd
    for (int64_t t = 0; t < cm; ++t) {  // each gradient entry loaded and stored once
      float acc = gwk[t];
      for (int64_t a = 0; a < a_n; ++a) acc += xa[a * x_n + k] * gv[a * cm + t];
      gwk[t] = acc;
    }
  }
}

}  // namespace
