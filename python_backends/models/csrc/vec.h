// Short float vectors for the native kernels: GCC's vector extensions, which compile to AVX-512
// with -march=native on CPUs that have it (16 lanes) and to AVX2 elsewhere (8 lanes).
#pragma once

#include <cstdint>
#include <cstring>

namespace llm {

#if defined(__AVX512F__)
constexpr int64_t VL = 16;
#else
constexpr int64_t VL = 8;
#endif
typedef float vec __attribute__((vector_size(VL * sizeof(float))));
typedef float vec_u __attribute__((vector_size(VL * sizeof(float)), aligned(4)));  // unaligned
typedef int32_t ivec __attribute__((vector_size(VL * sizeof(int32_t))));

inline vec load(const float* p) { return *reinterpret_cast<const vec_u*>(p); }
inline void store(float* p, vec v) { *reinterpret_cast<vec_u*>(p) = v; }

// The sum of the lanes, added as a tree (halves, quarters, ...).
inline float hsum(vec v) {
#if defined(__AVX512F__)
  typedef float half __attribute__((vector_size(8 * sizeof(float))));
  const half h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const vec h8 = v;
#endif
  typedef float quarter __attribute__((vector_size(4 * sizeof(float))));
  const quarter h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) +
                     __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

// The dot product of a[0..n) and b[0..n): lanes tree-summed (hsum), then the tail in order.
inline float dot(const float* a, const float* b, int64_t n) {
  const int64_t body = n / VL * VL;
  vec acc{};
  for (int64_t k = 0; k < body; k += VL) acc += load(a + k) * load(b + k);
  float s = hsum(acc);
  for (int64_t k = body; k < n; ++k) s += a[k] * b[k];
  return s;
}

// exp(x) lane by lane for x <= 0 (scores minus their maximum), within about 2 ulp; below -87
// (where exp leaves float's normal range) it returns exp(-87.3), about 1e-38.
inline vec exp_nonpositive(vec x) {
  const vec lowest = vec{} - 87.3f;
  x = x < lowest ? lowest : x;
  const vec t = x * 1.44269504088896341f;                    // x / ln 2
  const ivec n = __builtin_convertvector(t - 0.5f, ivec);     // round(t) for t <= 0
  const vec nf = __builtin_convertvector(n, vec);
  const vec r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;  // x - n ln 2, in two parts
  vec p = vec{} + 1.f / 5040.f;                              // Taylor to r^7: |r| <= 0.35
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const ivec bits = (n + 127) << 23;                         // 2^n
  vec scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace llm
