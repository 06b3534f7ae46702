// Self-routing's whole pass (capsctl/layers/passes/gated.py): the routing logits from the
// child's own pose, lg = X wr_j + br_j (wr[J, a*x, m], br[J, m]), the coefficients
// c = softmax_m(lg), the mass c a with the child activations act[B, J], the mass-weighted sum
// s[B, a, c, m] = sum_J c a V and the total mass tot[B, m] = sum_J c a; c is written out
// (cs[J, B, m]). Backward, from gs = d loss / d s and gt = d loss / d tot:
// dmass = sum_d V gs + gt; dact = sum_m dmass c; dlg = c (dmass a - sum_m c dmass a);
// dV = c a gs; and through the logits gx += wr_j dlg, gwr_j += X^T dlg, gbr_j += dlg.

#include <algorithm>
#include <cstdint>

#include "pairs.h"

namespace {

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
  constexpr int64_t BS = backward_block<A, X>();
  const Scratch scratch(BS * dm + BS * m + 2 * m);
  float* __restrict glb = scratch.data() + BS * dm;  // the block's logits' gradients [BS, m]
  float* __restrict dmass = glb + BS * m;
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
      float* __restrict gl = glb + (b - b0) % BS * m;
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
      const float* __restrict gl = glb + (b - b0) % BS * m;
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
  for_pairs<BS>(x, w, dd, sh, scratch.data(), coef, b0, b1, start, site, done);
}

}  // namespace

extern "C" {

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

}  // extern "C"
