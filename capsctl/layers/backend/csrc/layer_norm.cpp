// LayerNorm over short rows (capsctl/layers/passes/pose_norm.py): the capsules' poses, d = 16
// floats a row, normalized one row at a time. torch's CPU kernel takes about as long per row of
// 16 as per row of hundreds; here a row is one vector register. Built into the same library as
// the vote-sized passes (capsctl/layers/backend/native.py).
//
//   x[R, d] rows, w[d], b[d]:  y = (x - mean) * rstd * w + b,  rstd = 1 / sqrt(var + eps)
//   backward, from gy:  h = gy * w,  xh = (x - mean) * rstd,
//                       gx = rstd * (h - mean_d(h) - xh * mean_d(h * xh)),
//                       gw = sum_R gy * xh,  gb = sum_R gy
//
// Every function handles the rows [r0, r1); the caller runs disjoint ranges in parallel threads,
// each backward with its own accumulator of gw and gb.

#include <cmath>
#include <cstdint>

#include "simd16.h"

namespace {

// The row length, a compile-time constant where D > 0.
template <int D>
struct Row {
  int64_t d_;
  int64_t d() const {
    if constexpr (D > 0) return D;
    return d_;
  }
};

// -- 4x4 matrix poses held rows-first ------------------------------------------------------------
// Poses of d = 16 = a*x (a = x = 4) in one of two layouts, capsule r = g*S + s of G groups (the
// batch) of S capsules (sites and types):
//   standard    [G, S, a, x]:  row a of capsule r at r*16 + a*4
//   rows-first  [G, a, S, x]:  row a of capsule r at (g*4 + a)*S*4 + s*4
// Rows-first is what a conv capsule layer's uniform pass reads and writes (the pose row next to
// the batch: one convolution for every row, capsctl/layers/capsules.py); the loops below read
// one layout and write the other (or the same) in their single pass, so the layout copy before
// and after the LayerNorm costs nothing. A block is 16 consecutive capsules of one group
// (S % 16 == 0, blocks aligned to 16: checked by the caller, capsctl/layers/passes/rows_first.py).

// The 4x4 transpose of four vectors seen as 4x4 blocks of 4 floats: out[j] block i = in[i]
// block j. Rows-first memory holds, per row a, four capsules' rows in one vector; the
// transpose turns four such vectors into the four capsules' poses, and back.
// Blocks of 4 lanes: a's 0, b's 0, a's 1, b's 1 (and a's 2, b's 2, a's 3, b's 3).
#define CAPSCTL_BLOCKS01 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23
#define CAPSCTL_BLOCKS23 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31
inline void transpose_blocks(v16* p) {
  const v16 t0 = CAPSCTL_SHUFFLE(p[0], p[1], CAPSCTL_BLOCKS01);
  const v16 t1 = CAPSCTL_SHUFFLE(p[0], p[1], CAPSCTL_BLOCKS23);
  const v16 t2 = CAPSCTL_SHUFFLE(p[2], p[3], CAPSCTL_BLOCKS01);
  const v16 t3 = CAPSCTL_SHUFFLE(p[2], p[3], CAPSCTL_BLOCKS23);
  p[0] = CAPSCTL_SHUFFLE(t0, t2, CAPSCTL_LO8);
  p[1] = CAPSCTL_SHUFFLE(t0, t2, CAPSCTL_HI8);
  p[2] = CAPSCTL_SHUFFLE(t1, t3, CAPSCTL_LO8);
  p[3] = CAPSCTL_SHUFFLE(t1, t3, CAPSCTL_HI8);
}

// The 16 poses from capsule r on into pose[16], from either layout (rows-first: r % 16 == 0).
template <bool Rows>
inline void load_block(const float* __restrict t, int64_t sites, int64_t r, v16* pose) {
  if constexpr (!Rows) {
    for (int i = 0; i < 16; ++i) pose[i] = load16(t + (r + i) * 16);
  } else {
    const int64_t g = r / sites, s = r - g * sites;
    const float* base = t + g * 16 * sites + s * 4;  // row 0 of capsule r
    for (int q = 0; q < 4; ++q) {                     // capsules r + 4q .. r + 4q + 3
      for (int a = 0; a < 4; ++a) pose[4 * q + a] = load16(base + a * 4 * sites + q * 16);
      transpose_blocks(pose + 4 * q);
    }
  }
}

// pose[16] (clobbered) to the block at capsule r of either layout.
template <bool Rows>
inline void store_block(float* __restrict t, int64_t sites, int64_t r, v16* pose) {
  if constexpr (!Rows) {
    for (int i = 0; i < 16; ++i) __builtin_memcpy(t + (r + i) * 16, &pose[i], sizeof(v16));
  } else {
    const int64_t g = r / sites, s = r - g * sites;
    float* base = t + g * 16 * sites + s * 4;
    for (int q = 0; q < 4; ++q) {
      transpose_blocks(pose + 4 * q);
      for (int a = 0; a < 4; ++a)
        __builtin_memcpy(base + a * 4 * sites + q * 16, &pose[4 * q + a], sizeof(v16));
    }
  }
}

// One block of 16 poses from capsule r on: the block's 16 sums, then its 16 sums
// of squared deviations, each as one vector by the shuffle tree (simd16.h), instead of two
// horizontal reductions per pose one after the other (the forward pass of the primary capsules'
// million poses was bound by them, not by memory). x in layout InRows, y in OutRows.
template <bool InRows, bool OutRows>
inline void ln_block(const float* __restrict x, v16 wv, v16 bv, float* __restrict y,
                     float* __restrict mean, float* __restrict rstd, int64_t sites, float eps,
                     int64_t r) {
  v16 row[16], t[16];
  load_block<InRows>(x, sites, r, row);
  for (int i = 0; i < 16; ++i) t[i] = row[i];
  const v16 mu = lane_sums(t) * (1.f / 16.f);  // lane i: the mean of capsule r + i
  for (int i = 0; i < 16; ++i) {
    row[i] -= mu[i];
    t[i] = row[i] * row[i];
  }
  const v16 var = lane_sums(t) * (1.f / 16.f);
  float rs[16];
#pragma omp simd
  for (int i = 0; i < 16; ++i) rs[i] = 1.f / std::sqrt(var[i] + eps);
  for (int i = 0; i < 16; ++i) row[i] = row[i] * rs[i] * wv + bv;
  store_block<OutRows>(y, sites, r, row);
  __builtin_memcpy(mean + r, &mu, sizeof mu);
  __builtin_memcpy(rstd + r, rs, sizeof rs);
}

// Standard rows of 16 from any row r0: whole blocks, then returns the first row it left to the
// row loop.
int64_t ln_forward16(const float* __restrict x, const float* __restrict w,
                     const float* __restrict b, float* __restrict y, float* __restrict mean,
                     float* __restrict rstd, float eps, int64_t r0, int64_t r1) {
  const v16 wv = load16(w), bv = load16(b);
  int64_t r = r0;
  for (; r + 16 <= r1; r += 16) ln_block<false, false>(x, wv, bv, y, mean, rstd, 0, eps, r);
  return r;
}

// Forward over the capsules [r0, r1) (multiples of 16): x in layout InRows, y in OutRows.
template <bool InRows, bool OutRows>
void ln_forward_layout(const float* __restrict x, const float* __restrict w,
                       const float* __restrict b, float* __restrict y, float* __restrict mean,
                       float* __restrict rstd, int64_t sites, float eps, int64_t r0, int64_t r1) {
  const v16 wv = load16(w), bv = load16(b);
  for (int64_t r = r0; r < r1; r += 16)
    ln_block<InRows, OutRows>(x, wv, bv, y, mean, rstd, sites, eps, r);
}

template <int D>
void ln_forward(const float* __restrict x, const float* __restrict w, const float* __restrict b,
                float* __restrict y, float* __restrict mean, float* __restrict rstd,
                int64_t dn, float eps, int64_t r0, int64_t r1) {
  const int64_t d = Row<D>{dn}.d();
  const float inv_d = 1.f / static_cast<float>(d);
  if constexpr (D == 16) r0 = ln_forward16(x, w, b, y, mean, rstd, eps, r0, r1);
  for (int64_t r = r0; r < r1; ++r) {
    const float* __restrict xr = x + r * d;
    float* __restrict yr = y + r * d;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < d; ++k) s += xr[k];
    const float mu = s * inv_d;
    float v = 0.f;
#pragma omp simd reduction(+ : v)
    for (int64_t k = 0; k < d; ++k) v += (xr[k] - mu) * (xr[k] - mu);
    const float rs = 1.f / std::sqrt(v * inv_d + eps);
#pragma omp simd
    for (int64_t k = 0; k < d; ++k) yr[k] = (xr[k] - mu) * rs * w[k] + b[k];
    mean[r] = mu;
    rstd[r] = rs;
  }
}

// Rows per partial sum of gw and gb: float sums over a few hundred rows, then added in double,
// so a thread's sum over a million rows keeps float32 accuracy.
constexpr int64_t PART = 256;

// acc[2, d] (double): the thread's gw, then gb, added to (the caller zeroes it).
template <int D>
void ln_backward(const float* __restrict x, const float* __restrict w,
                 const float* __restrict mean, const float* __restrict rstd,
                 const float* __restrict gy, float* __restrict gx, double* __restrict acc,
                 int64_t dn, int64_t r0, int64_t r1) {
  const int64_t d = Row<D>{dn}.d();
  const float inv_d = 1.f / static_cast<float>(d);
  float pw[D > 0 ? D : 1024], pb[D > 0 ? D : 1024];  // d <= 1024 (checked by the caller)
  for (int64_t p0 = r0; p0 < r1; p0 += PART) {
    const int64_t p1 = p0 + PART < r1 ? p0 + PART : r1;
    for (int64_t k = 0; k < d; ++k) pw[k] = pb[k] = 0.f;
    for (int64_t r = p0; r < p1; ++r) {
      const float* __restrict xr = x + r * d;
      const float* __restrict gr = gy + r * d;
      const float mu = mean[r], rs = rstd[r];
      float sh = 0.f, shx = 0.f;
#pragma omp simd reduction(+ : sh, shx)
      for (int64_t k = 0; k < d; ++k) {
        const float xh = (xr[k] - mu) * rs;
        const float h = gr[k] * w[k];
        sh += h;
        shx += h * xh;
        pw[k] += gr[k] * xh;
        pb[k] += gr[k];
      }
      if (gx == nullptr) continue;
      const float a = sh * inv_d, c = shx * inv_d;
      float* __restrict gxr = gx + r * d;
#pragma omp simd
      for (int64_t k = 0; k < d; ++k) {
        const float xh = (xr[k] - mu) * rs;
        gxr[k] = rs * (gr[k] * w[k] - a - xh * c);
      }
    }
    for (int64_t k = 0; k < d; ++k) {
      acc[k] += pw[k];
      acc[d + k] += pb[k];
    }
  }
}


// Backward over the capsules [r0, r1) (multiples of 16): x and gx in layout InRows, gy in
// OutRows; acc[2, 16] as in ln_backward.
template <bool InRows, bool OutRows>
void ln_backward_layout(const float* __restrict x, const float* __restrict w,
                        const float* __restrict mean, const float* __restrict rstd,
                        const float* __restrict gy, float* __restrict gx, double* __restrict acc,
                        int64_t sites, int64_t r0, int64_t r1) {
  const v16 wv = load16(w);
  for (int64_t p0 = r0; p0 < r1; p0 += PART) {
    const int64_t p1 = p0 + PART < r1 ? p0 + PART : r1;
    v16 pw = {}, pb = {};
    for (int64_t r = p0; r < p1; r += 16) {
      v16 xh[16], g[16], h[16], t[16];
      load_block<InRows>(x, sites, r, xh);
      load_block<OutRows>(gy, sites, r, g);
      const v16 mu = load16(mean + r), rs = load16(rstd + r);
      for (int i = 0; i < 16; ++i) {
        xh[i] = (xh[i] - mu[i]) * rs[i];
        h[i] = g[i] * wv;
        pw += g[i] * xh[i];
        pb += g[i];
        t[i] = h[i];
      }
      if (gx == nullptr) continue;
      const v16 a = lane_sums(t) * (1.f / 16.f);  // lane i: mean of h over capsule r + i
      for (int i = 0; i < 16; ++i) t[i] = h[i] * xh[i];
      const v16 c = lane_sums(t) * (1.f / 16.f);
      for (int i = 0; i < 16; ++i) h[i] = rs[i] * (h[i] - a[i] - xh[i] * c[i]);
      store_block<InRows>(gx, sites, r, h);
    }
    for (int k = 0; k < 16; ++k) {
      acc[k] += pw[k];
      acc[16 + k] += pb[k];
    }
  }
}

}  // namespace

extern "C" {

void capsctl_layer_norm_forward(const float* x, const float* w, const float* b, float* y,
                                float* mean, float* rstd, int64_t d, float eps, int64_t r0,
                                int64_t r1) {
  if (d == 16) {
    ln_forward<16>(x, w, b, y, mean, rstd, d, eps, r0, r1);
  } else {
    ln_forward<0>(x, w, b, y, mean, rstd, d, eps, r0, r1);
  }
}

void capsctl_layer_norm_backward(const float* x, const float* w, const float* mean,
                                 const float* rstd, const float* gy, float* gx, double* acc,
                                 int64_t d, int64_t r0, int64_t r1) {
  if (d == 16) {
    ln_backward<16>(x, w, mean, rstd, gy, gx, acc, d, r0, r1);
  } else {
    ln_backward<0>(x, w, mean, rstd, gy, gx, acc, d, r0, r1);
  }
}

// Layouts: 0 standard, 1 rows-first (see ln_forward_layout); d = 16, 4x4 poses only.
void capsctl_layer_norm_forward_layout(const float* x, const float* w, const float* b, float* y,
                                       float* mean, float* rstd, int64_t sites, int64_t in_rows,
                                       int64_t out_rows, float eps, int64_t r0, int64_t r1) {
  if (in_rows && out_rows) {
    ln_forward_layout<true, true>(x, w, b, y, mean, rstd, sites, eps, r0, r1);
  } else if (in_rows) {
    ln_forward_layout<true, false>(x, w, b, y, mean, rstd, sites, eps, r0, r1);
  } else if (out_rows) {
    ln_forward_layout<false, true>(x, w, b, y, mean, rstd, sites, eps, r0, r1);
  } else {
    ln_forward_layout<false, false>(x, w, b, y, mean, rstd, sites, eps, r0, r1);
  }
}

void capsctl_layer_norm_backward_layout(const float* x, const float* w, const float* mean,
                                        const float* rstd, const float* gy, float* gx,
                                        double* acc, int64_t sites, int64_t in_rows,
                                        int64_t out_rows, int64_t r0, int64_t r1) {
  if (in_rows && out_rows) {
    ln_backward_layout<true, true>(x, w, mean, rstd, gy, gx, acc, sites, r0, r1);
  } else if (in_rows) {
    ln_backward_layout<true, false>(x, w, mean, rstd, gy, gx, acc, sites, r0, r1);
  } else if (out_rows) {
    ln_backward_layout<false, true>(x, w, mean, rstd, gy, gx, acc, sites, r0, r1);
  } else {
    ln_backward_layout<false, false>(x, w, mean, rstd, gy, gx, acc, sites, r0, r1);
  }
}

}  // extern "C"
