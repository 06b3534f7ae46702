// Routing by agreement (dynamic routing, Sabour et al., NeurIPS 2017, Procedure 1) as one pass
// over a layer: every iteration of a block of parent sites, forward and backward.
//
// Iterations of a site depend only on that site's votes, so a block of sites runs the uniform
// pass, every routed iteration and the squashes; the backward pass walks the iterations back
// and multiplies the votes' gradient, summed over the iterations, into dX and dW once. A block
// either builds the votes of all its children once and keeps them (J * block * d*m floats of
// scratch): one vote-sized product forward, three backward; or, where they would outgrow the
// cache, builds a child's votes again for each use: T - 1 forward (the caller gives the uniform
// pass's sums in s[0], one matrix product over all sites), T - 1 + 2 backward. Routed
// iteration by iteration, a layer takes 4 (T - 1) products forward and backward, plus the
// uniform pass's three. The caller picks the block (at most the backward block of VoteGrads, whose
// block() takes one block's votes' gradients) and whether it keeps its votes.
//
// Letters and layouts as capsctl/layers/passes/routed.py and routed.cpp:
//   x[J, B, a, x] child poses    w[J, x, c, m] weights (parent type innermost)
//   s[T, B, a, c, m] the sums of each iteration, v[T, B, a, c, m] their squashes
//   r[T-1, J, B, m] the coefficients of iterations 2..T
// Iteration 1: S_1 = sum_J V / m. Iteration t > 1: Q_t = v_1 + ... + v_{t-1} (the agreements
// with all parents so far, b_ij of the paper), R = softmax_m(sum_d V Q_t), S_t = sum_J R V.
// v_t = squash(S_t) = S_t |S_t| / (1 + |S_t|^2) over the d entries of each parent type.
// Backward from gv[T, B, a, c, m] = d loss / d v_t: from t = T down to 2,
//   G_t = squash'(S_t) (gv_t + sum_{u > t} dQ_u); dR = sum_d V G_t; dA = R (dR - sum_m R dR);
//   dQ_t = sum_J dA V; then G_1 likewise; dV = G_1 / m + sum_{t>1} (R_t G_t + dA_t Q_t);
//   gx = dV W^T, gw = sum_B X^T dV.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "pairs.h"

namespace {

// |s| from |s|^2, 0 below 1e-30: -ffast-math computes a square root as x * rsqrt(x), and the
// approximate reciprocal of a subnormal |s|^2 is infinite (a parent whose coefficients had all
// but vanished got infinite poses). Below the floor |s| < 1e-15, so its squash, |s| s at most,
// is below 1e-30, and its gradient below 1e-15 times the incoming one.
inline float root(float n2) { return n2 > 1e-30f ? std::sqrt(n2) : 0.f; }

// v[d, m] = squash(s[d, m]) over d for each parent type
inline void squash_dm(const float* __restrict s, float* __restrict v, int64_t d, int64_t m,
                      float* __restrict nrm) {
  for (int64_t k = 0; k < m; ++k) nrm[k] = 0.f;
  for (int64_t i = 0; i < d; ++i) {
#pragma omp simd
    for (int64_t k = 0; k < m; ++k) nrm[k] += s[i * m + k] * s[i * m + k];
  }
  for (int64_t k = 0; k < m; ++k) {
    const float n = root(nrm[k]);
    nrm[k] = n / (1.f + nrm[k]);
  }
  for (int64_t i = 0; i < d; ++i) {
#pragma omp simd
    for (int64_t k = 0; k < m; ++k) v[i * m + k] = s[i * m + k] * nrm[k];
  }
}

// g[d, m] = d loss / d s from gv = d loss / d squash(s): f(n) gv + s (s . gv) f'(n) / n with
// f(n) = n / (1 + n^2), f'(n) = (1 - n^2) / (1 + n^2)^2 (0 at s = 0, as torch's norm)
inline void squash_backward_dm(const float* __restrict s, const float* __restrict gv,
                               float* __restrict g, int64_t d, int64_t m, float* __restrict t1,
                               float* __restrict t2) {
  for (int64_t k = 0; k < m; ++k) t1[k] = t2[k] = 0.f;
  for (int64_t i = 0; i < d; ++i) {
#pragma omp simd
    for (int64_t k = 0; k < m; ++k) {
      t1[k] += s[i * m + k] * s[i * m + k];
      t2[k] += s[i * m + k] * gv[i * m + k];
    }
  }
  for (int64_t k = 0; k < m; ++k) {
    const float n2 = t1[k], n = root(n2), den = 1.f + n2;
    const float f = n / den;
    const float fp = n > 0.f ? (1.f - n2) / (den * den * n) : 0.f;
    t1[k] = f;
    t2[k] *= fp;
  }
  for (int64_t i = 0; i < d; ++i) {
#pragma omp simd
    for (int64_t k = 0; k < m; ++k) g[i * m + k] = t1[k] * gv[i * m + k] + t2[k] * s[i * m + k];
  }
}

// The votes of a block's children: built once for the block and kept (keep), or built again
// for a child each time they are asked for (where the block's votes would outgrow the cache)
template <class S>
struct BlockVotes {
  const float* __restrict x;
  const float* __restrict w;
  const Dims& dd;
  const S& sh;
  bool keep;
  Scratch buf;  // [J, n, d*m] kept, else [n, d*m]
  int64_t lo = 0, n = 0;

  BlockVotes(const float* x_, const float* w_, const Dims& d_, const S& s_, bool keep_,
             int64_t bs)
      : x(x_), w(w_), dd(d_), sh(s_), keep(keep_), buf((keep_ ? d_.j : 1) * bs * s_.dm()) {}

  void build(int64_t j, float* __restrict out) const {
    block_votes(x + (j * dd.b + lo) * sh.ax(), w + j * sh.x() * sh.cm(), out, n * sh.a(), sh);
  }
  void start(int64_t lo_, int64_t hi) {
    lo = lo_;
    n = hi - lo_;
    for (int64_t j = 0; keep && j < dd.j; ++j) build(j, buf.data() + j * n * sh.dm());
  }
  // the votes v[n, d, m] of child j at the block's sites
  const float* of(int64_t j) const {
    if (keep) return buf.data() + j * n * sh.dm();
    build(j, buf.data());
    return buf.data();
  }
};

template <int A, int X, int C, int M>
void forward(const float* __restrict x, const float* __restrict w, float* __restrict s,
             float* __restrict v, float* __restrict r, const Dims& dd, int64_t iters, int64_t bs,
             bool keep, int64_t b0, int64_t b1) {
  const Shape<A, X, C, M> sh(dd);
  const int64_t d = sh.d(), m = sh.m(), dm = sh.dm(), nb = dd.b;
  BlockVotes<Shape<A, X, C, M>> votes(x, w, dd, sh, keep, bs);
  const Scratch query(bs * dm), small(2 * m);
  float* __restrict q = query.data();
  float* __restrict lg = small.data();
  for (int64_t lo = b0; lo < b1; lo += bs) {
    const int64_t hi = std::min(b1, lo + bs), n = hi - lo;
    votes.start(lo, hi);
    float* __restrict s1 = s + lo * dm;  // iteration 1: S = sum_J V / m
    if (keep) {  // from the kept votes; else the caller's (one matrix product over all sites)
      std::fill(s1, s1 + n * dm, 0.f);
      for (int64_t j = 0; j < dd.j; ++j) {
        const float* __restrict vj = votes.of(j);
#pragma omp simd
        for (int64_t e = 0; e < n * dm; ++e) s1[e] += vj[e];
      }
      const float inv_m = 1.f / static_cast<float>(m);
      for (int64_t e = 0; e < n * dm; ++e) s1[e] *= inv_m;
    }
    for (int64_t b = 0; b < n; ++b) squash_dm(s1 + b * dm, v + (lo + b) * dm, d, m, lg);
    std::copy(v + lo * dm, v + hi * dm, q);  // Q_2 = v_1
    for (int64_t t = 1; t < iters; ++t) {
      float* __restrict st = s + (t * nb + lo) * dm;
      float* __restrict vt = v + (t * nb + lo) * dm;
      float* __restrict rt = r + (t - 1) * dd.j * nb * m;
      std::fill(st, st + n * dm, 0.f);
      for (int64_t j = 0; j < dd.j; ++j) {
        const float* __restrict vj = votes.of(j);
        for (int64_t b = 0; b < n; ++b) {
          float* __restrict rj = rt + (j * nb + lo + b) * m;
          dot_d(vj + b * dm, q + b * dm, rj, sh);
          softmax(rj, m);
          add_weighted(st + b * dm, rj, vj + b * dm, d, m);
        }
      }
      for (int64_t b = 0; b < n; ++b) squash_dm(st + b * dm, vt + b * dm, d, m, lg);
      if (t + 1 < iters) {
        for (int64_t e = 0; e < n * dm; ++e) q[e] += vt[e];
      }
    }
  }
}

template <int A, int X, int C, int M>
void backward(const float* __restrict x, const float* __restrict w, const float* __restrict wt,
              const float* __restrict s, const float* __restrict r, const float* __restrict gv,
              float* __restrict gx, float* __restrict gw, const Dims& dd, int64_t iters,
              int64_t bs, bool keep, int64_t b0, int64_t b1) {
  const Shape<A, X, C, M> sh(dd);
  const VoteGrads<A, X, C, M> vg(sh, x, wt, gx, gw, dd.b, b0);
  if (!vg.wanted()) return;
  const int64_t d = sh.d(), m = sh.m(), dm = sh.dm(), nb = dd.b, nt = iters;
  // per block: the votes of every child; Q_t, G_t and the gradient reaching v_t for each
  // iteration; dA of each routed iteration and child
  BlockVotes<Shape<A, X, C, M>> votes(x, w, dd, sh, keep, bs);
  const Scratch qs(nt * bs * dm), gs(nt * bs * dm), acc(nt * bs * dm),
      das((nt > 1 ? nt - 1 : 1) * dd.j * bs * m), dq(bs * dm), small(2 * m);
  float* __restrict lg = small.data();
  float* __restrict lg2 = lg + m;
  const float inv_m = 1.f / static_cast<float>(m);
  for (int64_t lo = b0; lo < b1; lo += bs) {
    const int64_t hi = std::min(b1, lo + bs), n = hi - lo;
    votes.start(lo, hi);
    // Q_t = v_1 + ... + v_{t-1} from the saved sums; the incoming gradients of v_t
    std::fill(qs.data(), qs.data() + nt * n * dm, 0.f);
    for (int64_t t = 0; t + 1 < nt; ++t) {
      float* __restrict vt = gs.data();  // v_t, briefly
      for (int64_t b = 0; b < n; ++b)
        squash_dm(s + (t * nb + lo + b) * dm, vt + b * dm, d, m, lg);
      for (int64_t u = t + 1; u < nt; ++u) {
        float* __restrict qu = qs.data() + u * n * dm;
        for (int64_t e = 0; e < n * dm; ++e) qu[e] += vt[e];
      }
    }
    for (int64_t t = 0; t < nt; ++t)
      std::copy(gv + (t * nb + lo) * dm, gv + (t * nb + hi) * dm, acc.data() + t * n * dm);
    for (int64_t t = nt - 1; t >= 0; --t) {
      float* __restrict gt = gs.data() + t * n * dm;
      const float* __restrict at = acc.data() + t * n * dm;
      for (int64_t b = 0; b < n; ++b)
        squash_backward_dm(s + (t * nb + lo + b) * dm, at + b * dm, gt + b * dm, d, m, lg, lg2);
      if (t == 0) break;
      const float* __restrict rt = r + (t - 1) * dd.j * nb * m;
      float* __restrict dat = das.data() + (t - 1) * dd.j * n * m;
      float* __restrict dqt = dq.data();
      std::fill(dqt, dqt + n * dm, 0.f);
      for (int64_t j = 0; j < dd.j; ++j) {
        const float* __restrict vj = votes.of(j);
        for (int64_t b = 0; b < n; ++b) {
          const float* __restrict rj = rt + (j * nb + lo + b) * m;
          float* __restrict da = dat + (j * n + b) * m;
          dot_d(vj + b * dm, gt + b * dm, da, sh);  // dR
          float dot = 0.f;
          for (int64_t k = 0; k < m; ++k) dot += rj[k] * da[k];
          for (int64_t k = 0; k < m; ++k) da[k] = rj[k] * (da[k] - dot);
          add_weighted(dqt + b * dm, da, vj + b * dm, d, m);
        }
      }
      for (int64_t u = 0; u < t; ++u) {  // Q_t = v_1 + ... + v_{t-1}
        float* __restrict au = acc.data() + u * n * dm;
        for (int64_t e = 0; e < n * dm; ++e) au[e] += dqt[e];
      }
    }
    for (int64_t j = 0; j < dd.j; ++j) {  // dV = G_1 / m + sum_t (R_t G_t + dA_t Q_t)
      const float* __restrict wj = w + j * sh.x() * sh.cm();
      for (int64_t b = 0; b < n; ++b) {
        float* __restrict g = vg.slot_at(b);
        const float* __restrict g1 = gs.data() + b * dm;
        for (int64_t e = 0; e < dm; ++e) g[e] = g1[e] * inv_m;
        for (int64_t t = 1; t < nt; ++t) {
          const float* __restrict rj = r + ((t - 1) * dd.j * nb + j * nb + lo + b) * m;
          const float* __restrict da = das.data() + ((t - 1) * dd.j * n + j * n + b) * m;
          const float* __restrict gt = gs.data() + (t * n + b) * dm;
          const float* __restrict qt = qs.data() + (t * n + b) * dm;
          for (int64_t i = 0; i < d; ++i) {
#pragma omp simd
            for (int64_t k = 0; k < m; ++k)
              g[i * m + k] += rj[k] * gt[i * m + k] + da[k] * qt[i * m + k];
          }
        }
        vg.pair(j, lo + b, wj, g);
      }
      vg.block(j, lo, hi, wj);
    }
  }
}

}  // namespace

extern "C" {

void capsctl_agreement_forward(const float* x, const float* w, float* s, float* v, float* r,
                               int64_t j, int64_t b, int64_t a, int64_t xd, int64_t c, int64_t m,
                               int64_t iters, int64_t block, int64_t keep, int64_t b0,
                               int64_t b1) {
  const Dims dd{j, b, a, xd, c, m};
  CAPSCTL_DISPATCH(forward, x, w, s, v, r, dd, iters, block, keep != 0, b0, b1);
}

void capsctl_agreement_backward(const float* x, const float* w, const float* wt, const float* s,
                                const float* r, const float* gv, float* gx, float* gw, int64_t j,
                                int64_t b, int64_t a, int64_t xd, int64_t c, int64_t m,
                                int64_t iters, int64_t block, int64_t keep, int64_t b0,
                                int64_t b1) {
  const Dims dd{j, b, a, xd, c, m};
  CAPSCTL_DISPATCH(backward, x, w, wt, s, r, gv, gx, gw, dd, iters, block, keep != 0, b0, b1);
}

}  // extern "C"
