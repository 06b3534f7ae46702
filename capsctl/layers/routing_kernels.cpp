// The routed pass of inverted dot-product attention routing (Tsai et al., ICLR 2020) as fused
// loops: one child-parent-site triple at a time, its votes held in a few KiB of scratch, so that
// building the votes, the agreement, the softmax over parents and the weighted sum run from the
// core's first-level cache instead of as a dozen separate passes over vote-sized tiles.
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

namespace {

// Sites per block: the loop over children runs once per block, so each child's weights are
// read from the cache once per block, while the block's parents (pq, s, gq, gp: BT * a*c*m
// floats each) stay in the first two cache levels.
constexpr int64_t BT = 8;

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

// The pose and parent sizes, fixed at compile time where the template argument is > 0 (so the
// loops over them unroll and the compiler keeps a pair's logits in registers), else at run time.
template <int A, int X, int C, int M>
struct Shape {
  int64_t a, x, c, m;
  explicit Shape(const Dims& dd)
      : a(A > 0 ? A : dd.a), x(X > 0 ? X : dd.x), c(C > 0 ? C : dd.c), m(M > 0 ? M : dd.m) {}
  int64_t cm() const { return c * m; }
  int64_t d() const { return a * c; }
  int64_t dm() const { return a * c * m; }
  int64_t ax() const { return a * x; }
};

// votes v[a, c, m] = x_ab[a, :] @ w_j[:, c, m]
template <class S>
inline void votes(const float* __restrict xa, const float* __restrict wj, float* __restrict v,
                  const S& sh) {
  const int64_t a_n = sh.a, x_n = sh.x, cm = sh.cm();
  for (int64_t a = 0; a < a_n; ++a) {
    float* __restrict va = v + a * cm;
    const float* __restrict xr = xa + a * x_n;
#pragma omp simd
    for (int64_t t = 0; t < cm; ++t) {
      float acc = xr[0] * wj[t];
      for (int64_t k = 1; k < x_n; ++k) acc += xr[k] * wj[k * cm + t];
      va[t] = acc;
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

// From the votes' gradient gv[a, c, m] of one pair: gx[a, x] = gv W^T, gw[x, c, m] += X^T gv.
template <class S>
inline void vote_grads(const float* __restrict xa, const float* __restrict wj,
                       const float* __restrict gv, float* __restrict gxa, float* __restrict gwj,
                       const S& sh) {
  const int64_t a_n = sh.a, x_n = sh.x, cm = sh.cm();
  if (gxa != nullptr) {
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
  if (gwj != nullptr) {
    for (int64_t k = 0; k < x_n; ++k) {
      float* __restrict gwk = gwj + k * cm;
      for (int64_t a = 0; a < a_n; ++a) {
        const float xv = xa[a * x_n + k];
        const float* __restrict ga = gv + a * cm;
#pragma omp simd
        for (int64_t t = 0; t < cm; ++t) gwk[t] += xv * ga[t];
      }
    }
  }
}

template <int A, int X, int C, int M>
void forward(const float* __restrict x, const float* __restrict w, const float* __restrict pq,
             float* __restrict s, float* __restrict r, const Dims& dd, int64_t b0, int64_t b1) {
  const Shape<A, X, C, M> sh(dd);
  const int64_t d = sh.d(), m = sh.m, dm = sh.dm(), ax = sh.ax();
  const Scratch scratch(dm + m);
  float* __restrict v = scratch.data();
  float* __restrict lg = v + dm;
  for (int64_t lo = b0; lo < b1; lo += BT) {
    const int64_t hi = std::min(b1, lo + BT);
    std::fill(s + lo * dm, s + hi * dm, 0.f);
    for (int64_t j = 0; j < dd.j; ++j) {
      const float* __restrict wj = w + j * sh.x * sh.cm();
      for (int64_t b = lo; b < hi; ++b) {
        votes(x + (j * dd.b + b) * ax, wj, v, sh);
        dot_d(v, pq + b * dm, lg, d, m);
        softmax(lg, m);
        float* __restrict rj = r + (j * dd.b + b) * m;
        for (int64_t k = 0; k < m; ++k) rj[k] = lg[k];
        float* __restrict sb = s + b * dm;
        for (int64_t i = 0; i < d; ++i) {
#pragma omp simd
          for (int64_t k = 0; k < m; ++k) sb[i * m + k] += lg[k] * v[i * m + k];
        }
      }
    }
  }
}

template <int A, int X, int C, int M>
void backward(const float* __restrict x, const float* __restrict w, const float* __restrict pq,
              const float* __restrict r, const float* __restrict gq, float* __restrict gx,
              float* __restrict gw, float* __restrict gp, const Dims& dd, int64_t b0,
              int64_t b1) {
  const Shape<A, X, C, M> sh(dd);
  const int64_t d = sh.d(), m = sh.m, dm = sh.dm(), ax = sh.ax(), cm = sh.cm();
  const int64_t x_n = sh.x;
  const Scratch scratch(2 * dm + 2 * m);
  float* __restrict v = scratch.data();
  float* __restrict gv = v + dm;
  float* __restrict dr = gv + dm;
  float* __restrict da = dr + m;
  for (int64_t lo = b0; lo < b1; lo += BT) {
    const int64_t hi = std::min(b1, lo + BT);
    if (gp != nullptr) std::fill(gp + lo * dm, gp + hi * dm, 0.f);
    for (int64_t j = 0; j < dd.j; ++j) {
      const float* __restrict wj = w + j * x_n * cm;
      float* __restrict gwj = gw != nullptr ? gw + j * x_n * cm : nullptr;
      for (int64_t b = lo; b < hi; ++b) {
        const float* __restrict xa = x + (j * dd.b + b) * ax;
        const float* __restrict rj = r + (j * dd.b + b) * m;
        const float* __restrict gqb = gq + b * dm;
        const float* __restrict pqb = pq + b * dm;
        votes(xa, wj, v, sh);
        dot_d(v, gqb, dr, d, m);
        float dot = 0.f;
        for (int64_t k = 0; k < m; ++k) dot += rj[k] * dr[k];
        for (int64_t k = 0; k < m; ++k) da[k] = rj[k] * (dr[k] - dot);
        if (gp != nullptr) {
          float* __restrict gpb = gp + b * dm;
          for (int64_t i = 0; i < d; ++i) {
#pragma omp simd
            for (int64_t k = 0; k < m; ++k) gpb[i * m + k] += da[k] * v[i * m + k];
          }
        }
        if (gx == nullptr && gwj == nullptr) continue;
        for (int64_t i = 0; i < d; ++i) {
#pragma omp simd
          for (int64_t k = 0; k < m; ++k)
            gv[i * m + k] = rj[k] * gqb[i * m + k] + da[k] * pqb[i * m + k];
        }
        vote_grads(xa, wj, gv, gx != nullptr ? gx + (j * dd.b + b) * ax : nullptr, gwj, sh);
      }
    }
  }
}

// The weighted pass (capsctl/layers/weighted_pass.py): s[B, a, c, m] = sum_J r V with given
// coefficients r[J, B, m] (self-routing), and its backward: dR = sum_d V gq, dV = r gq.
template <int A, int X, int C, int M>
void weighted_forward(const float* __restrict x, const float* __restrict w,
                      const float* __restrict r, float* __restrict s, const Dims& dd,
                      int64_t b0, int64_t b1) {
  const Shape<A, X, C, M> sh(dd);
  const int64_t d = sh.d(), m = sh.m, dm = sh.dm(), ax = sh.ax();
  const Scratch scratch(dm);
  float* __restrict v = scratch.data();
  for (int64_t lo = b0; lo < b1; lo += BT) {
    const int64_t hi = std::min(b1, lo + BT);
    std::fill(s + lo * dm, s + hi * dm, 0.f);
    for (int64_t j = 0; j < dd.j; ++j) {
      const float* __restrict wj = w + j * sh.x * sh.cm();
      for (int64_t b = lo; b < hi; ++b) {
        votes(x + (j * dd.b + b) * ax, wj, v, sh);
        const float* __restrict rj = r + (j * dd.b + b) * m;
        float* __restrict sb = s + b * dm;
        for (int64_t i = 0; i < d; ++i) {
#pragma omp simd
          for (int64_t k = 0; k < m; ++k) sb[i * m + k] += rj[k] * v[i * m + k];
        }
      }
    }
  }
}

template <int A, int X, int C, int M>
void weighted_backward(const float* __restrict x, const float* __restrict w,
                       const float* __restrict r, const float* __restrict gq,
                       float* __restrict gx, float* __restrict gw, float* __restrict gr,
                       const Dims& dd, int64_t b0, int64_t b1) {
  const Shape<A, X, C, M> sh(dd);
  const int64_t d = sh.d(), m = sh.m, dm = sh.dm(), ax = sh.ax(), cm = sh.cm();
  const Scratch scratch(2 * dm);
  float* __restrict v = scratch.data();
  float* __restrict gv = v + dm;
  for (int64_t lo = b0; lo < b1; lo += BT) {
    const int64_t hi = std::min(b1, lo + BT);
    for (int64_t j = 0; j < dd.j; ++j) {
      const float* __restrict wj = w + j * sh.x * cm;
      float* __restrict gwj = gw != nullptr ? gw + j * sh.x * cm : nullptr;
      for (int64_t b = lo; b < hi; ++b) {
        const float* __restrict xa = x + (j * dd.b + b) * ax;
        const float* __restrict rj = r + (j * dd.b + b) * m;
        const float* __restrict gqb = gq + b * dm;
        if (gr != nullptr) {
          votes(xa, wj, v, sh);
          dot_d(v, gqb, gr + (j * dd.b + b) * m, d, m);
        }
        if (gx == nullptr && gwj == nullptr) continue;
        for (int64_t i = 0; i < d; ++i) {
#pragma omp simd
          for (int64_t k = 0; k < m; ++k) gv[i * m + k] = rj[k] * gqb[i * m + k];
        }
        vote_grads(xa, wj, gv, gx != nullptr ? gx + (j * dd.b + b) * ax : nullptr, gwj, sh);
      }
    }
  }
}

// Runs f<A, X, C, M>() with the sizes fixed at compile time for 4x4 pose matrices and the
// usual parent counts, at run time otherwise.
#define CAPSCTL_DISPATCH(f, ...)                          \
  do {                                                    \
    const bool square = dd.a == 4 && dd.x == 4 && dd.c == 4; \
    if (square && dd.m == 32) {                           \
      f<4, 4, 4, 32>(__VA_ARGS__);                        \
    } else if (square && dd.m == 10) {                    \
      f<4, 4, 4, 10>(__VA_ARGS__);                        \
    } else if (square) {                                  \
      f<4, 4, 4, 0>(__VA_ARGS__);                         \
    } else {                                              \
      f<0, 0, 0, 0>(__VA_ARGS__);                         \
    }                                                     \
  } while (0)

}  // namespace

extern "C" {

// Version of the functions' signatures; native.py refuses a library that reports another.
int capsctl_kernels_abi() { return 1; }

void capsctl_routed_forward(const float* x, const float* w, const float* pq, float* s, float* r,
                            int64_t j, int64_t b, int64_t a, int64_t xd, int64_t c, int64_t m,
                            int64_t b0, int64_t b1) {
  const Dims dd{j, b, a, xd, c, m};
  CAPSCTL_DISPATCH(forward, x, w, pq, s, r, dd, b0, b1);
}

void capsctl_routed_backward(const float* x, const float* w, const float* pq, const float* r,
                             const float* gq, float* gx, float* gw, float* gp, int64_t j,
                             int64_t b, int64_t a, int64_t xd, int64_t c, int64_t m, int64_t b0,
                             int64_t b1) {
  const Dims dd{j, b, a, xd, c, m};
  CAPSCTL_DISPATCH(backward, x, w, pq, r, gq, gx, gw, gp, dd, b0, b1);
}

void capsctl_weighted_forward(const float* x, const float* w, const float* r, float* s,
                              int64_t j, int64_t b, int64_t a, int64_t xd, int64_t c, int64_t m,
                              int64_t b0, int64_t b1) {
  const Dims dd{j, b, a, xd, c, m};
  CAPSCTL_DISPATCH(weighted_forward, x, w, r, s, dd, b0, b1);
}

void capsctl_weighted_backward(const float* x, const float* w, const float* r, const float* gq,
                               float* gx, float* gw, float* gr, int64_t j, int64_t b, int64_t a,
                               int64_t xd, int64_t c, int64_t m, int64_t b0, int64_t b1) {
  const Dims dd{j, b, a, xd, c, m};
  CAPSCTL_DISPATCH(weighted_backward, x, w, r, gq, gx, gw, gr, dd, b0, b1);
}

}  // extern "C"
