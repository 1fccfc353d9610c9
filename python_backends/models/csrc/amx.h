// float32 matrix products on AMX tiles, to float32 precision (CPUs with AMX-BF16: Intel Xeon
// from Sapphire Rapids on).
//
// AMX multiplies bfloat16 (8 significant bits) into float32 sums at several times the float32
// FMA rate of AVX-512 (docs/platform.md has the figures). A float32 value splits
// into three bfloat16 pieces, a = a0 + a1 + a2 (each the top 8 significant bits of what the ones
// before left: 24 bits, all of a float32's), so
//   a * b = a0 b0 + (a0 b1 + a1 b0) + (a0 b2 + a1 b1 + a2 b0) + [a1 b2 + a2 b1 + a2 b2]
// where the bracket is below 2^-23 of |a b|: float32's own rounding. Six bfloat16 products per
// float32 product, each exact in float32, summed in float32 by the tiles: the same precision as
// the AVX-512 kernel (tests/models/test_linear.py holds both to float64 references).
// Below 48 tokens (linear.cpp's kAmxRows) calls of float32 weights stay on the AVX-512 kernel:
// they are bound by reading the weights, which the split does not shorten, and splitting them
// costs as much as the products. Weights that are GGUF blocks compute from their integer levels
// instead from 13 to 128 tokens (level_product below): three products, not six, and no split;
// past 128, those whose d q and m are two bfloat16 pieces exactly take five (panel_product's
// WPieces).
//
// The weights stay float32 (linear.cpp's panels). A thread splits the panel after the one it
// computes between that one's tile products (the vector units split while the tiles multiply),
// into an L2 scratch every row tile passes over; the rows come in blocks whose pieces stay in L2
// (linear.cpp). What makes it fast: operand tiles 64-byte aligned and contiguous (a tile whose
// rows straddle cache lines loads at half speed), each operand's next load placed after the last
// product that reads it, the split overlapped, and row blocks that keep the pieces in L2
// (docs/benchmarks.md has the kernel's history and its share of the tiles' peak).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define LLM_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace llm::amx {

constexpr int64_t KT = 32;  // k per tile row: 16 pairs of bfloat16 (64 bytes)
constexpr int64_t RT = 16;  // rows per tile
constexpr int kPieces = 3;
// The six products kept pair x piece pa with w piece pb where pa + pb < 3.

// Scratch a thread keeps from call to call, 64-byte aligned: a tile load whose rows straddle
// cache lines runs at half speed.
struct alignas(64) Line {
  uint16_t v[32];
};

// At least `count` T at the start of `lines`, grown as needed (a growth moves them: pointers
// taken before it are stale).
template <class T>
T* scratch(std::vector<Line>& lines, int64_t count) {
  const int64_t need = (count * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  if (static_cast<int64_t>(lines.size()) < need) lines.resize(need);
  return reinterpret_cast<T*>(lines.data());
}

// Linux gives a process AMX state only on request (arch_prctl, once per process; a fork
// inherits it). False where refused (an old kernel, or a signal stack too small for the state).
inline bool available() {
  static const bool ok = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Every tile 16 rows of 64 bytes, loaded at the start of every chunk of work. Not once per
// thread: other libraries' AMX kernels in the same thread (oneDNN's, under torch's bfloat16
// matmul) end with TILERELEASE, which returns the tiles to their initial state, where the next
// tile load faults (SIGILL). Loading the configuration costs tens of cycles; a chunk, microseconds.
inline void configure() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = RT;
  }
  _tile_loadconfig(&config);
}

// The pieces of 16 floats, each with its low 16 bits zero (a bfloat16 in the high half).
inline void split(__m512 v, __m512 (&piece)[kPieces]) {
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int p = 0; p < kPieces; ++p) {
    piece[p] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), top));
    v = _mm512_sub_ps(v, piece[p]);  // exact: the bits below those just taken
  }
}

// The pairs (even[c], odd[c]) of bfloat16 per column c, 32 bits each (the B operand's pair
// layout), from two vectors of floats whose low 16 bits are zero.
inline __m512i pair_bf16(__m512 even, __m512 odd) {
  const __m512i lo = _mm512_srli_epi32(_mm512_castps_si512(even), 16);
  const __m512i hi = _mm512_and_si512(_mm512_castps_si512(odd),
                                      _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm512_or_si512(lo, hi);
}

// x [T, K] row-major -> pieces [3][Tp / 16][Kp / 32][16 rows][32 k] bfloat16, rows padded to Tp
// (a multiple of 16) and k to Kp (a multiple of 32) with zeros: the A operands of every tile
// product, each tile's kilobyte contiguous (tile loads striding across rows ran ~10% slower).
// Into columns of wider pieces, where `stride` (a multiple of 32) is their Kp and out their
// column Kp's first.
inline void split_rows(const float* x, int64_t T, int64_t K, uint16_t* out, int64_t Tp,
                       int64_t Kp, int64_t stride = 0) {
  if (stride == 0) stride = Kp;
  const int64_t plane = Tp * stride;
  for (int64_t t = 0; t < Tp; ++t) {
    uint16_t* row = out + (t / RT) * (RT * stride) + (t % RT) * KT;
    for (int64_t k = 0; k < Kp; k += KT) {
      __m512 half[2][kPieces];
      for (int h = 0; h < 2; ++h) {
        const int64_t k0 = k + 16 * h;
        const int64_t valid = t < T ? std::clamp<int64_t>(K - k0, 0, 16) : 0;
        const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
        split(_mm512_maskz_loadu_ps(mask, x + t * K + std::min(k0, K)), half[h]);
      }
      for (int p = 0; p < kPieces; ++p) {
        const __m512bh both = _mm512_cvtne2ps_pbh(half[1][p], half[0][p]);  // exact
        _mm512_store_si512(row + p * plane + (k / KT) * (RT * KT),
                           reinterpret_cast<const __m512i&>(both));
      }
    }
  }
}

// One panel of the packed weight ([K, 32] float32: 32 output features) -> pieces in the
// layout AMX's B operand takes: [3][2 column tiles][Kp / 32][16 pairs of k][16 columns x 2].
// Split in steps (pairs of k [k0, k1), both even) so that the next panel's split can run
// between the current panel's tile products (see panel_product).
struct PanelSplit {
  const float* panel = nullptr;  // none: nothing to split
  int64_t K = 0, Kp = 0;
  uint16_t* out = nullptr;

  void rows(int64_t k0, int64_t k1) const {
    if (panel == nullptr) return;
    const int64_t per_piece = 2 * Kp * 16;  // uint16 per piece: 2 tiles of Kp x 16
    for (int64_t k = k0; k < k1; k += 2) {
      for (int g = 0; g < 2; ++g) {
        __m512 even[kPieces], odd[kPieces];
        split(k < K ? _mm512_loadu_ps(panel + k * 32 + 16 * g) : _mm512_setzero_ps(), even);
        split(k + 1 < K ? _mm512_loadu_ps(panel + (k + 1) * 32 + 16 * g) : _mm512_setzero_ps(),
              odd);
        // pair r = k / 2 % 16 of k-tile k / 32: (even, odd) bfloat16 per column, 32 bits each.
        uint16_t* row = out + g * (Kp * 16) + (k / KT) * (RT * 32) + (k / 2 % RT) * 32;
        for (int p = 0; p < kPieces; ++p) {
          _mm512_store_si512(row + p * per_piece, pair_bf16(even[p], odd[p]));
        }
      }
    }
  }
  void all() const { rows(0, Kp); }
};

// dst[0:T, 0:cols] = x . panel for one panel split by PanelSplit (b, 64-byte aligned) against
// the row pieces (a, from split_rows); dst's rows ld floats apart. `next` splits the following
// panel a slice at a time between the products: the tiles compute while the vector units split.
// Tiles: 4 accumulators (2 row tiles x 2 column tiles), 2 row operands, 2 column operands.
// Pieces 1: the first pieces' product alone, x0 . w0 (b holds w's first pieces only): a
// screening estimate within bounds the caller computes (linear.cpp's screen_linear).
// WPieces 2: weights that are two bfloat16 pieces exactly (b holds those two): the five products
// with w's third piece, zero, left out; the same sums as the six (linear.cpp's LevelPieces).
// Kb: the depth b was split at (PanelSplit's Kp), where the product reads only its first Kp.
template <int Pieces = kPieces, int WPieces = Pieces, class Next = PanelSplit>
inline void panel_product(const uint16_t* a, int64_t T, int64_t Tp, int64_t Kp,
                          const uint16_t* b, float* dst, int64_t ld, int64_t cols,
                          const Next& next, int64_t Kb = 0) {
  if (Kb == 0) Kb = Kp;
  const int64_t plane = Tp * Kp, per_piece = 2 * Kb * 16, kts = Kp / KT;
  const int64_t steps = (Tp + 2 * RT - 1) / (2 * RT) * kts;
  int64_t step = 0, split_to = 0;
  alignas(64) float edge[2 * RT][32];
  for (int64_t t = 0; t < Tp; t += 2 * RT) {
    const bool two = t + RT < Tp;  // a second row tile (Tp is a multiple of 16)
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t* at = a + (t / RT) * (RT * Kp);
    for (int64_t kt = 0; kt < kts; ++kt) {
      // Each x piece once, against the w pieces it pairs with: 18 tile loads for 24 products
      // (16 for 20 of two w pieces), each operand tile's next load placed after the products
      // that read it last.
      for (int pa = 0; pa < Pieces; ++pa) {
        const uint16_t* ap = at + pa * plane + kt * (RT * KT);
        for (int pb = 0; pa + pb < Pieces && pb < WPieces; ++pb) {
          const uint16_t* bp = b + pb * per_piece + kt * RT * 32;
          _tile_loadd(6, bp, 64);
          if (pb == 0) _tile_loadd(4, ap, 64);
          _tile_dpbf16ps(0, 4, 6);
          if (two) {
            if (pb == 0) _tile_loadd(5, ap + RT * Kp, 64);
            _tile_dpbf16ps(2, 5, 6);
          }
          _tile_loadd(7, bp + Kb * 16, 64);
          _tile_dpbf16ps(1, 4, 7);
          if (two) _tile_dpbf16ps(3, 5, 7);
        }
      }
      const int64_t upto = Kp * ++step / steps / 2 * 2;
      next.rows(split_to, upto);
      split_to = upto;
    }
    const int64_t rows = std::min<int64_t>(two ? 2 * RT : RT, T - t);
    if (rows == 2 * RT && cols == 32) {  // whole tiles straight into place
      _tile_stored(0, dst + t * ld, ld * 4);
      _tile_stored(1, dst + t * ld + 16, ld * 4);
      _tile_stored(2, dst + (t + RT) * ld, ld * 4);
      _tile_stored(3, dst + (t + RT) * ld + 16, ld * 4);
      continue;
    }
    _tile_stored(0, &edge[0][0], 32 * 4);
    _tile_stored(1, &edge[0][16], 32 * 4);
    if (two) {
      _tile_stored(2, &edge[RT][0], 32 * 4);
      _tile_stored(3, &edge[RT][16], 32 * 4);
    }
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(dst + (t + r) * ld, edge[r], cols * sizeof(float));
  }
  next.rows(split_to, Kp);
}

// Weights that are small integer levels q with a scale d (and offset m) per 32 inputs of a
// feature (GGUF blocks, linear.cpp's Q41, U8M<32>, Q80): over one block of 32 inputs
//   x . w = d (x . q) + m (sum of x),
// and q is exactly one bfloat16 (at most 8 significant bits), so x . q takes the three products of
// x's pieces alone, against six for float32 weights, and no weight is split. The tiles cannot
// apply d, which differs per block and feature: each block's products go to fresh accumulators,
// stored and scaled on the vector units into float32 sums (the offsets' part, sums of x times m,
// beside it). Every product is exact and every sum float32, as in panel_product; the order of
// the additions differs, so results differ from the float32 panels' in float32 rounding only.
//
// b: the panel's levels in one piece of PanelSplit's layout ([2 column tiles][Kp / 32][16 pairs
// of k][16 columns x 2]); d, m: [Kp / 32][32] float32 (m nullptr: no offsets); sums: [Tp][Kp /
// 32] float32, each row's sum of x over each block. `next` prepares the following panel's levels
// a slice at a time between the products, as in panel_product.
template <class Next>
inline void level_product(const uint16_t* a, int64_t T, int64_t Tp, int64_t Kp,
                          const uint16_t* b, const float* d, const float* m, const float* sums,
                          float* dst, int64_t ld, int64_t cols, const Next& next) {
  const int64_t plane = Tp * Kp, kts = Kp / KT;
  const int64_t steps = (Tp + 2 * RT - 1) / (2 * RT) * kts;
  int64_t step = 0, split_to = 0;
  alignas(64) float c[2 * RT][32];
  alignas(64) float acc[2 * RT][32];
  for (int64_t t = 0; t < Tp; t += 2 * RT) {
    const bool two = t + RT < Tp;
    const int64_t R = two ? 2 * RT : RT;
    for (int64_t r = 0; r < R; ++r) {
      _mm512_store_ps(acc[r], _mm512_setzero_ps());
      _mm512_store_ps(acc[r] + 16, _mm512_setzero_ps());
    }
    const uint16_t* at = a + (t / RT) * (RT * Kp);
    for (int64_t kt = 0; kt < kts; ++kt) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const uint16_t* bp = b + kt * RT * 32;
      _tile_loadd(6, bp, 64);
      _tile_loadd(7, bp + Kp * 16, 64);
      for (int pa = 0; pa < kPieces; ++pa) {
        const uint16_t* ap = at + pa * plane + kt * (RT * KT);
        _tile_loadd(4, ap, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
          _tile_loadd(5, ap + RT * Kp, 64);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, &c[0][0], 32 * 4);
      _tile_stored(1, &c[0][16], 32 * 4);
      if (two) {
        _tile_stored(2, &c[RT][0], 32 * 4);
        _tile_stored(3, &c[RT][16], 32 * 4);
      }
      const __m512 d0 = _mm512_loadu_ps(d + kt * 32), d1 = _mm512_loadu_ps(d + kt * 32 + 16);
      if (m != nullptr) {
        const __m512 m0 = _mm512_loadu_ps(m + kt * 32), m1 = _mm512_loadu_ps(m + kt * 32 + 16);
        for (int64_t r = 0; r < R; ++r) {
          const __m512 sum = _mm512_set1_ps(sums[(t + r) * kts + kt]);
          __m512 a0 = _mm512_fmadd_ps(_mm512_load_ps(c[r]), d0, _mm512_load_ps(acc[r]));
          __m512 a1 = _mm512_fmadd_ps(_mm512_load_ps(c[r] + 16), d1, _mm512_load_ps(acc[r] + 16));
          _mm512_store_ps(acc[r], _mm512_fmadd_ps(sum, m0, a0));
          _mm512_store_ps(acc[r] + 16, _mm512_fmadd_ps(sum, m1, a1));
        }
      } else {
        for (int64_t r = 0; r < R; ++r) {
          _mm512_store_ps(acc[r], _mm512_fmadd_ps(_mm512_load_ps(c[r]), d0, _mm512_load_ps(acc[r])));
          _mm512_store_ps(acc[r] + 16, _mm512_fmadd_ps(_mm512_load_ps(c[r] + 16), d1,
                                                       _mm512_load_ps(acc[r] + 16)));
        }
      }
      const int64_t upto = Kp * ++step / steps / 2 * 2;
      next.rows(split_to, upto);
      split_to = upto;
    }
    const int64_t rows = std::min<int64_t>(R, T - t);
    for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + (t + r) * ld, acc[r], cols * sizeof(float));
  }
  next.rows(split_to, Kp);
}

// Each row's sum over every block of 32 inputs: x [T, K] (K a multiple of 32) -> out [Tp][K / 32]
// (rows ld floats apart), rows from T to Tp zero.
inline void block_sums(const float* x, int64_t T, int64_t K, float* out, int64_t Tp, int64_t ld) {
  const int64_t kts = K / KT;
  for (int64_t t = 0; t < Tp; ++t) {
    for (int64_t kt = 0; kt < kts; ++kt) {
      out[t * ld + kt] = t < T ? _mm512_reduce_add_ps(_mm512_add_ps(
                                      _mm512_loadu_ps(x + t * K + kt * KT),
                                      _mm512_loadu_ps(x + t * K + kt * KT + 16)))
                                : 0.f;
    }
  }
}

}  // namespace llm::amx

#endif
