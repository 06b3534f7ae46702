// Sixteen floats in a vector register and the lane sums of sixteen such vectors, shared by the
// compiled loops (votes.h, layer_norm.cpp; built by capsctl/layers/backend/native.py, whose
// cache key covers every header of this folder).
#pragma once

#include <cstdint>

namespace {

// Sixteen floats in a vector register (GCC and clang vector extensions; any target).
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
inline v16 load16(const float* p) {
  v16 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
// Eight floats: one AVX2 register, for loops that keep many vectors live on CPUs without
// AVX-512 (where a v16 is two registers, or a stack slot).
typedef float v8 __attribute__((vector_size(32)));
inline v8 load8(const float* p) {
  v8 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

// Lane shuffles of two vectors: lanes 0-15 are a's, 16-31 b's (GCC and clang spell it apart).
#if defined(__clang__)
#define CAPSCTL_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define CAPSCTL_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, i16{__VA_ARGS__})
#endif
#define CAPSCTL_LO8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define CAPSCTL_HI8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define CAPSCTL_LO4 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define CAPSCTL_HI4 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#define CAPSCTL_LO2 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29
#define CAPSCTL_HI2 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
#define CAPSCTL_LO1 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define CAPSCTL_HI1 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31

// The lane sums of 16 vectors as one vector, out[i] = sum of v[i]'s lanes: a tree of 15
// shuffle-and-add steps instead of 16 reductions of 4 steps each.
inline v16 lane_sums(v16* v) {
  for (int i = 0; i < 8; ++i)  // v[i]: 8 partial sums of v[2i], then 8 of v[2i+1]
    v[i] = CAPSCTL_SHUFFLE(v[2 * i], v[2 * i + 1], CAPSCTL_LO8) +
           CAPSCTL_SHUFFLE(v[2 * i], v[2 * i + 1], CAPSCTL_HI8);
  for (int i = 0; i < 4; ++i)  // 4 partial sums of each of 4 vectors
    v[i] = CAPSCTL_SHUFFLE(v[2 * i], v[2 * i + 1], CAPSCTL_LO4) +
           CAPSCTL_SHUFFLE(v[2 * i], v[2 * i + 1], CAPSCTL_HI4);
  for (int i = 0; i < 2; ++i)  // 2 of each of 8
    v[i] = CAPSCTL_SHUFFLE(v[2 * i], v[2 * i + 1], CAPSCTL_LO2) +
           CAPSCTL_SHUFFLE(v[2 * i], v[2 * i + 1], CAPSCTL_HI2);
  return CAPSCTL_SHUFFLE(v[0], v[1], CAPSCTL_LO1) + CAPSCTL_SHUFFLE(v[0], v[1], CAPSCTL_HI1);
}

}  // namespace
