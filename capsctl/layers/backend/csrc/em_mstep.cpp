// The parent-sized rest of EM routing's M-step (Hinton, Sabour, Frosst, ICLR 2018, Procedure 1)
// as loops over parent sites: capsctl/layers/routers/em/procedure.py's _m_step without cost
// standardization, forward and backward, one pass (two backward) over the site's parents where
// torch runs some twenty operators each way, each a pass over parent-sized tensors.
//
// Per parent (b, j), with w = 1 / (M + eps), the moments about the shift s (a constant):
//   m1 = S1 w, sw = M w, delta = m1 + s (sw - 1)                      (mu = s + delta)
//   var = S2 w - 2 delta m1 + delta^2 sw + var_eps, lv = log var, iv = 1 / var
//   cost = sum_h (beta_u + lv / 2) M, pre = lambda (beta_a - cost), act = sigmoid(pre)
//   qp = (-2 delta iv, iv), c = logsigmoid(pre) - sum_h delta^2 iv / 2 - sum_h (lv + log 2 pi) / 2
// Layouts (site, pose entry, parent type; parent type innermost, so the loops over j vectorize):
//   s[2, B, d, m], mass[B, m], shift[B, d, m], mu[B, d, m], qp[2, B, d, m], act[B, m], c[B, m].
// Each function handles the sites [b0, b1); the caller runs disjoint ranges in parallel
// threads, each with its own float64 accumulator of the betas' gradients [2, m].
// Built by capsctl/layers/backend/native.py; tested against the torch code.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr double kLog2Pi = 1.8378770664093453;

inline float log_sigmoid(float x) { return std::min(x, 0.f) - std::log1p(std::exp(-std::fabs(x))); }

}  // namespace

extern "C" {

void capsctl_em_mstep_forward(const float* s, const float* mass, const float* shift,
                              const float* beta_u, const float* beta_a, float* mu, float* act,
                              float* qp, float* c, int64_t bsz, int64_t d, int64_t m, float lam,
                              float eps, float var_eps, int64_t b0, int64_t b1) {
  const int64_t plane = bsz * d * m;
  std::vector<float> inv(m), sw(m), cost(m), off(m), lvs(m);
  for (int64_t b = b0; b < b1; ++b) {
    const float* mb = mass + b * m;
    for (int64_t j = 0; j < m; ++j) {
      inv[j] = 1.f / (mb[j] + eps);
      sw[j] = mb[j] * inv[j];
      cost[j] = off[j] = lvs[j] = 0.f;
    }
    for (int64_t h = 0; h < d; ++h) {
      const int64_t o = (b * d + h) * m;
      for (int64_t j = 0; j < m; ++j) {
        const float m1 = s[o + j] * inv[j];
        const float delta = m1 + shift[o + j] * (sw[j] - 1.f);
        const float var =
            s[plane + o + j] * inv[j] - 2.f * delta * m1 + delta * delta * sw[j] + var_eps;
        const float lv = std::log(var), iv = 1.f / var;
        cost[j] += beta_u[j] + 0.5f * lv;
        off[j] += delta * delta * iv;
        lvs[j] += lv;
        mu[o + j] = shift[o + j] + delta;
        qp[o + j] = -2.f * delta * iv;
        qp[plane + o + j] = iv;
      }
    }
    for (int64_t j = 0; j < m; ++j) {
      const float pre = lam * (beta_a[j] - cost[j] * mb[j]);
      const float ls = log_sigmoid(pre);
      act[b * m + j] = std::exp(ls);
      c[b * m + j] = ls - 0.5f * off[j] - 0.5f * (lvs[j] + static_cast<float>(d * kLog2Pi));
    }
  }
}

void capsctl_em_mstep_backward(const float* s, const float* mass, const float* shift,
                               const float* beta_u, const float* beta_a, const float* g_mu,
                               const float* g_act, const float* g_qp, const float* g_c,
                               float* g_s, float* g_mass, double* g_beta, int64_t bsz, int64_t d,
                               int64_t m, float lam, float eps, float var_eps, int64_t b0,
                               int64_t b1) {
  const int64_t plane = bsz * d * m;
  std::vector<float> inv(m), sw(m), cost(m), g_pre(m), g_cost(m), g_sw(m), g_inv(m);
  for (int64_t b = b0; b < b1; ++b) {
    const float* mb = mass + b * m;
    for (int64_t j = 0; j < m; ++j) {
      inv[j] = 1.f / (mb[j] + eps);
      sw[j] = mb[j] * inv[j];
      cost[j] = g_sw[j] = g_inv[j] = 0.f;
    }
    // the costs first: the gradients of every entry need the parent's activation
    for (int64_t h = 0; h < d; ++h) {
      const int64_t o = (b * d + h) * m;
      for (int64_t j = 0; j < m; ++j) {
        const float m1 = s[o + j] * inv[j];
        const float delta = m1 + shift[o + j] * (sw[j] - 1.f);
        const float var =
            s[plane + o + j] * inv[j] - 2.f * delta * m1 + delta * delta * sw[j] + var_eps;
        cost[j] += beta_u[j] + 0.5f * std::log(var);
      }
    }
    for (int64_t j = 0; j < m; ++j) {
      const float pre = lam * (beta_a[j] - cost[j] * mb[j]);
      const float sg = std::exp(log_sigmoid(pre));
      const float ga = g_act[b * m + j], gc = g_c[b * m + j];
      g_pre[j] = ga * sg * (1.f - sg) + gc * (1.f - sg);
      g_cost[j] = -lam * g_pre[j];
      g_beta[j] += static_cast<double>(g_cost[j]) * mb[j] * d;  // beta_u: d cost / d beta_u = d M
      g_beta[m + j] += static_cast<double>(lam) * g_pre[j];    // beta_a: d pre / d beta_a = lambda
    }
    for (int64_t h = 0; h < d; ++h) {
      const int64_t o = (b * d + h) * m;
      for (int64_t j = 0; j < m; ++j) {
        const float s1 = s[o + j], s2 = s[plane + o + j];
        const float m1 = s1 * inv[j];
        const float delta = m1 + shift[o + j] * (sw[j] - 1.f);
        const float var = s2 * inv[j] - 2.f * delta * m1 + delta * delta * sw[j] + var_eps;
        const float iv = 1.f / var;
        const float gc = g_c[b * m + j];
        const float g_off = -0.5f * gc;
        const float g_lv = -0.5f * gc + 0.5f * g_cost[j] * mb[j];
        const float gq0 = g_qp[o + j], gq1 = g_qp[plane + o + j];
        const float g_iv = -2.f * gq0 * delta + gq1 + g_off * delta * delta;
        const float g_var = g_lv * iv - g_iv * iv * iv;
        const float g_delta = g_mu[o + j] - 2.f * gq0 * iv + 2.f * g_off * delta * iv +
                              g_var * (2.f * delta * sw[j] - 2.f * m1);
        const float g_m1 = g_delta - 2.f * g_var * delta;
        g_sw[j] += g_delta * shift[o + j] + g_var * delta * delta;
        g_inv[j] += g_m1 * s1 + g_var * s2;
        g_s[o + j] = g_m1 * inv[j];
        g_s[plane + o + j] = g_var * inv[j];
      }
    }
    for (int64_t j = 0; j < m; ++j) {
      // d sw / d M = w - M w^2 = eps w^2, written so (no cancellation of two near terms)
      g_mass[b * m + j] =
          g_cost[j] * cost[j] + (g_sw[j] * eps - g_inv[j]) * inv[j] * inv[j];
    }
  }
}

}  // extern "C"
