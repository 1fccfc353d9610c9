// float32 projections (y = x W^T) on the engine's thread and the idle helper (idle_helper.h).
//
// The weight is packed once into panels of NR output features, each panel [K, NR] contiguous,
// so a step streams the whole matrix front to back and every loaded weight vector feeds up to MR
// tokens of the batch. The arithmetic is plain float32 FMA with one accumulator per output, k
// ascending; results differ from MKL's only in rounding. From kAmxRows tokens on, on CPUs with
// AMX, the same products run on AMX tiles (amx.h) to the same precision. A weight that is exact
// GGUF blocks (models/weight_blocks.py) or 16-bit floats is packed as such too, and calls of few
// rows, bound by reading the weight, read those instead: the same float32 values. On AMX, calls
// of 13 to 128 rows compute from the blocks' integer levels on tiles (amx.h, level_product), and
// of more from two bfloat16 pieces of each d q and m where those are exact (LevelPieces): to
// float32 precision, in another order of sums.
//
// The screens and screen_candidates serve greedy rows' LM head (models/greedy_head.py): an
// estimate of every logit from rounded operands, and the tokens whose bounds reach the largest.
// The estimate computes on AMX tiles from bfloat16 operands (screen_linear), or where there are
// no tiles from int8 operands on AVX-512 VNNI (int8_screen: Intel from Cascade Lake, AMD Zen 4).
//
// Built and loaded by python_backends/models/kernels.py (for the machine it runs on).
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "amx.h"
#include "idle_helper.h"
#include "ops.h"
#include "vec.h"

namespace {

using llm::load;
using llm::store;
using llm::vec;
using llm::ivec;
using llm::VL;
constexpr int64_t NR = 2 * VL;  // output features per panel
constexpr int64_t MR = VL == 16 ? 12 : 6;  // tokens per tile: 2 MR accumulators + 2 in registers
constexpr int64_t kAhead = 16;   // weight rows prefetched ahead (a panel runs into the next)

// acc[r] += x[r, k] * (w0, w1) for the R rows of a tile: every tile's multiply-adds, in the
// same order whatever the weights come from.
template <int64_t R>
inline void accumulate(vec (&acc)[R][2], const float* x, int64_t K, int64_t k, vec w0, vec w1) {
  for (int64_t r = 0; r < R; ++r) {
    const float xv = x[r * K + k];
    acc[r][0] += xv * w0;
    acc[r][1] += xv * w1;
  }
}

template <int64_t R>
inline void store_tile(const vec (&acc)[R][2], float* dst, int64_t ld, int64_t cols) {
  for (int64_t r = 0; r < R; ++r) {
    if (cols == NR) {
      store(dst + r * ld, acc[r][0]);
      store(dst + r * ld + VL, acc[r][1]);
    } else {
      float row[NR];
      std::memcpy(row, &acc[r][0], sizeof(vec));
      std::memcpy(row + VL, &acc[r][1], sizeof(vec));
      std::memcpy(dst + r * ld, row, cols * sizeof(float));
    }
  }
}

// dst[r, 0:cols] = x[r, :] . panel[:, 0:cols] for the R rows of a tile.
template <int64_t R>
inline void tile(const float* x, int64_t K, const float* panel, float* dst, int64_t ld, int64_t cols) {
  vec acc[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vec{};
  for (int64_t k = 0; k < K; ++k) {
    __builtin_prefetch(panel + (k + kAhead) * NR);
    __builtin_prefetch(panel + (k + kAhead) * NR + VL);
    accumulate<R>(acc, x, K, k, load(panel + k * NR), load(panel + k * NR + VL));
  }
  store_tile<R>(acc, dst, ld, cols);
}

// Weights that are GGUF blocks (models/weight_blocks.py): every group of inputs of a feature share
// a scale d (and offset m), and each weight is exactly d q (+ m) for a small integer q. Packed per
// panel (pack_blocks), a few-row call reads them instead of the float32 panel and computes on the
// same float32 weights: d q is exact in float32 (a 4- or 5-bit q times a d of at most 17
// significant bits, an 8-bit q times a float16 d), so one FMA gives gguf's fl(fl(d q) + m) (in
// Q6_K d q is not exact, and the FMA's one rounding is gguf's of d q), and pack_blocks checks
// every weight with the kernel's own arithmetic all the same.
constexpr int64_t kBlock = 32;
// Calls of at most this many rows read the blocks (one row tile: each weight dequantized once);
// more rows compute enough per weight that the float32 panels are as fast or faster.
constexpr int64_t kBlockRows = MR;

// The VL bytes at p (int8 if kSigned, else uint8) as floats.
template <bool kSigned>
inline vec widen_bytes(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (vec)_mm512_cvtepi32_ps(kSigned ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#else
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (vec)_mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#endif
}

// A layout of q bytes (kStride a input) followed by d and m [K / G][NR] float32: each group's
// d and m for the panel's NR features, loaded once for its G inputs.
template <int64_t G, int64_t Stride>
struct WithOffsets {
  static constexpr int64_t kGroup = G;  // inputs per d and m
  static constexpr int64_t kStride = Stride;  // q bytes per input
  int64_t K;
  int64_t scales_at() const { return K * kStride; }
  int64_t bytes() const { return scales_at() + 2 * (K / G) * NR * 4; }
  float* scales(uint8_t* p) const { return reinterpret_cast<float*>(p + scales_at()); }
  float* mins(uint8_t* p) const { return scales(p) + K / G * NR; }
  struct Scales {
    vec d0, d1, m0, m1;
  };
  Scales block(const uint8_t* panel, int64_t b) const {
    const float* d = reinterpret_cast<const float*>(panel + scales_at()) + b * NR;
    const float* m = d + K / G * NR;
    return {load(d), load(d + VL), load(m), load(m + VL)};
  }
};

// Q4_1, any 4-bit block: q [K][VL] bytes, byte i of input k holding feature i's q in [0, 15] in
// its low half and feature VL + i's in its high half, then d and m; w = d q + m. A fifth of the
// float32 panel's bytes.
struct Q41 : WithOffsets<kBlock, VL> {
  // The NR levels q of input k, as floats.
  void levels(const uint8_t* panel, int64_t k, vec& q0, vec& q1) const {
    const auto* q = reinterpret_cast<const __m128i*>(panel + k * kStride);
#if defined(__AVX512F__)
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(q));
    q0 = (vec)_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    q1 = (vec)_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
#else
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(q));
    q0 = (vec)_mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    q1 = (vec)_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
#endif
  }
  // The NR weights of input k, of block s.
  void at(const uint8_t* panel, int64_t k, const Scales& s, vec& w0, vec& w1) const {
    levels(panel, k, w0, w1);
    w0 = w0 * s.d0 + s.m0;
    w1 = w1 * s.d1 + s.m1;
  }
  void put(uint8_t* panel, int64_t k, int64_t j, uint8_t q) const {  // q: a uint8
    TORCH_CHECK(q < 16, "pack_blocks: Q4_1 q must be in [0, 15]");
    panel[k * kStride + j % VL] |= static_cast<uint8_t>(j < VL ? q : q << 4);
  }
};

// Q8_0 (int8 tensors): q [K][NR] int8, then d [K / kBlock][NR] float32; w = d q. Under a third
// of the float32 panel's bytes.
struct Q80 {
  static constexpr int64_t kGroup = kBlock;
  static constexpr int64_t kStride = NR;
  int64_t K;
  int64_t scales_at() const { return K * kStride; }
  int64_t bytes() const { return scales_at() + (K / kBlock) * NR * 4; }
  float* scales(uint8_t* p) const { return reinterpret_cast<float*>(p + scales_at()); }
  float* mins(uint8_t*) const { return nullptr; }
  struct Scales {
    vec d0, d1;
  };
  Scales block(const uint8_t* panel, int64_t b) const {
    const float* d = reinterpret_cast<const float*>(panel + scales_at()) + b * NR;
    return {load(d), load(d + VL)};
  }
  void levels(const uint8_t* panel, int64_t k, vec& q0, vec& q1) const {
    q0 = widen_bytes<true>(panel + k * kStride);
    q1 = widen_bytes<true>(panel + k * kStride + VL);
  }
  void at(const uint8_t* panel, int64_t k, const Scales& s, vec& w0, vec& w1) const {
    w0 = widen_bytes<true>(panel + k * kStride) * s.d0;
    w1 = widen_bytes<true>(panel + k * kStride + VL) * s.d1;
  }
  void put(uint8_t* panel, int64_t k, int64_t j, uint8_t q) const {  // q: an int8's bits
    panel[k * kStride + j] = q;
  }
};

// Byte levels with an offset, one d and m per G inputs (uint8 q [K][NR], then d and m
// [K / G][NR] float32; w = fma(q, d, m)): the 5-bit GGUF types (Q5_0, Q5_1, Q5_K: G = 32, q in
// [0, 31]) and Q6_K (G = 16, q + 32 in [0, 63], m = -32 d: the one rounding of the FMA is
// gguf's of d q). 1.25 (G = 32) or 1.5 (G = 16) bytes a weight.
template <int64_t G>
struct U8M : WithOffsets<G, NR> {
  using typename WithOffsets<G, NR>::Scales;
  using WithOffsets<G, NR>::kStride;
  void levels(const uint8_t* panel, int64_t k, vec& q0, vec& q1) const {
    q0 = widen_bytes<false>(panel + k * kStride);
    q1 = widen_bytes<false>(panel + k * kStride + VL);
  }
  void at(const uint8_t* panel, int64_t k, const Scales& s, vec& w0, vec& w1) const {
    w0 = widen_bytes<false>(panel + k * kStride) * s.d0 + s.m0;
    w1 = widen_bytes<false>(panel + k * kStride + VL) * s.d1 + s.m1;
  }
  void put(uint8_t* panel, int64_t k, int64_t j, uint8_t q) const { panel[k * kStride + j] = q; }
};

// The VL 16-bit values at p as floats: bfloat16 (a shift) or float16 (vcvtph2ps), exact.
template <bool kBf16>
inline vec widen_halves(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (kBf16) {
    return (vec)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return (vec)_mm512_cvtph_ps(h);
  }
#else
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (kBf16) {
    return (vec)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return (vec)_mm256_cvtph_ps(h);
  }
#endif
}

// Weights that are 16-bit floats exactly (uint16 per weight, bfloat16 or float16 bits): a
// float32 engine of a checkpoint stored in bfloat16 or float16 holds such values, widened
// exactly. [K][NR] 16-bit values, no scales; half the float32 panel's bytes. Widening a bfloat16
// is a shift, a float16 one vcvtph2ps: exact either way.
template <bool kBf16>
struct Halves {
  static constexpr int64_t kGroup = kBlock;  // no scales: any multiple of the vector loop
  static constexpr int64_t kStride = NR * 2;
  int64_t K;
  int64_t bytes() const { return K * kStride; }
  struct Scales {};
  Scales block(const uint8_t*, int64_t) const { return {}; }
  void at(const uint8_t* panel, int64_t k, const Scales&, vec& w0, vec& w1) const {
    w0 = widen_halves<kBf16>(panel + k * kStride);
    w1 = widen_halves<kBf16>(panel + k * kStride + 2 * VL);
  }
  // The 16-bit value of `w`, if it is one exactly.
  static std::optional<uint16_t> narrow(float w) {
    uint32_t b;
    std::memcpy(&b, &w, sizeof b);
    if constexpr (kBf16) {
      if (b & 0xFFFFu) return std::nullopt;
      return static_cast<uint16_t>(b >> 16);
    } else {
      const c10::Half h(w);
      if (static_cast<float>(h) != w || std::signbit(static_cast<float>(h)) != std::signbit(w))
        return std::nullopt;
      return h.x;
    }
  }
};
using BF16 = Halves<true>;
using F16 = Halves<false>;

// Whether a block tile of R rows makes the next input's weights ahead: its 2 R accumulators,
// both inputs' weights, a group's scales and offsets, the broadcast input and a mask fit in the
// vector registers (32 under AVX-512, 16 under AVX2; past that they spill, and the AVX2 path's
// 6 rows read 20 GMAC/s against 30). Every projection of the default model from its Q4_1 blocks,
// one thread, 2-core AMD EPYC: 4 rows 27.6 -> 29.3 GMAC/s, 8 rows 37.3 -> 38.9, 10 rows 39.5 ->
// 42.0; the AVX2 path's 3 rows 20.2 -> 21.1. The products and their order are the same.
template <int64_t R>
constexpr bool kPipelined = 2 * R + 10 <= (VL == 16 ? 32 : 16);

template <int64_t R, class F>
inline void block_tile(const float* x, int64_t K, const uint8_t* panel, float* dst, int64_t ld,
                       int64_t cols) {
  const F format{K};
  vec acc[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vec{};
  for (int64_t b = 0; b < K / F::kGroup; ++b) {
    const typename F::Scales s = format.block(panel, b);
    const int64_t k0 = b * F::kGroup, k1 = k0 + F::kGroup;
    vec w0, w1;
    if constexpr (kPipelined<R>) {  // input k + 1's weights made while input k's are multiplied
      format.at(panel, k0, s, w0, w1);
      for (int64_t k = k0; k < k1 - 1; ++k) {
        __builtin_prefetch(panel + (k + 8 * kAhead) * F::kStride);
        vec n0, n1;
        format.at(panel, k + 1, s, n0, n1);
        accumulate<R>(acc, x, K, k, w0, w1);
        w0 = n0;
        w1 = n1;
      }
      accumulate<R>(acc, x, K, k1 - 1, w0, w1);
    } else {
      for (int64_t k = k0; k < k1; ++k) {
        __builtin_prefetch(panel + (k + 8 * kAhead) * F::kStride);
        format.at(panel, k, s, w0, w1);
        accumulate<R>(acc, x, K, k, w0, w1);
      }
    }
  }
  store_tile<R>(acc, dst, ld, cols);
}

template <int64_t... Rs>
inline void tile_rows(int64_t rows, const float* x, int64_t K, const float* panel, float* dst,
                      int64_t ld, int64_t cols, std::integer_sequence<int64_t, Rs...>) {
  ((rows == Rs + 1 ? tile<Rs + 1>(x, K, panel, dst, ld, cols) : void()), ...);
}

// Rows [0, T) of panels [p0, p1) into dst (the first panel's first column), row stride ld.
void panels(const float* x, int64_t T, int64_t K, const float* packed, int64_t n, int64_t p0,
            int64_t p1, float* dst, int64_t ld) {
  for (int64_t t = 0; t < T; t += MR) {
    const int64_t rows = std::min(MR, T - t);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t cols = std::min(NR, n - p * NR);
      tile_rows(rows, x + t * K, K, packed + p * K * NR, dst + t * ld + (p - p0) * NR, ld, cols,
                std::make_integer_sequence<int64_t, MR>{});
    }
  }
}

template <class F, int64_t... Rs>
inline void block_tile_rows(int64_t rows, const float* x, int64_t K, const uint8_t* panel,
                            float* dst, int64_t ld, int64_t cols,
                            std::integer_sequence<int64_t, Rs...>) {
  ((rows == Rs + 1 ? block_tile<Rs + 1, F>(x, K, panel, dst, ld, cols) : void()), ...);
}

// panels() from the blocks: rows [0, T) (T <= kBlockRows) of panels [p0, p1).
template <class F>
void block_panels(const float* x, int64_t T, int64_t K, const uint8_t* packed, int64_t n,
                  int64_t p0, int64_t p1, float* dst, int64_t ld) {
  const int64_t bytes = F{K}.bytes();
  for (int64_t p = p0; p < p1; ++p)
    block_tile_rows<F>(T, x, K, packed + p * bytes, dst + (p - p0) * NR, ld,
                       std::min(NR, n - p * NR),
                       std::make_integer_sequence<int64_t, kBlockRows>{});
}

// A panel's float32 weights [K][NR] from its blocks: the float32 panel's values exactly
// (pack_blocks and pack_halves checked each with this same arithmetic).
template <class F>
void unpack_panel(const uint8_t* panel, int64_t K, float* out) {
  const F format{K};
  for (int64_t b = 0; b < K / F::kGroup; ++b) {
    const typename F::Scales s = format.block(panel, b);
    for (int64_t k = b * F::kGroup; k < (b + 1) * F::kGroup; ++k) {
      vec w0, w1;
      format.at(panel, k, s, w0, w1);
      store(out + k * NR, w0);
      store(out + k * NR + VL, w1);
    }
  }
}

// panels() for calls of more rows than a tile, reading the blocks: each panel is unpacked once
// into a scratch that stays in cache while every row tile passes over it. From the float32
// panels the first row tile streams the weights from memory with only a tile's rows of
// arithmetic for each, which bounds it on cores that read memory slowly; the blocks are a
// fifth to a half of the bytes. The same products in the same order as panels(): bit for bit
// its results.
template <class F>
void unpacked_panels(const float* x, int64_t T, int64_t K, const uint8_t* packed, int64_t n,
                     int64_t p0, int64_t p1, float* dst, int64_t ld) {
  const int64_t bytes = F{K}.bytes();
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(K * NR));
  for (int64_t p = p0; p < p1; ++p) {
    unpack_panel<F>(packed + p * bytes, K, scratch.data());
    const int64_t cols = std::min(NR, n - p * NR);
    for (int64_t t = 0; t < T; t += MR)
      tile_rows(std::min(MR, T - t), x + t * K, K, scratch.data(), dst + t * ld + (p - p0) * NR,
                ld, cols, std::make_integer_sequence<int64_t, MR>{});
  }
}

// Calls of more than kBlockRows and at most this many rows read the blocks through
// unpacked_panels (0: none). Engines measure which is faster at load and set it
// (models/decoder.py, unpacked_reads_faster): the unpacking costs arithmetic that a core which
// streams memory fast does not win back (the 2-core AMD EPYC of docs/engines.md: 0.84-0.99x at
// 16-48 rows), and wins where it reads memory slowly (the 2-core AMX Xeon there: 1.1-1.25x).
std::atomic<int64_t> unpack_rows{0};

// Calls of more than kBlockRows rows whose weight has levels for tiles (Layout::expand) compute
// from the levels on AMX (amx.h, level_product) rather than from the float32 panels.
std::atomic<bool> amx_levels{true};

// Sets that (where the build has AMX); returns the old value.
bool set_amx_levels(bool enabled) {
#ifdef LLM_AMX
  return amx_levels.exchange(enabled);
#else
  (void)enabled;
  return false;
#endif
}

int64_t set_unpack_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0, "set_unpack_rows: rows must be at least 0, got ", rows);
  return unpack_rows.exchange(rows);
}

// How many panels one chunk of work holds: about kChunkSeconds of it, by the time a panel takes
// to stream from memory or to compute, whichever is longer (rough rates of one core).
int64_t panels_per_chunk(int64_t T, int64_t K, int64_t weight_bytes, double flops_per_s) {
  constexpr double kChunkSeconds = 25e-6, kBytesPerS = 12e9;
  const double read = static_cast<double>(K * NR * weight_bytes) / kBytesPerS;
  const double arithmetic = 2.0 * static_cast<double>(T * K * NR) / flops_per_s;
  return std::max<int64_t>(1, static_cast<int64_t>(kChunkSeconds / std::max(read, arithmetic)));
}

// Multiply-adds a second that the calling thread's FMA units sustain on this build's vectors:
// a tile's 2 MR independent accumulators, so throughput bounds it and not latency. The ceiling
// that the projections' rate is read against (bench/roofline.py): on the 2-core AMD EPYC of
// docs/engines.md, 57.8 GMAC/s a core, one 512-bit FMA a cycle at about 3.6 GHz.
double fma_peak(int64_t iterations) {
  TORCH_CHECK(iterations > 0, "fma_peak: iterations must be positive, got ", iterations);
  // Volatile reads and writes pin the loop between the clock's two readings (a compiler may
  // otherwise move arithmetic that has no side effects across them).
  volatile float factor = 0.999f, term = 1e-3f, sink = 0.f;
  vec acc[2 * MR];
  const auto start = std::chrono::steady_clock::now();
  const vec x = vec{} + factor, y = vec{} + term;  // each sum settles at 1, never denormal
  for (auto& a : acc) a = vec{} + 1.f;
  for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 24
    for (int64_t j = 0; j < 2 * MR; ++j) acc[j] = acc[j] * x + y;
  }
  float sum = 0.f;
  for (const auto& a : acc) sum += llm::hsum(a);
  sink = sum;
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  TORCH_CHECK(std::isfinite(sink), "fma_peak: the sums diverged");
  return static_cast<double>(iterations * 2 * MR * VL) / took.count();
}

// From this many tokens a call computes on AMX tiles (amx.h), where the CPU has them.
constexpr int64_t kAmxRows = 48;
// On AMX, calls of more than kBlockRows and at most this many rows compute from a weight's levels
// where it has them (amx.h, level_product): their three products a block against six leave each
// tile product twice the input tiles to load from L2, which bounds them in prompt-sized calls.
constexpr int64_t kLevelRows = 128;
// On AMX, the row pieces of one block of rows take at most this much (of a core's 2 MB of L2).
constexpr int64_t kAmxBlockBytes = 1 << 20;

// Calls whose x takes more than twice this much compute it in blocks of rows of at most this
// much, so that a block stays in L2 while every panel passes over it; run whole, x streams from
// L3 or memory once a panel (measured in docs/engines.md, "Projections, and the idle-CPU
// helper"). Smaller calls, decode steps', run whole: a block more would unpack each panel again
// (unpacked_panels).
constexpr int64_t kTileBlockBytes = 512 << 10;

// Rows of one block for panels() and unpacked_panels(): whole tiles, the blocks even.
int64_t tile_block_rows(int64_t T, int64_t K) {
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(float));
  if (T * row_bytes <= 2 * kTileBlockBytes) return T;
  const int64_t most = std::max<int64_t>(MR, kTileBlockBytes / row_bytes / MR * MR);
  const int64_t blocks = (T + most - 1) / most;
  return ((T + blocks - 1) / blocks + MR - 1) / MR * MR;
}

#ifdef LLM_AMX
// A thread's two buffers of split weight panels (amx.h's B operands, in its aligned scratch),
// and which panel of which call one of them holds already.
struct SplitPanels {
  std::vector<llm::amx::Line> lines;
  uint16_t* b[2] = {};
  uint64_t call = 0;
  int64_t panel = -1;
  int which = 0;

  void reserve(int64_t per_panel) {  // uint16 per split panel, a multiple of 32 (64 bytes)
    if (static_cast<int64_t>(lines.size()) * 32 < 2 * per_panel) call = 0;  // about to grow
    b[0] = llm::amx::scratch<uint16_t>(lines, 2 * per_panel);
    b[1] = b[0] + per_panel;
  }
  int holds(uint64_t c, int64_t p) const { return c == call && p == panel ? which : -1; }
  void mark(uint64_t c, int64_t p, int w) {
    call = c;
    panel = p;
    which = w;
  }
};

// Memory for a call's row pieces (int16): the calling thread's last call's again unless a helper
// still holds it. Written into cache-warm memory rather than fresh pages every call: the pieces
// of ~250 rows are 0.9 MB a projection, 100 MB a step of the default model.
at::Tensor row_pieces(int64_t numel) {
  thread_local at::Tensor cached;
  if (!cached.defined() || cached.use_count() > 1 || cached.numel() < numel)
    cached = at::empty({numel}, at::TensorOptions().dtype(at::kShort));
  return cached;
}

// The rows of x [T, K] as split_rows' pieces, in blocks whose pieces stay in L2 while every
// panel passes over them (2048 rows at once streamed their pieces from L3 per panel: 167
// GFLOP/s against 269 for 256). Block b's pieces start at a + b * block_rows * piece_row.
struct RowBlocks {
  int64_t Kp, piece_row, blocks, block_rows;
  at::Tensor pieces;
  const uint16_t* a;
};

// With `extra` [T, E] (E a multiple of 32): the rows of [x | extra], x's columns padded to 32s.
RowBlocks split_row_blocks(const float* x, int64_t T, int64_t K, const float* extra = nullptr,
                           int64_t E = 0) {
  const int64_t Kx = (K + 31) / 32 * 32, Kp = Kx + E;
  const int64_t piece_row = llm::amx::kPieces * Kp;  // uint16
  const int64_t most = std::max<int64_t>(32, kAmxBlockBytes / (2 * piece_row) / 16 * 16);
  int64_t blocks = (T + most - 1) / most;
  const int64_t block_rows = ((T + blocks - 1) / blocks + 15) / 16 * 16;
  blocks = (T + block_rows - 1) / block_rows;
  at::Tensor pieces = row_pieces(blocks * block_rows * piece_row);
  auto* a = reinterpret_cast<uint16_t*>(pieces.mutable_data_ptr<int16_t>());
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t t0 = b * block_rows, rows = std::min(block_rows, T - t0);
    const int64_t Tp = (rows + 15) / 16 * 16;
    llm::amx::split_rows(x + t0 * K, rows, K, a + t0 * piece_row, Tp, Kx, Kp);
    if (E > 0) {
      llm::amx::split_rows(extra + t0 * E, rows, E, a + t0 * piece_row + Kx * llm::amx::RT, Tp, E,
                           Kp);
    }
  }
  return {Kp, piece_row, blocks, block_rows, pieces, a};
}
#endif

// compute(t0, p0, p1, dst, ld): rows [t0, ...) of panels [p0, p1) of a call into dst.
using PanelsFn = std::function<void(int64_t, int64_t, int64_t, float*, int64_t)>;

// Inputs [k0, k1) (even) of a panel's levels q as AMX B operands (amx.h, level_product).
using ExpandLevels = void (*)(const uint8_t*, int64_t, uint16_t*, int64_t, int64_t);
// Inputs [k0, k1) (even) of a panel's weights d q in two pieces, with its offsets m beside them
// (of Ka, K's and the blocks' m padded to 32s; see LevelPieces).
using ExpandPieces = void (*)(const uint8_t*, int64_t, int64_t, uint16_t*, int64_t, int64_t);

#ifdef LLM_AMX
// A panel's levels for amx.h's level_product, expanded a slice at a time like PanelSplit.
struct LevelSplit {
  ExpandLevels fill = nullptr;
  const uint8_t* panel = nullptr;  // none: nothing to expand
  int64_t K = 0;
  uint16_t* out = nullptr;

  void rows(int64_t k0, int64_t k1) const {
    if (panel != nullptr) fill(panel, K, out, k0, std::min(k1, K));
  }
  void all() const { rows(0, K); }
};

// Calls of more than kLevelRows rows of a weight of levels with offsets whose every d q and m is
// two bfloat16 pieces exactly (a float16 d of a 4- or 5-bit q, a float16 m: Q4_0, Q4_1, Q5_0,
// Q5_1; not a K-quant's 17-bit d): x w = x (d q) + (sum of x) m over each block of 32 inputs,
// one product of depth K + K / 32 (`extra`, padded to 32s: each row's block sums against the m),
// five bfloat16 products of x's three pieces and the weight's two where the float32 panels take
// six, and the B operands expanded from the blocks (0.75 to 1.25 bytes a weight) rather than
// split from the float32 panels (4). Every product exact and every sum float32, as
// level_product's, in another order than the float32 panels'.
struct LevelPieces {
  ExpandPieces fill = nullptr;
  const uint8_t* panel = nullptr;  // none: nothing to expand
  int64_t K = 0, Ka = 0;
  uint16_t* out = nullptr;

  void rows(int64_t k0, int64_t k1) const {
    if (panel != nullptr) fill(panel, K, Ka, out, k0, k1);
  }
  void all() const { rows(0, Ka); }
};

// A call's chunks on AMX tiles: each thread computes its chunk's panels in the order it travels
// (the helper takes chunks from the last down), numbered across row blocks (g = block * P +
// panel), and prepares the next panel's B operands (`prepare(panel, buffer)`: a PanelSplit or a
// LevelSplit) during the current one's products (`product`), also past the chunk's end: the
// thread usually computes the neighbouring chunk next, and then finds its panel prepared.
// per_panel: uint16 of B operands a panel.
template <class Prepare, class Product>
PanelsFn amx_panels(const RowBlocks& rb, int64_t T, int64_t P, int64_t n, int64_t per_panel,
                    Prepare prepare, Product product) {
  static std::atomic<uint64_t> calls{0};
  const uint64_t call = ++calls;
  const int64_t B = rb.block_rows, end = rb.blocks * P;  // end: panels of all blocks
  return [=](int64_t t0, int64_t p0, int64_t p1, float* dst, int64_t ld) {
    llm::amx::configure();
    thread_local SplitPanels split;
    split.reserve(per_panel);
    const int64_t rows = std::min(B, T - t0), Tp = (rows + 15) / 16 * 16;
    const uint16_t* ra = rb.a + t0 * rb.piece_row;
    const bool down = llm::on_helper();
    const int64_t step = down ? -1 : 1, g0 = t0 / B * P + (down ? p1 - 1 : p0);
    int cur = split.holds(call, g0);
    if (cur < 0) {
      cur = 0;
      prepare(g0 % P, split.b[cur]).all();
    }
    for (int64_t i = 0, g = g0; i < p1 - p0; ++i, g += step, cur ^= 1) {
      decltype(prepare(0, nullptr)) next;
      if (g + step >= 0 && g + step < end) next = prepare((g + step) % P, split.b[cur ^ 1]);
      const int64_t p = g % P;
      product(ra, t0, rows, Tp, p, split.b[cur], dst + (p - p0) * NR, ld,
              std::min(NR, n - p * NR), next);
    }
    split.mark(call, g0 + (p1 - p0) * step, cur);
  };
}
#endif

// Whether calls of kAmxRows tokens or more compute on AMX tiles here (built for a CPU with AMX,
// and the kernel granted this process the tiles' state).
bool linear_amx() {
#ifdef LLM_AMX
  return NR == 32 && llm::amx::available();
#else
  return false;
#endif
}

at::Tensor pack_linear_weight(const at::Tensor& weight);

#ifdef __AVX512VNNI__
constexpr bool kDotInt8 = NR == 32;  // int8_screen below
#else
constexpr bool kDotInt8 = false;
#endif

// What the greedy head's screen can compute on here, the path for many rows first: "amx"
// (screen_linear), "avx512_vnni" (int8_screen); none where it does not.
std::vector<std::string> screen_paths() {
  std::vector<std::string> paths;
  if (linear_amx()) paths.emplace_back("amx");
  if (kDotInt8) paths.emplace_back("avx512_vnni");
  return paths;
}

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
              "pack_linear_weight: a float32 CPU matrix [out_features, in_features]");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + NR - 1) / NR;
  at::Tensor padded = at::constant_pad_nd(weight, {0, 0, 0, P * NR - N}, 0);
  return padded.view({P, NR, K}).transpose(1, 2).contiguous();  // [P, K, NR]
}

// Whether panel p of F gives back weight [N, K]'s features p * NR... with the kernel's own
// arithmetic (padding features: zeros, as the float panels'), as values: a zero's sign aside,
// which no product sum sees (the tiles' accumulators start at +0, and +0 plus a zero product
// of either sign is +0).
template <class F>
bool gives_back(const F& format, const uint8_t* panel, const float* wp, int64_t p, int64_t N) {
  const int64_t K = format.K;
  for (int64_t k = 0; k < K; ++k) {
    vec w[2];
    format.at(panel, k, format.block(panel, k / F::kGroup), w[0], w[1]);
    float got[NR], want[NR];
    std::memcpy(got, w, sizeof(got));
    for (int64_t j = 0; j < NR; ++j) want[j] = p * NR + j < N ? wp[(p * NR + j) * K + k] : 0.f;
    if (!std::equal(got, got + NR, want)) return false;
  }
  return true;
}

// Weight [N, K]'s blocks (models/weight_blocks.py: q [N, K], d and m float32 [N, K / kBlock])
// in F's panels, or an empty tensor where F's arithmetic does not give back every float32 weight
// bit for bit (then calls read the float32 panels alone).
template <class F>
at::Tensor pack_format(const at::Tensor& weight, const at::Tensor& q, const at::Tensor& d,
                       const at::Tensor* m) {
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + NR - 1) / NR;
  const int64_t B = K / F::kGroup;
  const F format{K};
  at::Tensor out = at::zeros({P, format.bytes()}, at::kByte);
  const float *wp = weight.const_data_ptr<float>(), *dp = d.const_data_ptr<float>();
  const float* mp = m != nullptr ? m->const_data_ptr<float>() : nullptr;
  const auto* qp = reinterpret_cast<const uint8_t*>(q.const_data_ptr());
  auto* base = reinterpret_cast<uint8_t*>(out.mutable_data_ptr());
  for (int64_t p = 0; p < P; ++p) {
    uint8_t* panel = base + p * format.bytes();
    float *ds = format.scales(panel), *ms = format.mins(panel);
    for (int64_t j = 0; j < NR && p * NR + j < N; ++j) {
      const int64_t row = p * NR + j;
      for (int64_t k = 0; k < K; ++k) format.put(panel, k, j, qp[row * K + k]);  // q's bits
      for (int64_t b = 0; b < B; ++b) {
        ds[b * NR + j] = dp[row * B + b];
        if (ms != nullptr) ms[b * NR + j] = mp[row * B + b];
      }
    }
    if (!gives_back(format, panel, wp, p, N)) return at::empty({0}, out.options());
  }
  return out;
}

// Weight [N, K] as 16-bit values in F's panels (BF16, F16), or an empty tensor where one weight
// is not such a value.
template <class F>
at::Tensor pack_halves_as(const at::Tensor& weight, at::ScalarType dtype) {
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + NR - 1) / NR;
  const F format{K};
  at::Tensor out = at::zeros({P, format.bytes() / 2}, at::TensorOptions().dtype(dtype));
  const float* wp = weight.const_data_ptr<float>();
  auto* base = reinterpret_cast<uint8_t*>(out.mutable_data_ptr());
  for (int64_t p = 0; p < P; ++p) {
    uint8_t* panel = base + p * format.bytes();
    for (int64_t j = 0; j < NR && p * NR + j < N; ++j) {
      for (int64_t k = 0; k < K; ++k) {
        const std::optional<uint16_t> h = F::narrow(wp[(p * NR + j) * K + k]);
        if (!h) return at::empty({0}, out.options());
        std::memcpy(panel + k * F::kStride + 2 * j, &*h, 2);
      }
    }
    if (!gives_back(format, panel, wp, p, N)) return at::empty({0}, out.options());
  }
  return out;
}

// A float32 weight [N, K] whose every value is a bfloat16 (else a float16), packed for few-row
// calls to read as such (a bfloat16 or float16 tensor); an empty one where it is neither.
at::Tensor pack_halves(const at::Tensor& weight_in) {
  TORCH_CHECK(weight_in.device().is_cpu() && weight_in.scalar_type() == at::kFloat &&
                  weight_in.dim() == 2,
              "pack_halves: a float32 CPU weight [N, K]");
  const at::Tensor weight = weight_in.contiguous();
  if (weight.numel() == 0 || weight.size(1) % kBlock) return at::empty({0}, at::kBFloat16);
  at::Tensor out = pack_halves_as<BF16>(weight, at::kBFloat16);
  if (out.numel() == 0) out = pack_halves_as<F16>(weight, at::kHalf);
  return out;
}

// The layouts a few-row call may read, by name (models/kernels.py, NativeLinear.blocks): "q4"
// (Q41), "q8" (Q80), "u8g32" and "u8g16" (U8M), "bf16" and "f16" (Halves; pack_halves).
using BlockPanels = void (*)(const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t,
                             int64_t, float*, int64_t);
struct Layout {
  BlockPanels run = nullptr;      // at most kBlockRows rows
  BlockPanels unpacked = nullptr;  // more
  int64_t bytes = 0;  // a panel's
  int64_t group = 0;  // inputs per d (and m)
  bool offset = false;  // has m
  ExpandLevels expand = nullptr;  // levels of 32-input blocks for AMX tiles, where there are
  int64_t scales_at = 0;          // d [K / group][NR] float32 (then m) from a panel's start
  ExpandPieces pieces = nullptr;  // d q and m in two pieces for AMX tiles (LevelPieces)
  int level_bits = 0;             // bits of a level q, where `pieces`
};

template <class F>
Layout layout(int64_t K, bool offset) {
  return {block_panels<F>, unpacked_panels<F>, F{K}.bytes(), F::kGroup, offset};
}

#ifdef LLM_AMX
// The levels of inputs [k0, k1) of a panel of F in amx.h's B layout (one piece of PanelSplit's):
// each q is an integer of at most 8 bits, so exactly a bfloat16 (a float32's top half).
template <class F>
void expand_levels(const uint8_t* panel, int64_t K, uint16_t* out, int64_t k0, int64_t k1) {
  const F format{K};
  for (int64_t k = k0; k < k1; k += 2) {
    vec even[2], odd[2];
    format.levels(panel, k, even[0], even[1]);
    format.levels(panel, k + 1, odd[0], odd[1]);
    for (int g = 0; g < 2; ++g) {
      _mm512_store_si512(out + g * (K * 16) + (k / 32) * 512 + (k / 2 % 16) * 32,
                         llm::amx::pair_bf16((__m512)even[g], (__m512)odd[g]));
    }
  }
}

// Levels of at most 5 bits go straight from bytes to bfloat16 pairs by one table lookup (vpermw)
// for 32 levels, where the generic expansion above converts 16 at a time to float32 and packs
// the pairs. The same bits.
//
// Words (even[i], odd[i]) for i = 0..15 from two rows of 16 bytes: B's pairs of k.
inline __m512i byte_pairs(const uint8_t* even, const uint8_t* odd) {
  const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(even));
  const __m128i o = _mm_loadu_si128(reinterpret_cast<const __m128i*>(odd));
  return _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(e, o), _mm_unpacklo_epi8(e, o)));
}

// Word i: the bfloat16 of i mod `levels` (vpermw reads each index's low 5 bits).
inline __m512i bf16_levels(int levels) {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {
    const float f = static_cast<float>(i % levels);
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    t[i] = static_cast<uint16_t>(bits >> 16);
  }
  return _mm512_load_si512(t);
}

// Q4_1: input k's 16 bytes hold features 0..15 in their low nibbles, 16..31 in the high ones
// (a byte's high nibble's lowest bit is an index's bit 4, which the table of 16 repeats over).
template <>
void expand_levels<Q41>(const uint8_t* panel, int64_t K, uint16_t* out, int64_t k0, int64_t k1) {
  static_assert(Q41::kStride == 16, "16 bytes an input");
  static const __m512i table = bf16_levels(16);
  for (int64_t k = k0; k < k1; k += 2) {
    const __m512i pairs = byte_pairs(panel + k * 16, panel + k * 16 + 16);
    uint16_t* o = out + (k / 32) * 512 + (k / 2 % 16) * 32;
    _mm512_store_si512(o, _mm512_permutexvar_epi16(pairs, table));
    _mm512_store_si512(o + K * 16, _mm512_permutexvar_epi16(_mm512_srli_epi16(pairs, 4), table));
  }
}

// The 5-bit types: a byte a feature, q in [0, 31].
template <>
void expand_levels<U8M<32>>(const uint8_t* panel, int64_t K, uint16_t* out, int64_t k0,
                            int64_t k1) {
  static_assert(U8M<32>::kStride == 32, "32 bytes an input");
  static const __m512i table = bf16_levels(32);
  for (int64_t k = k0; k < k1; k += 2) {
    const uint8_t* even = panel + k * 32;
    uint16_t* o = out + (k / 32) * 512 + (k / 2 % 16) * 32;
    for (int g = 0; g < 2; ++g) {
      _mm512_store_si512(o + g * (K * 16), _mm512_permutexvar_epi16(
                                               byte_pairs(even + 16 * g, even + 32 + 16 * g), table));
    }
  }
}

// LevelPieces' operands: for input k < K, d q of its block in two pieces (each the top bfloat16
// of what the one before left: exact where two_pieces holds); for K + b, block b's m alike; zeros
// up to Ka. Laid out as two of PanelSplit's pieces, of depth Ka.
template <class F>
void expand_pieces(const uint8_t* panel, int64_t K, int64_t Ka, uint16_t* out, int64_t k0,
                   int64_t k1) {
  const F format{K};
  const int64_t blocks = K / kBlock, per_piece = 2 * Ka * 16;
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  auto weights = [&](int64_t k, __m512 (&w)[2]) {
    if (k < K) {
      vec q0, q1;
      format.levels(panel, k, q0, q1);
      const auto s = format.block(panel, k / kBlock);
      w[0] = (__m512)(q0 * s.d0);  // exact: at most 24 significant bits
      w[1] = (__m512)(q1 * s.d1);
    } else if (k - K < blocks) {
      const auto s = format.block(panel, k - K);
      w[0] = (__m512)s.m0;
      w[1] = (__m512)s.m1;
    } else {
      w[0] = w[1] = _mm512_setzero_ps();
    }
  };
  for (int64_t k = k0; k < k1; k += 2) {
    __m512 even[2], odd[2];
    weights(k, even);
    weights(k + 1, odd);
    uint16_t* o = out + (k / 32) * 512 + (k / 2 % 16) * 32;
    for (int g = 0; g < 2; ++g) {
      const __m512 e = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(even[g]), top));
      const __m512 d = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(odd[g]), top));
      _mm512_store_si512(o + g * (Ka * 16), llm::amx::pair_bf16(e, d));
      _mm512_store_si512(o + g * (Ka * 16) + per_piece,
                         llm::amx::pair_bf16(_mm512_sub_ps(even[g], e), _mm512_sub_ps(odd[g], d)));
    }
  }
}

// kLevelBits: the bits of a level q, for layouts with offsets read as LevelPieces (0: not).
template <class F, int kLevelBits = 0>
Layout level_layout(int64_t K, bool offset) {
  static_assert(F::kGroup == llm::amx::KT, "levels for tiles come in blocks of 32 inputs");
  Layout l = layout<F>(K, offset);
  l.expand = expand_levels<F>;
  l.scales_at = F{K}.scales_at();
  if constexpr (kLevelBits > 0) {
    l.pieces = expand_pieces<F>;
    l.level_bits = kLevelBits;
  }
  return l;
}

// Whether every d q and m of P panels of blocks in layout l is two bfloat16 pieces exactly (16
// significant bits at most): each d of at most 16 - level_bits (its low 8 + level_bits bits zero),
// each m of at most 16 (low 8 zero). A scan of the scales alone, a thirty-second of the weights:
// microseconds, against the milliseconds of a call of more than kLevelRows rows.
bool two_pieces(const uint8_t* blocks, int64_t P, const Layout& l, int64_t K) {
  const int64_t per_scale = K / l.group * NR;  // floats of d (and again of m) a panel
  const __m512i d_low = _mm512_set1_epi32((1 << (8 + l.level_bits)) - 1);
  const __m512i m_low = _mm512_set1_epi32((1 << 8) - 1);
  __mmask16 bad = 0;
  for (int64_t p = 0; p < P; ++p) {
    const auto* d = reinterpret_cast<const int32_t*>(blocks + p * l.bytes + l.scales_at);
    for (int64_t i = 0; i < per_scale; i += 16) {
      bad |= _mm512_test_epi32_mask(_mm512_loadu_si512(d + i), d_low);
      bad |= _mm512_test_epi32_mask(_mm512_loadu_si512(d + per_scale + i), m_low);
    }
  }
  return bad == 0;
}
#else
template <class F, int = 0>
Layout level_layout(int64_t K, bool offset) {
  return layout<F>(K, offset);
}
#endif

Layout layout_of(const std::string& kind, int64_t K) {
  if (kind == "q4") return level_layout<Q41, 4>(K, true);
  if (kind == "q8") return level_layout<Q80>(K, false);
  if (kind == "u8g32") return level_layout<U8M<32>, 5>(K, true);
  if (kind == "u8g16") return layout<U8M<16>>(K, true);
  if (kind == "bf16") return layout<BF16>(K, false);
  if (kind == "f16") return layout<F16>(K, false);
  TORCH_CHECK(false, "unknown block layout '", kind, "'");
}

// Whether steps of kBlockRows + 1 to kLevelRows rows of a weight of block layout `kind` ("":
// float32 alone) compute from its levels on AMX tiles here (for the load log).
bool amx_levels_for(const std::string& kind) {
  return !kind.empty() && layout_of(kind, 256).expand != nullptr && linear_amx() &&
         amx_levels.load(std::memory_order_relaxed);
}

// The blocks of `kind` ("q4", "q8", "u8g32", "u8g16"): q [N, K] uint8 (int8 for "q8"), d and, with
// an offset, m float32 [N, K / group] (models/weight_blocks.py); an empty tensor where they do not
// give back the weight.
at::Tensor pack_blocks(const at::Tensor& weight_in, const at::Tensor& q_in, const at::Tensor& d_in,
                       const std::optional<at::Tensor>& m_in, const std::string& kind) {
  TORCH_CHECK(kind == "q4" || kind == "q8" || kind == "u8g32" || kind == "u8g16",
              "pack_blocks: kind q4, q8, u8g32 or u8g16, not '", kind, "'");
  TORCH_CHECK(weight_in.device().is_cpu() && weight_in.scalar_type() == at::kFloat &&
                  weight_in.dim() == 2,
              "pack_blocks: a float32 CPU weight [N, K]");
  const int64_t N = weight_in.size(0), K = weight_in.size(1);
  const Layout l = layout_of(kind, K);
  TORCH_CHECK(K % l.group == 0, "pack_blocks: K a multiple of ", l.group);
  TORCH_CHECK(q_in.scalar_type() == (kind == "q8" ? at::kChar : at::kByte) &&
                  q_in.sizes() == weight_in.sizes(),
              "pack_blocks: q ", kind == "q8" ? "int8" : "uint8", " [", N, ", ", K, "]");
  TORCH_CHECK(m_in.has_value() == l.offset, "pack_blocks: ", kind, l.offset ? " needs" : " has no",
              " m");
  std::vector<const at::Tensor*> scales = {&d_in};
  if (l.offset) scales.push_back(&*m_in);
  for (const at::Tensor* t : scales)
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == K / l.group,
                "pack_blocks: d and m float32 [", N, ", ", K / l.group, "]");
  const at::Tensor weight = weight_in.contiguous(), q = q_in.contiguous(), d = d_in.contiguous();
  const at::Tensor m = l.offset ? m_in->contiguous() : at::Tensor();
  const at::Tensor* mp = l.offset ? &m : nullptr;
  if (kind == "q4") return pack_format<Q41>(weight, q, d, mp);
  if (kind == "q8") return pack_format<Q80>(weight, q, d, mp);
  if (kind == "u8g32") return pack_format<U8M<32>>(weight, q, d, mp);
  return pack_format<U8M<16>>(weight, q, d, mp);
}

// out [T, n] = compute(t0, p0, p1, dst, ld) over chunks of panels [p0, p1) of one block of rows
// [t0, t0 + block_rows), on this thread and the idle helper; `keep` stays alive until they end.
void run_panels(at::Tensor out, std::vector<at::Tensor> keep, int64_t P, int64_t row_blocks,
                int64_t block_rows, int64_t per, PanelsFn compute) {
  const int64_t T = out.size(0), n = out.size(1);
  const int64_t across = (P + per - 1) / per;  // chunks across one block of rows
  float* op = out.mutable_data_ptr<float>();
  llm::Job job;
  keep.push_back(out);
  job.keep = std::move(keep);
  job.chunks = row_blocks * across;
  job.heavy = T > kLevelRows;  // a prompt's: the helper takes a share of a busy core for it
  constexpr int64_t F = sizeof(float);
  auto span = [=](int64_t c) {  // chunk c: first row, panels [p0, p1)
    const int64_t p0 = c % across * per;
    return std::array<int64_t, 3>{c / across * block_rows, p0, std::min(P, p0 + per)};
  };
  job.place = [=](int64_t c) {
    const auto [t0, p0, p1] = span(c);
    return llm::Block{reinterpret_cast<char*>(op + t0 * n + p0 * NR), n * F,
                      std::min(block_rows, T - t0), (std::min(n, p1 * NR) - p0 * NR) * F};
  };
  job.compute = [compute = std::move(compute), span](int64_t c, char* dst, int64_t ld) {
    const auto [t0, p0, p1] = span(c);
    compute(t0, p0, p1, reinterpret_cast<float*>(dst), ld / F);
  };
  llm::run(std::move(job));
}

void check_x(const char* op, const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, op, ": x float32 [T, K]");
}

}  // namespace

namespace llm {

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t n,
                  const std::optional<at::Tensor>& blocks, const std::string& kind) {
  check_x("linear", x_in, packed);
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 3 && packed.is_contiguous(),
              "linear: a weight from pack_linear_weight");
  TORCH_CHECK(packed.size(2) == NR, "linear: weight packed for panels of ", packed.size(2),
              " features, this build computes ", NR);
  const int64_t T = x_in.size(0), K = x_in.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "linear: x has ", K, " features, the weight ", packed.size(1));
  TORCH_CHECK(n > (P - 1) * NR && n <= P * NR, "linear: ", n, " output features for ", P, " panels");
  at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({T, n}, x.options());
  if (T == 0) return out;
  const float* xp = x.const_data_ptr<float>();
  const float* wp = packed.const_data_ptr<float>();
  std::vector<at::Tensor> keep = {x, packed};
  // Chunks cover panels [p0, p1) of rows [t0, t0 + block_rows).
  int64_t block_rows = tile_block_rows(T, K);
  int64_t row_blocks = (T + block_rows - 1) / block_rows;
  PanelsFn compute = [=](int64_t t0, int64_t p0, int64_t p1, float* dst, int64_t ld) {
    panels(xp + t0 * K, std::min(block_rows, T - t0), K, wp, n, p0, p1, dst, ld);
  };
  double flops_per_s = 100e9;
  int64_t weight_bytes = sizeof(float);
  const bool has_blocks = blocks.has_value() && blocks->numel() > 0;
  Layout l;
  const uint8_t* bp = nullptr;
  if (has_blocks) {
    l = layout_of(kind, K);
    TORCH_CHECK(K % l.group == 0 && blocks->dim() == 2 && blocks->is_contiguous() &&
                    blocks->size(0) == P && blocks->size(1) * blocks->element_size() == l.bytes,
                "linear: blocks of layout ", kind, " from pack_blocks or pack_halves for this "
                "weight");
    bp = reinterpret_cast<const uint8_t*>(blocks->const_data_ptr());
    keep.push_back(*blocks);
  }
#ifdef LLM_AMX
  const bool on_levels = has_blocks && amx_levels.load(std::memory_order_relaxed) && linear_amx();
  const bool levels = on_levels && l.expand != nullptr && T > kBlockRows && T <= kLevelRows;
  const bool pieces = on_levels && l.pieces != nullptr && T > kLevelRows && two_pieces(bp, P, l, K);
#else
  const bool levels = false;
#endif
  if (has_blocks && !levels &&
      (T <= kBlockRows || T <= unpack_rows.load(std::memory_order_relaxed))) {
    weight_bytes = 2;  // a fifth to a half of the bytes, but widened: about half the time
    compute = [=, run = T <= kBlockRows ? l.run : l.unpacked](
                  int64_t t0, int64_t p0, int64_t p1, float* dst, int64_t ld) {
      run(xp + t0 * K, std::min(block_rows, T - t0), K, bp, n, p0, p1, dst, ld);
    };
  }
#ifdef LLM_AMX
  if (levels || (T >= kAmxRows && linear_amx())) {
    // LevelPieces: each row's block sums beside its inputs, [T, E]
    const int64_t E = pieces ? (K / kBlock + 31) / 32 * 32 : 0;
    at::Tensor beside = pieces ? at::zeros({T, E}, x.options()) : at::Tensor();
    if (pieces) llm::amx::block_sums(xp, T, K, beside.mutable_data_ptr<float>(), T, E);
    const RowBlocks rb =
        split_row_blocks(xp, T, K, pieces ? beside.const_data_ptr<float>() : nullptr, E);
    keep.push_back(rb.pieces);
    row_blocks = rb.blocks;
    block_rows = rb.block_rows;
    const int64_t Kp = rb.Kp;
    if (pieces) {
      flops_per_s = 6 * 150e9 * 6 / 5;  // five bfloat16 products for each float32 one
      compute = amx_panels(
          rb, T, P, n, 2 * 2 * Kp * 16,
          [=](int64_t p, uint16_t* out) {
            return LevelPieces{l.pieces, bp + p * l.bytes, K, Kp, out};
          },
          [=](const uint16_t* ra, int64_t, int64_t rows, int64_t Tp, int64_t, const uint16_t* b,
              float* dst, int64_t ld, int64_t cols, const LevelPieces& next) {
            llm::amx::panel_product<llm::amx::kPieces, 2>(ra, rows, Tp, Kp, b, dst, ld, cols,
                                                           next);
          });
    } else if (levels) {
      at::Tensor sums = at::empty({row_blocks * block_rows, Kp / llm::amx::KT}, x.options());
      llm::amx::block_sums(xp, T, K, sums.mutable_data_ptr<float>(), row_blocks * block_rows,
                           Kp / llm::amx::KT);
      keep.push_back(sums);
      const float* sp = sums.const_data_ptr<float>();
      flops_per_s = 200e9;  // three bfloat16 products a float32 one, and each block's scaling
      weight_bytes = 1;
      compute = amx_panels(
          rb, T, P, n, 2 * Kp * 16,
          [=](int64_t p, uint16_t* out) { return LevelSplit{l.expand, bp + p * l.bytes, K, out}; },
          [=](const uint16_t* ra, int64_t t0, int64_t rows, int64_t Tp, int64_t p,
              const uint16_t* b, float* dst, int64_t ld, int64_t cols, const LevelSplit& next) {
            const auto* d = reinterpret_cast<const float*>(bp + p * l.bytes + l.scales_at);
            llm::amx::level_product(ra, rows, Tp, Kp, b, d, l.offset ? d + K / l.group * NR : nullptr,
                                    sp + t0 * (Kp / llm::amx::KT), dst, ld, cols, next);
          });
    } else {
      flops_per_s = 6 * 150e9;  // six bfloat16 products for each float32 one
      compute = amx_panels(
          rb, T, P, n, llm::amx::kPieces * 2 * Kp * 16,
          [=](int64_t p, uint16_t* out) { return llm::amx::PanelSplit{wp + p * K * NR, K, Kp, out}; },
          [=](const uint16_t* ra, int64_t, int64_t rows, int64_t Tp, int64_t, const uint16_t* b,
              float* dst, int64_t ld, int64_t cols, const llm::amx::PanelSplit& next) {
            llm::amx::panel_product(ra, rows, Tp, Kp, b, dst, ld, cols, next);
          });
    }
  }
#endif
  run_panels(out, std::move(keep), P, row_blocks, block_rows,
             panels_per_chunk(block_rows, K, weight_bytes, flops_per_s), std::move(compute));
  return out;
}

}  // namespace llm

namespace {

#ifdef __AVX512VNNI__
// The screen on vpdpbusd (AVX-512 VNNI: Intel from Cascade Lake, AMD Zen 4 and 5): each
// instruction adds four products of unsigned and signed bytes to 16 int32 sums, four times the
// multiply-adds of a float32 FMA, from weights of a quarter of the bytes. greedy_head quantizes
// by groups of kGroup inputs, each with its own scale: each token's weight row to int8 (scales
// sw), each row of x to u = q + 128 with q in [-127, 127] (scales sx). A group's integer sum is
// exact; the kernel starts it at -128 times the group's weight sum (the offset's share), converts
// it to float32 and adds it times sw sx: within greedy_head's bound.
// Packed per panel of NR tokens: [Kp / 4][NR][4] int8 weights (k zero-padded to Kp, a multiple of
// kGroup), [Kp / kGroup][NR] int32 of -128 x each group's weight sum, [Kp / kGroup][NR] float32
// sw.
constexpr int64_t kGroup = 64;  // inputs per scale: 16 vpdpbusd a sum

struct Int8Panel {
  int64_t K4, groups;  // 4-byte steps of k, groups of kGroup inputs
  // Byte offsets in a panel: the weights at 0, then the offsets, then the scales.
  int64_t offsets_at() const { return K4 * NR * 4; }
  int64_t scales_at() const { return offsets_at() + groups * NR * 4; }
  int64_t bytes() const { return scales_at() + groups * NR * 4; }
  const int8_t* weights(const uint8_t* p) const { return reinterpret_cast<const int8_t*>(p); }
  const int32_t* offsets(const uint8_t* p) const {
    return reinterpret_cast<const int32_t*>(p + offsets_at());
  }
  const float* scales(const uint8_t* p) const {
    return reinterpret_cast<const float*>(p + scales_at());
  }
  // The same places in a panel being packed.
  int32_t* offsets(uint8_t* p) const { return reinterpret_cast<int32_t*>(p + offsets_at()); }
  float* scales(uint8_t* p) const { return reinterpret_cast<float*>(p + scales_at()); }
};

// dst[r, 0:cols] = the estimate for R rows; xq [R][K4] of 4 unsigned bytes, xs [R][groups].
template <int64_t R>
inline void int8_tile(const uint32_t* xq, const float* xs, const Int8Panel& shape,
                      const uint8_t* panel, float* dst, int64_t ld, int64_t cols) {
  const int64_t K4 = shape.K4, G = shape.groups;
  const int8_t* w = shape.weights(panel);
  const int32_t* off = shape.offsets(panel);
  const float* sw = shape.scales(panel);
  __m512 acc[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const __m512i o0 = _mm512_loadu_si512(off + g * NR), o1 = _mm512_loadu_si512(off + g * NR + 16);
    __m512i sum[R][2];
    for (int64_t r = 0; r < R; ++r) sum[r][0] = o0, sum[r][1] = o1;
    for (int64_t i = g * (kGroup / 4); i < (g + 1) * (kGroup / 4); ++i) {
      const int8_t* wi = w + i * NR * 4;
      __builtin_prefetch(wi + kAhead * NR * 4);
      __builtin_prefetch(wi + kAhead * NR * 4 + 64);
      const __m512i w0 = _mm512_loadu_si512(wi), w1 = _mm512_loadu_si512(wi + 64);
      for (int64_t r = 0; r < R; ++r) {
        const __m512i xr = _mm512_set1_epi32(static_cast<int>(xq[r * K4 + i]));
        sum[r][0] = _mm512_dpbusd_epi32(sum[r][0], xr, w0);
        sum[r][1] = _mm512_dpbusd_epi32(sum[r][1], xr, w1);
      }
    }
    const __m512 s0 = _mm512_loadu_ps(sw + g * NR), s1 = _mm512_loadu_ps(sw + g * NR + 16);
    for (int64_t r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(xs[r * G + g]);
      acc[r][0] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum[r][0]), s0), s, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum[r][1]), s1), s, acc[r][1]);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    float row[NR];
    _mm512_storeu_ps(row, acc[r][0]);
    _mm512_storeu_ps(row + 16, acc[r][1]);
    std::memcpy(dst + r * ld, row, cols * sizeof(float));
  }
}

constexpr int64_t kInt8Rows = 6;  // 4 R accumulators + 2 weight vectors in 32 registers

template <int64_t... Rs>
inline void int8_tile_rows(int64_t rows, const uint32_t* xq, const float* xs,
                           const Int8Panel& shape, const uint8_t* panel, float* dst, int64_t ld,
                           int64_t cols, std::integer_sequence<int64_t, Rs...>) {
  ((rows == Rs + 1 ? int8_tile<Rs + 1>(xq, xs, shape, panel, dst, ld, cols) : void()), ...);
}

// The packed screen weight from q [V, Kp] int8 (values in [-127, 127], Kp a multiple of kGroup)
// and its scales sw [V, Kp / kGroup] float32 (greedy_head.quantize_groups).
at::Tensor pack_int8_screen(const at::Tensor& q_in, const at::Tensor& scale_in) {
  TORCH_CHECK(q_in.device().is_cpu() && q_in.scalar_type() == at::kChar && q_in.dim() == 2 &&
                  q_in.size(1) % kGroup == 0,
              "pack_int8_screen: q int8 CPU [V, Kp], Kp a multiple of ", kGroup);
  const int64_t V = q_in.size(0), K = q_in.size(1), P = (V + NR - 1) / NR;
  const Int8Panel shape{K / 4, K / kGroup};
  TORCH_CHECK(scale_in.scalar_type() == at::kFloat && scale_in.dim() == 2 &&
                  scale_in.size(0) == V && scale_in.size(1) == shape.groups,
              "pack_int8_screen: scales float32 [V, ", shape.groups, "]");
  const at::Tensor q = q_in.contiguous(), scale = scale_in.contiguous();
  at::Tensor out = at::zeros({P, shape.bytes()}, at::TensorOptions().dtype(at::kByte));
  const int8_t* qp = q.const_data_ptr<int8_t>();
  const float* sp = scale.const_data_ptr<float>();
  for (int64_t p = 0; p < P; ++p) {
    uint8_t* panel = out.mutable_data_ptr<uint8_t>() + p * shape.bytes();
    auto* w = reinterpret_cast<int8_t*>(panel);
    int32_t* off = shape.offsets(panel);
    float* sw = shape.scales(panel);
    for (int64_t j = 0; j < NR && p * NR + j < V; ++j) {
      const int8_t* row = qp + (p * NR + j) * K;
      for (int64_t k = 0; k < K; ++k) {
        w[(k / 4 * NR + j) * 4 + k % 4] = row[k];
        off[k / kGroup * NR + j] -= 128 * row[k];
      }
      for (int64_t g = 0; g < shape.groups; ++g) sw[g * NR + j] = sp[(p * NR + j) * shape.groups + g];
    }
  }
  return out;
}

// The estimate [T, n] from xq [T, Kp] uint8 (q + 128) and xs [T, Kp / kGroup] float32.
at::Tensor int8_screen(const at::Tensor& xq_in, const at::Tensor& xs_in, const at::Tensor& packed,
                       int64_t n) {
  TORCH_CHECK(xq_in.device().is_cpu() && xq_in.scalar_type() == at::kByte && xq_in.dim() == 2 &&
                  xq_in.size(1) % kGroup == 0,
              "int8_screen: xq uint8 CPU [T, Kp], Kp a multiple of ", kGroup);
  const int64_t T = xq_in.size(0), Kp = xq_in.size(1);
  const Int8Panel shape{Kp / 4, Kp / kGroup};
  TORCH_CHECK(xs_in.scalar_type() == at::kFloat && xs_in.dim() == 2 && xs_in.size(0) == T &&
                  xs_in.size(1) == shape.groups,
              "int8_screen: xs float32 [T, ", shape.groups, "]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous() &&
                  packed.size(1) == shape.bytes(),
              "int8_screen: a weight from pack_int8_screen for ", Kp, " padded input features");
  const int64_t P = packed.size(0);
  TORCH_CHECK(n > (P - 1) * NR && n <= P * NR, "int8_screen: ", n, " outputs for ", P, " panels");
  const at::Tensor xq = xq_in.contiguous(), xs = xs_in.contiguous();
  at::Tensor out = at::empty({T, n}, xs.options());
  if (T == 0) return out;
  const auto* xp = reinterpret_cast<const uint32_t*>(xq.const_data_ptr<uint8_t>());
  const float* sp = xs.const_data_ptr<float>();
  const uint8_t* wp = packed.const_data_ptr<uint8_t>();
  PanelsFn compute = [=](int64_t, int64_t p0, int64_t p1, float* dst, int64_t ld) {
    for (int64_t t = 0; t < T; t += kInt8Rows) {
      const int64_t rows = std::min(kInt8Rows, T - t);
      for (int64_t p = p0; p < p1; ++p)
        int8_tile_rows(rows, xp + t * shape.K4, sp + t * shape.groups, shape,
                       wp + p * shape.bytes(), dst + t * ld + (p - p0) * NR, ld,
                       std::min(NR, n - p * NR), std::make_integer_sequence<int64_t, kInt8Rows>{});
    }
  };
  run_panels(out, {xq, xs, packed}, P, 1, T,
             panels_per_chunk(T, Kp, 1, 300e9),  // a quarter of the bytes, ~3x float32's rate
             std::move(compute));
  return out;
}
#endif

// The screening estimate x0 . w0 of x W^T from the first bfloat16 pieces (amx.h's split: the
// top 8 significant bits, truncated) of x and W alone, one tile product per output tile instead
// of six, from the weight's first pieces packed once (pack_screen_weight: half the float32
// weight's bytes). The caller (python_backends/models/greedy_head.py) passes x and W already
// rounded to bfloat16, which are their own first pieces, so these are exactly its x0 and w0;
// exact products summed in float32, and it bounds |x W^T - x0 . w0| from the norms. AMX only.
at::Tensor pack_screen_weight(const at::Tensor& weight) {
  TORCH_CHECK(linear_amx(), "pack_screen_weight: this CPU (or build) has no AMX tiles");
#ifdef LLM_AMX
  const at::Tensor packed = pack_linear_weight(weight);  // [P, K, NR]
  const int64_t P = packed.size(0), K = packed.size(1), Kp = (K + 31) / 32 * 32;
  const int64_t per_piece = 2 * Kp * 16;  // uint16: PanelSplit's first piece of one panel
  at::Tensor out = at::empty({P, per_piece}, at::TensorOptions().dtype(at::kShort));
  SplitPanels scratch;
  scratch.reserve(llm::amx::kPieces * per_piece);
  const float* wp = packed.const_data_ptr<float>();
  for (int64_t p = 0; p < P; ++p) {
    llm::amx::PanelSplit{wp + p * K * NR, K, Kp, scratch.b[0]}.all();
    std::memcpy(out.mutable_data_ptr<int16_t>() + p * per_piece, scratch.b[0],
                per_piece * sizeof(uint16_t));
  }
  return out;
#else
  return weight;
#endif
}

at::Tensor screen_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t n) {
  check_x("screen_linear", x_in, packed);
  TORCH_CHECK(linear_amx(), "screen_linear: this CPU (or build) has no AMX tiles");
  const int64_t T = x_in.size(0), K = x_in.size(1), Kp = (K + 31) / 32 * 32, P = packed.size(0);
  TORCH_CHECK(packed.scalar_type() == at::kShort && packed.dim() == 2 && packed.is_contiguous() &&
                  packed.size(1) == 2 * Kp * 16,
              "screen_linear: a weight from pack_screen_weight for ", K, " input features");
  TORCH_CHECK(n > (P - 1) * NR && n <= P * NR, "screen_linear: ", n, " outputs for ", P, " panels");
  at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({T, n}, x.options());
  if (T == 0) return out;
#ifdef LLM_AMX
  const RowBlocks rb = split_row_blocks(x.const_data_ptr<float>(), T, K);
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.const_data_ptr<int16_t>());
  const int64_t B = rb.block_rows, per_piece = packed.size(1);
  PanelsFn compute = [=](int64_t t0, int64_t p0, int64_t p1, float* dst, int64_t ld) {
    llm::amx::configure();
    const int64_t rows = std::min(B, T - t0), Tp = (rows + 15) / 16 * 16;
    for (int64_t p = p0; p < p1; ++p)
      llm::amx::panel_product<1>(rb.a + t0 * rb.piece_row, rows, Tp, Kp, wp + p * per_piece,
                                 dst + (p - p0) * NR, ld, std::min(NR, n - p * NR), {});
  };
  run_panels(out, {x, packed, rb.pieces}, P, rb.blocks, B,
             panels_per_chunk(B, K, sizeof(uint16_t), 36 * 150e9),  // one product, not six
             std::move(compute));
#endif
  return out;
}

// The screen's candidates: (row, column) of every estimate e[r, c] within the bounds of the
// largest, e[r, c] + E[r, c] >= max over u of (e[r, u] - E[r, u]) with E[r, c] = a[r] w[c] +
// b[r] dw[c] (the error bound of e[r, c]: python_backends/models/greedy_head.py), rows ascending
// and columns ascending within a row. Two vectorized passes over each row; torch's max, ge and
// nonzero, one pass each, took longer than the screen itself for 32 rows of 49152.
std::tuple<at::Tensor, at::Tensor> screen_candidates(const at::Tensor& estimate_in,
                                                     const at::Tensor& a_in, const at::Tensor& b_in,
                                                     const at::Tensor& w_in, const at::Tensor& dw_in) {
  auto f32 = [](const at::Tensor& t, int64_t dim) {
    return t.scalar_type() == at::kFloat && t.dim() == dim && t.device().is_cpu();
  };
  TORCH_CHECK(f32(estimate_in, 2) && f32(a_in, 1) && f32(b_in, 1) && f32(w_in, 1) && f32(dw_in, 1),
              "screen_candidates: float32 estimate [N, V], a and b [N], w and dw [V]");
  const int64_t N = estimate_in.size(0), V = estimate_in.size(1);
  TORCH_CHECK(a_in.size(0) == N && b_in.size(0) == N && w_in.size(0) == V && dw_in.size(0) == V,
              "screen_candidates: estimate [", N, ", ", V, "] needs a, b [", N, "], w, dw [", V,
              "]");
  const at::Tensor estimate = estimate_in.contiguous(), at = a_in.contiguous(),
                   bt = b_in.contiguous(), wt = w_in.contiguous(), dwt = dw_in.contiguous();
  const float *w = wt.const_data_ptr<float>(), *dw = dwt.const_data_ptr<float>();
  std::vector<int64_t> rows, cols;
  const int64_t body = V / VL * VL;
  for (int64_t r = 0; r < N; ++r) {
    const float* e = estimate.const_data_ptr<float>() + r * V;
    const float ar = at.const_data_ptr<float>()[r], br = bt.const_data_ptr<float>()[r];
    const vec av = vec{} + ar, bv = vec{} + br;
    vec low = vec{} - std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < body; c += VL) {
      const vec v = load(e + c) - (av * load(w + c) + bv * load(dw + c));
      low = v > low ? v : low;
    }
    float floor = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < VL; ++i) floor = std::max(floor, low[i]);
    for (int64_t c = body; c < V; ++c) floor = std::max(floor, e[c] - (ar * w[c] + br * dw[c]));
    const vec floors = vec{} + floor;
    for (int64_t c = 0; c < V; c += VL) {
      if (c < body) {  // skip whole vectors below the floor
        const ivec above = load(e + c) + (av * load(w + c) + bv * load(dw + c)) >= floors;
        bool any = false;
        for (int64_t i = 0; i < VL; ++i) any |= above[i] != 0;
        if (!any) continue;
      }
      for (int64_t i = c; i < std::min(V, c + VL); ++i) {
        if (e[i] + (ar * w[i] + br * dw[i]) >= floor) {
          rows.push_back(r);
          cols.push_back(i);
        }
      }
    }
  }
  const auto opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor row_t = at::empty({static_cast<int64_t>(rows.size())}, opts);
  at::Tensor col_t = at::empty({static_cast<int64_t>(cols.size())}, opts);
  std::copy(rows.begin(), rows.end(), row_t.mutable_data_ptr<int64_t>());
  std::copy(cols.begin(), cols.end(), col_t.mutable_data_ptr<int64_t>());
  return {row_t, col_t};
}

// Each row's token among its candidates (rows ascending, columns ascending within a row, as
// screen_candidates lists them) with the largest float32 logit x[r] . w[c], the first of equal
// largest ones, as max picks; n for a row without candidates. Vector sums added as a tree.
at::Tensor candidate_argmax(const at::Tensor& x_in, const at::Tensor& w_in, const at::Tensor& rows_in,
                            const at::Tensor& cols_in) {
  TORCH_CHECK(x_in.device().is_cpu() && w_in.device().is_cpu() && x_in.scalar_type() == at::kFloat &&
                  w_in.scalar_type() == at::kFloat && x_in.dim() == 2 && w_in.dim() == 2 &&
                  x_in.size(1) == w_in.size(1),
              "candidate_argmax: float32 CPU x [N, K] and weight [V, K]");
  TORCH_CHECK(rows_in.scalar_type() == at::kLong && cols_in.scalar_type() == at::kLong &&
                  rows_in.dim() == 1 && rows_in.sizes() == cols_in.sizes(),
              "candidate_argmax: int64 rows and cols [M]");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous(), rt = rows_in.contiguous(),
                   ct = cols_in.contiguous();
  const int64_t N = x.size(0), K = x.size(1), V = w.size(0), M = rt.size(0);
  const float *xp = x.const_data_ptr<float>(), *wp = w.const_data_ptr<float>();
  const int64_t *rows = rt.const_data_ptr<int64_t>(), *cols = ct.const_data_ptr<int64_t>();
  at::Tensor out = at::full({N}, V, at::TensorOptions().dtype(at::kLong));
  int64_t* tok = out.mutable_data_ptr<int64_t>();
  std::vector<float> best(N, -std::numeric_limits<float>::infinity());
  for (int64_t m = 0; m < M; ++m) {
    const int64_t r = rows[m], c = cols[m];
    TORCH_CHECK(r >= 0 && r < N && c >= 0 && c < V, "candidate_argmax: (", r, ", ", c,
                ") outside [", N, ", ", V, "]");
    const float v = llm::dot(xp + r * K, wp + c * K, K);
    if (v > best[r] || tok[r] == V) {
      best[r] = v;
      tok[r] = c;
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) {
  m.def("linear_amx() -> bool", &linear_amx);
  m.def("fma_peak(int iterations) -> float", &fma_peak);
  m.def("set_unpack_rows(int rows) -> int", &set_unpack_rows);
  m.def("set_amx_levels(bool enabled) -> bool", &set_amx_levels);
  m.def("amx_levels_for(str kind) -> bool", &amx_levels_for);
  m.def("screen_paths() -> str[]", &screen_paths);
  m.def("pack_linear_weight(Tensor weight) -> Tensor", &pack_linear_weight);
  m.def("pack_blocks(Tensor weight, Tensor q, Tensor d, Tensor? m, str kind) -> Tensor",
        &pack_blocks);
  m.def("pack_halves(Tensor weight) -> Tensor", &pack_halves);
  m.def("linear(Tensor x, Tensor packed, int out_features, Tensor? blocks=None, str kind=\"\") "
        "-> Tensor", &llm::linear);
  m.def("pack_screen_weight(Tensor weight) -> Tensor", &pack_screen_weight);
  m.def("screen_linear(Tensor x, Tensor packed, int out_features) -> Tensor", &screen_linear);
#ifdef __AVX512VNNI__
  m.def("pack_int8_screen(Tensor q, Tensor scale) -> Tensor", &pack_int8_screen);
  m.def("int8_screen(Tensor xq, Tensor xs, Tensor packed, int out_features) -> Tensor",
        &int8_screen);
#endif
  m.def("candidate_argmax(Tensor x, Tensor weight, Tensor rows, Tensor cols) -> Tensor",
        &candidate_argmax);
  m.def("screen_candidates(Tensor estimate, Tensor a, Tensor b, Tensor w, Tensor dw) -> "
        "(Tensor, Tensor)",
        &screen_candidates);
}
