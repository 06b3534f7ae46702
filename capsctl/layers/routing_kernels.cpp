// The routed pass of inverted dot-product attention routing (Tsai et al., ICLR 2020) as fused
// loops: one child at a block of parent sites at a time, its votes held in a few KiB of scratch,
// so that building the votes, the agreement, the softmax over parents and the weighted sum run
// from the core's first two cache levels instead of as a dozen separate passes over vote-sized
// tiles.
//
// Same math, letters and layouts as capsctl/layers/routing.py (its chunked pass is the
// reference these loops are tested against):
//   x[J, B, a, x]   child poses            w[J, x, c, m]  weights (parent type innermost)
//   pq[B, a, c, m]  scale * parent poses   s[B, a, c, m]  sum_J R V
//   r[J, B, m]      R = softmax_m(sum_{a,c} V pq)
// Backward, from gq[B, a, c, m] = d loss / d S:
//   dR = sum_d V gq; dA = R (dR - sum_m R dR); gp = sum_J dA V (the caller multiplies by scale);
//   dV = R gq + dA pq; gx = dV W^T; gw = sum_B X^T dV.
// Every function handles the sites [b0, b1) of the batch; the caller runs disjoint ranges in
// parallel threads, each with its own gw accumulator. Built by capsctl/layers/native.py.

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

// votes v[r, c*m] = x[r, :] @ w_j[:, c*m] for the rows r = (site, a) of a block of sites:
// a strip of TC columns of w_j at a time, hot in the cache for every row
template <class S>
inline void block_votes(const float* __restrict xb, const float* __restrict wj,
                        float* __restrict v, int64_t rows, const S& sh) {
  const int64_t x_n = sh.x(), cm = sh.cm();
  int64_t t0 = 0;
  for (; t0 + TC <= cm; t0 += TC) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* __restrict xr = xb + r * x_n;
      float* __restrict vr = v + r * cm + t0;
#pragma omp simd
      for (int64_t t = 0; t < TC; ++t) {
        float acc = xr[0] * wj[t0 + t];
        for (int64_t k = 1; k < x_n; ++k) acc += xr[k] * wj[k * cm + t0 + t];
        vr[t] = acc;
      }
    }
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
  float mx = l[0];
  for (int64_t k = 1; k < m; ++k) mx = std::max(mx, l[k]);
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

// The gradients of x and w from the votes' gradients g[a, c, m] of the pairs (j, b) of one
// block of sites. Per pair (grad_x, grad_w) in general; for 16-d pose vectors, whose weights
// (16 x c*m floats per child) outgrow the first-level cache, per block: the block's gradients
// are kept (slot) and both products run once per child over the whole block (block), each
// weight row read once per block instead of once per site.
template <int A, int X, int C, int M>
struct VoteGrads {
  static constexpr bool kBlock = A == 1 && X == 16;
  const Shape<A, X, C, M>& sh;
  const float* __restrict x;
  const float* __restrict wt;  // the weights transposed, [J, c*m, x] (kBlock with gx only)
  float* __restrict gx;
  float* __restrict gw;
  int64_t nb, b0;
  Scratch buf;  // the block's votes' gradients [BT, dm] (one slot without kBlock)

  VoteGrads(const Shape<A, X, C, M>& s, const float* x_, const float* wt_, float* gx_,
            float* gw_, int64_t nb_, int64_t b0_)
      : sh(s), x(x_), wt(wt_), gx(gx_), gw(gw_), nb(nb_), b0(b0_),
        buf(kBlock ? BT * s.dm() : s.dm()) {}

  bool wanted() const { return gx != nullptr || gw != nullptr; }
  // where the gradient of pair (j, b) goes
  float* slot(int64_t b) const { return kBlock ? buf.data() + ((b - b0) % BT) * sh.dm() : buf.data(); }

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
      float* __restrict g = buf.data();  // [BT, cm]; rows past hi - lo are zeroed
      std::fill(g + rows * cm, g + BT * cm, 0.f);
      const float* __restrict xb = x + (j * nb + lo) * X;  // [rows, 16]
      if (gx != nullptr) {
        const float* __restrict wtj = wt + j * cm * X;  // w_j^T [cm, 16]
        float acc[BT][X] = {};
        for (int64_t t = 0; t < cm; ++t) {
          for (int64_t r = 0; r < BT; ++r) {
            const float gr = g[r * cm + t];
#pragma omp simd
            for (int64_t k = 0; k < X; ++k) acc[r][k] += gr * wtj[t * X + k];
          }
        }
        float* __restrict gxb = gx + (j * nb + lo) * X;
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t k = 0; k < X; ++k) gxb[r * X + k] = acc[r][k];
      }
      if (gw != nullptr) {
        float* __restrict gwj = gw + j * X * cm;
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
  const Scratch scratch(BT * dm + 2 * m);
  float* __restrict dr = scratch.data() + BT * dm;
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
  for_pairs(x, w, dd, sh, scratch.data(), true, b0, b1, start, site, done);
}

// The weighted pass (capsctl/layers/weighted_pass.py): s[B, a, c, m] = sum_J r V with given
// coefficients r[J, B, m] (self-routing), and its backward: dR = sum_d V gq, dV = r gq.
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
  const Scratch scratch(BT * dm);
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
  for_pairs(x, w, dd, sh, scratch.data(), gr != nullptr, b0, b1, start, site, done);
}

// Self-routing's whole pass (capsctl/layers/self_routing.py): the routing logits from the
// child's own pose, lg = X wr_j + br_j (wr[J, a*x, m], br[J, m]), the coefficients
// c = softmax_m(lg), the mass c a with the child activations act[B, J], the mass-weighted sum
// s[B, a, c, m] = sum_J c a V and the total mass tot[B, m] = sum_J c a; c is written out
// (cs[J, B, m]). Backward, from gs = d loss / d s and gt = d loss / d tot:
// dmass = sum_d V gs + gt; dact = sum_m dmass c; dlg = c (dmass a - sum_m c dmass a);
// dV = c a gs; and through the logits gx += wr_j dlg, gwr_j += X^T dlg, gbr_j += dlg.
template <int A, int X, int C, int M>
void gated_forward(const float* __restrict x, const float* __restrict w,
                   const float* __restrict wr, const float* __restrict br,
                   const float* __restrict act, float* __restrict s, float* __restrict tot,
                   float* __restrict cs, const Dims& dd, int64_t b0, int64_t b1) {
  constexpr int64_t BF = forward_block<A, X>();
  const Shape<A, X, C, M> sh(dd);
  const int64_t d = sh.d(), m = sh.m(), dm = sh.dm(), ax = sh.ax(), nb = dd.b, nj = dd.j;
  const Scratch scratch(BF * dm + m);
  float* __restrict mass = scratch.data() + BF * dm;
  auto start = [&](int64_t lo, int64_t hi) {
    std::fill(s + lo * dm, s + hi * dm, 0.f);
    std::fill(tot + lo * m, tot + hi * m, 0.f);
  };
  auto site = [&](int64_t j, int64_t b, const float*, const float* __restrict v) {
    const float* __restrict xa = x + (j * nb + b) * ax;
    const float* __restrict wrj = wr + j * ax * m;
    float* __restrict cj = cs + (j * nb + b) * m;
    for (int64_t k = 0; k < m; ++k) cj[k] = br[j * m + k];
    for (int64_t i = 0; i < ax; ++i) {
      const float xv = xa[i];
#pragma omp simd
      for (int64_t k = 0; k < m; ++k) cj[k] += xv * wrj[i * m + k];
    }
    softmax(cj, m);
    const float ab = act[b * nj + j];
    float* __restrict tb = tot + b * m;
    for (int64_t k = 0; k < m; ++k) {
      mass[k] = cj[k] * ab;
      tb[k] += mass[k];
    }
    add_weighted(s + b * dm, mass, v, d, m);
  };
  for_pairs<BF>(x, w, dd, sh, scratch.data(), true, b0, b1, start, site, no_done);
}

// gacc: the calling thread's accumulator of the weights' gradients, gw [J, x, c*m], then
// gwr [J, a*x, m], then gbr [J, m] (nullptr: none wanted).
template <int A, int X, int C, int M>
void gated_backward(const float* __restrict x, const float* __restrict w,
                    const float* __restrict wt, const float* __restrict wr,
                    const float* __restrict cs, const float* __restrict act,
                    const float* __restrict gs, const float* __restrict gt, float* __restrict gact,
                    float* __restrict gx, float* __restrict gacc, const Dims& dd, int64_t b0,
                    int64_t b1) {
  const Shape<A, X, C, M> sh(dd);
  const int64_t d = sh.d(), m = sh.m(), dm = sh.dm(), ax = sh.ax(), nb = dd.b, nj = dd.j;
  float* __restrict gwr = gacc == nullptr ? nullptr : gacc + nj * sh.x() * sh.cm();
  float* __restrict gbr = gwr == nullptr ? nullptr : gwr + nj * ax * m;
  const VoteGrads<A, X, C, M> vg(sh, x, wt, gx, gacc, nb, b0);
  const Scratch scratch(BT * dm + BT * m + 2 * m);
  float* __restrict glb = scratch.data() + BT * dm;  // the block's logits' gradients [BT, m]
  float* __restrict dmass = glb + BT * m;
  float* __restrict mass = dmass + m;
  const bool lgrad = gx != nullptr || gacc != nullptr;  // through the logits
  const bool coef = lgrad || gact != nullptr;
  auto start = [](int64_t, int64_t) {};
  auto site = [&](int64_t j, int64_t b, const float* __restrict wj, const float* __restrict v) {
    const float* __restrict cj = cs + (j * nb + b) * m;
    const float* __restrict gsb = gs + b * dm;
    const float ab = act[b * nj + j];
    if (coef) {
      dot_d(v, gsb, dmass, sh);
      float dot = 0.f, ga = 0.f;
      for (int64_t k = 0; k < m; ++k) {
        dmass[k] += gt[b * m + k];
        ga += dmass[k] * cj[k];
        dot += cj[k] * dmass[k] * ab;
      }
      if (gact != nullptr) gact[b * nj + j] = ga;
      float* __restrict gl = glb + (b - b0) % BT * m;
      for (int64_t k = 0; k < m; ++k) gl[k] = cj[k] * (dmass[k] * ab - dot);
    }
    if (!vg.wanted()) return;
    for (int64_t k = 0; k < m; ++k) mass[k] = cj[k] * ab;
    float* __restrict gv = vg.slot(b);
    for (int64_t i = 0; i < d; ++i) {
#pragma omp simd
      for (int64_t k = 0; k < m; ++k) gv[i * m + k] = mass[k] * gsb[i * m + k];
    }
    vg.pair(j, b, wj, gv);
  };
  // after the votes' share of gx is written (per pair, or per block in vg.block)
  auto done = [&](int64_t j, int64_t lo, int64_t hi, const float* wj) {
    vg.block(j, lo, hi, wj);
    if (!lgrad) return;
    const float* __restrict wrj = wr + j * ax * m;
    for (int64_t b = lo; b < hi; ++b) {
      const float* __restrict gl = glb + (b - b0) % BT * m;
      const float* __restrict xa = x + (j * nb + b) * ax;
      if (gx != nullptr) {
        float* __restrict gxa = gx + (j * nb + b) * ax;
        for (int64_t i = 0; i < ax; ++i) {
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t k = 0; k < m; ++k) acc += gl[k] * wrj[i * m + k];
          gxa[i] += acc;
        }
      }
      if (gwr != nullptr) {
        float* __restrict gwrj = gwr + j * ax * m;
        if (b == b0) {  // the thread's first site
          std::fill(gwrj, gwrj + ax * m, 0.f);
          std::fill(gbr + j * m, gbr + (j + 1) * m, 0.f);
        }
        for (int64_t i = 0; i < ax; ++i) {
          const float xv = xa[i];
#pragma omp simd
          for (int64_t k = 0; k < m; ++k) gwrj[i * m + k] += xv * gl[k];
        }
        for (int64_t k = 0; k < m; ++k) gbr[j * m + k] += gl[k];
      }
    }
  };
  for_pairs(x, w, dd, sh, scratch.data(), coef, b0, b1, start, site, done);
}

// EM routing's vote-sized work (capsctl/layers/em_kernels.py: VoteMoments, VoteQuad) on the
// shifted votes u = V - shift[B, a, c, m]: the M-step's moments S[2, B, a, c, m] = sum_J r a (u,
// u^2) and the mass M[B, m] = sum_J r a with assignments r[B, J, m] and child activations
// act[B, J], and the E-step's quadratic form Q[B, J, m] = sum_d (q u + p u^2) with
// qp[2, B, a, c, m]; each backward is the other.
// The assignment-sized operands are site-child-major, so a pair's m values are contiguous.
// The votes of a site are shifted in place (each site's are used once per child).
inline float* shifted(const float* v, const float* __restrict shift, int64_t dm) {
  float* __restrict u = const_cast<float*>(v);
#pragma omp simd
  for (int64_t t = 0; t < dm; ++t) u[t] -= shift[t];
  return u;
}

template <int A, int X, int C, int M>
void moments_forward(const float* __restrict x, const float* __restrict w,
                     const float* __restrict shift, const float* __restrict r,
                     const float* __restrict act, float* __restrict out, float* __restrict mass,
                     const Dims& dd, int64_t b0, int64_t b1) {
  constexpr int64_t BF = forward_block<A, X>();
  const Shape<A, X, C, M> sh(dd);
  const int64_t d = sh.d(), m = sh.m(), dm = sh.dm(), nb = dd.b, nj = dd.j;
  const Scratch scratch(BF * dm + m);
  float* __restrict ra = scratch.data() + BF * dm;
  // the block's masses, summed in double: EM's variances subtract terms divided by the mass, so
  // its rounding error grows there (a float sum over 800 children moved the class layer's
  // weight gradients by 5e-4 of their size)
  std::unique_ptr<double[]> macc(new double[BF * m]);
  auto start = [&](int64_t lo, int64_t hi) {
    std::fill(out + lo * dm, out + hi * dm, 0.f);
    std::fill(out + (nb + lo) * dm, out + (nb + hi) * dm, 0.f);
    std::fill(macc.get(), macc.get() + BF * m, 0.0);
  };
  auto site = [&](int64_t j, int64_t b, const float*, const float* v) {
    const float* __restrict u = shifted(v, shift + b * dm, dm);
    const float ab = act[b * nj + j];
    double* __restrict mb = macc.get() + (b - b0) % BF * m;
    for (int64_t k = 0; k < m; ++k) {
      ra[k] = r[(b * nj + j) * m + k] * ab;
      mb[k] += ra[k];
    }
    float* __restrict s1 = out + b * dm;
    float* __restrict s2 = out + (nb + b) * dm;
    for (int64_t i = 0; i < d; ++i) {
#pragma omp simd
      for (int64_t k = 0; k < m; ++k) {
        const float ru = ra[k] * u[i * m + k];
        s1[i * m + k] += ru;
        s2[i * m + k] += ru * u[i * m + k];
      }
    }
  };
  auto done = [&](int64_t j, int64_t lo, int64_t hi, const float*) {
    if (j + 1 < nj) return;
    for (int64_t t = 0; t < (hi - lo) * m; ++t) mass[lo * m + t] = static_cast<float>(macc[t]);
  };
  for_pairs<BF>(x, w, dd, sh, scratch.data(), true, b0, b1, start, site, done);
}

template <int A, int X, int C, int M>
void moments_backward(const float* __restrict x, const float* __restrict w,
                      const float* __restrict wt, const float* __restrict shift,
                      const float* __restrict r, const float* __restrict act,
                      const float* __restrict gs, const float* __restrict gm, float* __restrict gr,
                      float* __restrict ga, float* __restrict gx, float* __restrict gw,
                      const Dims& dd, int64_t b0, int64_t b1) {
  const Shape<A, X, C, M> sh(dd);
  const int64_t d = sh.d(), m = sh.m(), dm = sh.dm();
  const int64_t nb = dd.b, nj = dd.j;
  const VoteGrads<A, X, C, M> vg(sh, x, wt, gx, gw, nb, b0);
  const Scratch scratch(BT * dm + 2 * m);
  float* __restrict g = scratch.data() + BT * dm;
  float* __restrict ra = g + m;
  auto start = [](int64_t, int64_t) {};
  auto site = [&](int64_t j, int64_t b, const float* __restrict wj, const float* v) {
    const float* __restrict u = shifted(v, shift + b * dm, dm);
    const float* __restrict g1 = gs + b * dm;
    const float* __restrict g2 = gs + (nb + b) * dm;
    const float ab = act[b * nj + j];
    if (gr != nullptr || ga != nullptr) {
      for (int64_t k = 0; k < m; ++k) g[k] = gm[b * m + k];  // d M / d (r a) = 1
      for (int64_t i = 0; i < d; ++i) {
#pragma omp simd
        for (int64_t k = 0; k < m; ++k) {
          const float uu = u[i * m + k];
          g[k] += (g1[i * m + k] + g2[i * m + k] * uu) * uu;
        }
      }
      float gab = 0.f;
      for (int64_t k = 0; k < m; ++k) {
        if (gr != nullptr) gr[(b * nj + j) * m + k] = g[k] * ab;
        gab += g[k] * r[(b * nj + j) * m + k];
      }
      if (ga != nullptr) ga[b * nj + j] = gab;
    }
    if (!vg.wanted()) return;
    float* __restrict dv = vg.slot(b);
    for (int64_t k = 0; k < m; ++k) ra[k] = r[(b * nj + j) * m + k] * ab;
    for (int64_t i = 0; i < d; ++i) {
#pragma omp simd
      for (int64_t k = 0; k < m; ++k)
        dv[i * m + k] = ra[k] * (g1[i * m + k] + 2.f * u[i * m + k] * g2[i * m + k]);
    }
    vg.pair(j, b, wj, dv);
  };
  auto done = [&](int64_t j, int64_t lo, int64_t hi, const float* wj) { vg.block(j, lo, hi, wj); };
  for_pairs(x, w, dd, sh, scratch.data(), true, b0, b1, start, site, done);
}

template <int A, int X, int C, int M>
void quad_forward(const float* __restrict x, const float* __restrict w,
                  const float* __restrict shift, const float* __restrict qp,
                  float* __restrict out, const Dims& dd, int64_t b0, int64_t b1) {
  constexpr int64_t BF = forward_block<A, X>();
  const Shape<A, X, C, M> sh(dd);
  const int64_t d = sh.d(), m = sh.m(), dm = sh.dm(), nb = dd.b, nj = dd.j;
  const Scratch scratch(BF * dm + m);
  float* __restrict q = scratch.data() + BF * dm;
  auto start = [](int64_t, int64_t) {};
  auto site = [&](int64_t j, int64_t b, const float*, const float* v) {
    const float* __restrict u = shifted(v, shift + b * dm, dm);
    const float* __restrict q1 = qp + b * dm;
    const float* __restrict q2 = qp + (nb + b) * dm;
    for (int64_t k = 0; k < m; ++k) q[k] = 0.f;
    for (int64_t i = 0; i < d; ++i) {
#pragma omp simd
      for (int64_t k = 0; k < m; ++k) {
        const float uu = u[i * m + k];
        q[k] += (q1[i * m + k] + q2[i * m + k] * uu) * uu;
      }
    }
    for (int64_t k = 0; k < m; ++k) out[(b * nj + j) * m + k] = q[k];
  };
  for_pairs<BF>(x, w, dd, sh, scratch.data(), true, b0, b1, start, site, no_done);
}

template <int A, int X, int C, int M>
void quad_backward(const float* __restrict x, const float* __restrict w, const float* __restrict wt,
                   const float* __restrict shift, const float* __restrict qp,
                   const float* __restrict gq, float* __restrict gqp, float* __restrict gx,
                   float* __restrict gw, const Dims& dd, int64_t b0, int64_t b1) {
  const Shape<A, X, C, M> sh(dd);
  const int64_t d = sh.d(), m = sh.m(), dm = sh.dm();
  const int64_t nb = dd.b, nj = dd.j;
  const VoteGrads<A, X, C, M> vg(sh, x, wt, gx, gw, nb, b0);
  const Scratch scratch(BT * dm + m);
  float* __restrict g = scratch.data() + BT * dm;
  auto start = [&](int64_t lo, int64_t hi) {
    if (gqp == nullptr) return;
    std::fill(gqp + lo * dm, gqp + hi * dm, 0.f);
    std::fill(gqp + (nb + lo) * dm, gqp + (nb + hi) * dm, 0.f);
  };
  auto site = [&](int64_t j, int64_t b, const float* __restrict wj, const float* v) {
    const float* __restrict u = shifted(v, shift + b * dm, dm);
    for (int64_t k = 0; k < m; ++k) g[k] = gq[(b * nj + j) * m + k];
    if (gqp != nullptr) {
      float* __restrict h1 = gqp + b * dm;
      float* __restrict h2 = gqp + (nb + b) * dm;
      for (int64_t i = 0; i < d; ++i) {
#pragma omp simd
        for (int64_t k = 0; k < m; ++k) {
          const float gu = g[k] * u[i * m + k];
          h1[i * m + k] += gu;
          h2[i * m + k] += gu * u[i * m + k];
        }
      }
    }
    if (!vg.wanted()) return;
    float* __restrict dv = vg.slot(b);
    const float* __restrict q1 = qp + b * dm;
    const float* __restrict q2 = qp + (nb + b) * dm;
    for (int64_t i = 0; i < d; ++i) {
#pragma omp simd
      for (int64_t k = 0; k < m; ++k)
        dv[i * m + k] = g[k] * (q1[i * m + k] + 2.f * u[i * m + k] * q2[i * m + k]);
    }
    vg.pair(j, b, wj, dv);
  };
  auto done = [&](int64_t j, int64_t lo, int64_t hi, const float* wj) { vg.block(j, lo, hi, wj); };
  for_pairs(x, w, dd, sh, scratch.data(), true, b0, b1, start, site, done);
}

// Runs f<A, X, C, M>() with the sizes fixed at compile time for 4x4 pose matrices, 16-d pose
// vectors and the usual parent counts, at run time otherwise.
#define CAPSCTL_DISPATCH(f, ...)                          \
  do {                                                    \
    const bool square = dd.a == 4 && dd.x == 4 && dd.c == 4; \
    const bool vec16 = dd.a == 1 && dd.x == 16 && dd.c == 16; \
    if (square && dd.m == 32) {                           \
      f<4, 4, 4, 32>(__VA_ARGS__);                        \
    } else if (square && dd.m == 10) {                    \
      f<4, 4, 4, 10>(__VA_ARGS__);                        \
    } else if (square) {                                  \
      f<4, 4, 4, 0>(__VA_ARGS__);                         \
    } else if (vec16 && dd.m == 32) {                     \
      f<1, 16, 16, 32>(__VA_ARGS__);                      \
    } else if (vec16 && dd.m == 10) {                     \
      f<1, 16, 16, 10>(__VA_ARGS__);                      \
    } else {                                              \
      f<0, 0, 0, 0>(__VA_ARGS__);                         \
    }                                                     \
  } while (0)

}  // namespace

extern "C" {

// Every function takes its pointers, then the sizes J, B, a, x, c, m and the sites [b0, b1); a
// backward pass also takes the weights transposed, wt[J, c*m, x], after w (read by the loops of
// 16-d pose vectors where gx is wanted; may be null otherwise), and the calling thread's
// weight-gradient accumulator as its last pointer (zeroed by the loops).
// Version of the functions' signatures; native.py refuses a library that reports another.
int capsctl_kernels_abi() { return 6; }

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

void capsctl_gated_forward(const float* x, const float* w, const float* wr, const float* br,
                           const float* act, float* s, float* tot, float* cs, int64_t j,
                           int64_t b, int64_t a, int64_t xd, int64_t c, int64_t m, int64_t b0,
                           int64_t b1) {
  const Dims dd{j, b, a, xd, c, m};
  CAPSCTL_DISPATCH(gated_forward, x, w, wr, br, act, s, tot, cs, dd, b0, b1);
}

void capsctl_gated_backward(const float* x, const float* w, const float* wt, const float* wr,
                            const float* cs, const float* act, const float* gs, const float* gt,
                            float* gact, float* gx, float* gacc, int64_t j, int64_t b, int64_t a,
                            int64_t xd, int64_t c, int64_t m, int64_t b0, int64_t b1) {
  const Dims dd{j, b, a, xd, c, m};
  CAPSCTL_DISPATCH(gated_backward, x, w, wt, wr, cs, act, gs, gt, gact, gx, gacc, dd, b0, b1);
}

void capsctl_em_moments_forward(const float* x, const float* w, const float* shift,
                                const float* r, const float* act, float* out, float* mass,
                                int64_t j, int64_t b, int64_t a, int64_t xd, int64_t c,
                                int64_t m, int64_t b0, int64_t b1) {
  const Dims dd{j, b, a, xd, c, m};
  CAPSCTL_DISPATCH(moments_forward, x, w, shift, r, act, out, mass, dd, b0, b1);
}

void capsctl_em_moments_backward(const float* x, const float* w, const float* wt,
                                 const float* shift, const float* r, const float* act,
                                 const float* gs, const float* gm, float* gr, float* ga, float* gx,
                                 float* gw, int64_t j, int64_t b, int64_t a, int64_t xd, int64_t c,
                                 int64_t m, int64_t b0, int64_t b1) {
  const Dims dd{j, b, a, xd, c, m};
  CAPSCTL_DISPATCH(moments_backward, x, w, wt, shift, r, act, gs, gm, gr, ga, gx, gw, dd, b0, b1);
}

void capsctl_em_quad_forward(const float* x, const float* w, const float* shift,
                             const float* qp, float* out, int64_t j, int64_t b, int64_t a,
                             int64_t xd, int64_t c, int64_t m, int64_t b0, int64_t b1) {
  const Dims dd{j, b, a, xd, c, m};
  CAPSCTL_DISPATCH(quad_forward, x, w, shift, qp, out, dd, b0, b1);
}

void capsctl_em_quad_backward(const float* x, const float* w, const float* wt, const float* shift,
                              const float* qp, const float* gq, float* gqp, float* gx, float* gw,
                              int64_t j, int64_t b, int64_t a, int64_t xd, int64_t c, int64_t m,
                              int64_t b0, int64_t b1) {
  const Dims dd{j, b, a, xd, c, m};
  CAPSCTL_DISPATCH(quad_backward, x, w, wt, shift, qp, gq, gqp, gx, gw, dd, b0, b1);
}

}  // extern "C"
