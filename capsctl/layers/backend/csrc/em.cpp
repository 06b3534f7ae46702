// EM routing's vote-sized work (capsctl/layers/passes/em_moments.py: VoteMoments, VoteQuad) on the
// shifted votes u = V - shift[B, a, c, m]: the M-step's moments S[2, B, a, c, m] = sum_J r a (u,
// u^2) and the mass M[B, m] = sum_J r a with assignments r[B, J, m] and child activations
// act[B, J], and the E-step's quadratic form Q[B, J, m] = sum_d (q u + p u^2) with
// qp[2, B, a, c, m]; each backward is the other.
// The assignment-sized operands are site-child-major, so a pair's m values are contiguous.

#include <algorithm>
#include <cstdint>
#include <memory>

#include "pairs.h"

namespace {

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
  constexpr int64_t BS = backward_block<A, X>();
  const Scratch scratch(BS * dm + 2 * m);
  float* __restrict g = scratch.data() + BS * dm;
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
  for_pairs<BS>(x, w, dd, sh, scratch.data(), true, b0, b1, start, site, done);
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
  constexpr int64_t BS = backward_block<A, X>();
  const Scratch scratch(BS * dm + m);
  float* __restrict g = scratch.data() + BS * dm;
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
  for_pairs<BS>(x, w, dd, sh, scratch.data(), true, b0, b1, start, site, done);
}

}  // namespace

extern "C" {

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
