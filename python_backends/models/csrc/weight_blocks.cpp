// The search of models/weight_blocks.py: the GGUF blocks a float32 weight is made of, bit for bit,
// or nothing. Two kinds, each with a float32 scale d (and offset m) per kBlock inputs:
// - 4-bit (stored as the kernel's Q4_1: w = fl(fl(d q) + m), q in [0, 15]). gguf's Q4_1 (d, m
//   float16), Q4_0 (w = d (q - 8): m = -8 d) and Q4_K (32-input sub-blocks of a 256-input
//   super-block: d = fl16 d' x a 6-bit scale, m = -(fl16 dmin x a 6-bit min)) all dequantize to
//   that form: d and m of at most 17 significant bits, so d q (q of 4 bits) is exact in float32.
// - Q8_0 (w = fl(d q), q in [-128, 127], d float16).
// One pass over the weight, block by block. Q4_1 and Q8_0 first try the quick estimate: d the
// float16 nearest (max - m) / 15 with m the block's minimum (Q8_0: max |w| / 127), then its
// float16 neighbours nearest first. A 4-bit block that fails it goes to `fit_lattice`, which finds
// d from the gaps between the block's values and m from its smallest value's level. The first
// block that nothing fits ends the search: a float checkpoint is refused at its first block.
//
// What is kept is checked with fused multiply-adds, as the kernel computes fma(q, d, m); since d q
// is exact, that is gguf's fl(fl(d q) + m).
//
// Built and loaded by python_backends/models/kernels.py (for the machine it runs on).
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>

namespace {

constexpr int64_t kBlock = 32;
constexpr float kLevels = 15.f;  // Q4_1: q in [0, 15]
constexpr float kQ8Max = 127.f;  // Q8_0: llama.cpp's quantizer maps max |w| to it
constexpr int kSteps[] = {0, -1, 1, -2, 2};  // float16 neighbours of the estimate, nearest first
constexpr uint16_t kLargestHalf = 0x7BFF;

uint32_t bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

// `estimate` (finite, >= 0) rounded to float16 and moved `step` float16 values along, as float32.
float half_step(float estimate, int step) {
  const int moved = static_cast<int>(c10::Half(estimate).x) + step;
  return static_cast<float>(
      c10::Half(static_cast<uint16_t>(std::clamp(moved, 0, int{kLargestHalf})),
                c10::Half::from_bits()));
}

// Whether d (and `low` <= q <= `high`) gives back the block w[kBlock]: fma(q, d, m) for the 4-bit
// kind (`m` given), fl(d q) for Q8_0; q into `q` (as the int8 or uint8 it will be stored as).
bool fits(const float* w, float d, std::optional<float> m, float low, float high, int8_t* q) {
  const float scale = d > 0.f ? d : 1.f;
  const float base = m.value_or(0.f);
  for (int64_t i = 0; i < kBlock; ++i) {
    const float level =
        d > 0.f ? std::clamp(std::nearbyint((w[i] - base) / scale), low, high) : 0.f;
    const float got = m ? std::fma(level, d, *m) : level * d;
    if (got != w[i]) return false;  // the value; a zero's sign no product sum sees
    q[i] = static_cast<int8_t>(static_cast<int>(level));
  }
  return true;
}

// `v` rounded to nearest at kScaleBits significant bits, moved `step` such values along (toward
// larger magnitudes for a positive step): the scales and offsets of the 4-bit kind have at most
// that many.
constexpr int kScaleBits = 17;
float at_scale_bits(float v, int step) {
  constexpr uint32_t drop = 23 - (kScaleBits - 1), unit = 1u << drop;
  const uint32_t rounded = (bits(v) + unit / 2) & ~(unit - 1);
  const uint32_t moved = rounded + static_cast<uint32_t>(step) * unit;
  if ((moved & 0x7F800000u) == 0x7F800000u || ((moved ^ rounded) & 0x80000000u)) return v;
  float out;
  std::memcpy(&out, &moved, sizeof out);
  return out;
}

// The 4-bit block (d, m, q) of w[kBlock] whatever gguf type it came from: the smallest gap between
// its sorted values is d (or a multiple, as good), their span n of them with n <= 15; d is at
// scale bits near span / n, and m = min - d q0 for the minimum's level q0. The span is off by up
// to an ulp of the block's largest magnitude, so where that is large against d (an offset m far
// from 0) d is searched as many scale-bit steps either side as that error spans.
bool fit_lattice(const float* w, float& d_out, float& m_out, int8_t* q) {
  float v[kBlock];
  std::copy(w, w + kBlock, v);
  std::sort(v, v + kBlock);
  const float lo = v[0], hi = v[kBlock - 1];
  float gap = hi - lo;
  for (int64_t i = 1; i < kBlock; ++i) {
    if (v[i] > v[i - 1]) gap = std::min(gap, v[i] - v[i - 1]);
  }
  if (!(gap > 0.f)) {  // one value: d = 0, m = that value
    d_out = 0.f;
    m_out = lo;
    return fits(w, 0.f, lo, 0.f, kLevels, q);
  }
  const float n = std::nearbyint((hi - lo) / gap);
  if (n > kLevels) return false;  // values on no grid of 16 levels: a float block
  const float d0 = (hi - lo) / n, big = std::max(std::fabs(lo), std::fabs(hi));
  const float step = at_scale_bits(d0, 1) - at_scale_bits(d0, 0);
  const float error = (std::nextafter(big, INFINITY) - big) / n;
  const int window = static_cast<int>(std::min(256.f, std::ceil(error / step))) + 2;
  for (int k = 0; k <= 2 * window; ++k) {
    const float d = at_scale_bits(d0, (k + 1) / 2 * (k % 2 ? -1 : 1));  // nearest first
    for (float q0 = 0.f; q0 + n <= kLevels; q0 += 1.f) {
      for (int ms : kSteps) {
        const float m = at_scale_bits(lo - d * q0, ms);
        if (fits(w, d, m, 0.f, kLevels, q)) {
          d_out = d;
          m_out = m;
          return true;
        }
      }
    }
  }
  return false;
}

// (q [N, K] uint8 (Q4_1) or int8 (Q8_0), d [N, K / kBlock], m [N, K / kBlock] (Q4_1; else an
// empty tensor)); q.numel() == 0: `weight` is not made of such blocks.
std::tuple<at::Tensor, at::Tensor, at::Tensor> find_blocks(const at::Tensor& weight_in, bool q41) {
  TORCH_CHECK(weight_in.device().is_cpu() && weight_in.scalar_type() == at::kFloat &&
                  weight_in.dim() == 2,
              "find_blocks: a float32 CPU weight [N, K]");
  const auto none = std::make_tuple(at::empty({0}, at::kByte), at::empty({0}, at::kFloat),
                                    at::empty({0}, at::kFloat));
  const int64_t N = weight_in.size(0), K = weight_in.size(1);
  if (N == 0 || K == 0 || K % kBlock) return none;
  const at::Tensor weight = weight_in.contiguous();
  const int64_t blocks = N * K / kBlock;
  at::Tensor q = at::empty({N, K}, q41 ? at::kByte : at::kChar);
  at::Tensor d = at::empty({N, K / kBlock}, at::kFloat);
  at::Tensor m = q41 ? at::empty({N, K / kBlock}, at::kFloat) : at::empty({0}, at::kFloat);
  const float* wp = weight.const_data_ptr<float>();
  auto* qp = static_cast<int8_t*>(q.mutable_data_ptr());
  float* dp = d.mutable_data_ptr<float>();
  float* mp = q41 ? m.mutable_data_ptr<float>() : nullptr;
  const float low = q41 ? 0.f : -kQ8Max - 1.f, high = q41 ? kLevels : kQ8Max;
  for (int64_t b = 0; b < blocks; ++b) {
    const float* w = wp + b * kBlock;
    float lo = w[0], hi = w[0], mag = 0.f;
    for (int64_t i = 0; i < kBlock; ++i) {
      lo = std::min(lo, w[i]);
      hi = std::max(hi, w[i]);
      mag = std::max(mag, std::fabs(w[i]));
    }
    if (!std::isfinite(lo) || !std::isfinite(hi)) return none;
    std::optional<float> base;
    if (q41) base = lo;
    const float estimate = q41 ? (hi - lo) / kLevels : mag / kQ8Max;
    bool found = false;
    // The quick estimate: float16 scales, the minimum on level 0 (a float16 itself).
    if (!q41 || static_cast<float>(c10::Half(lo)) == lo) {
      for (int step : kSteps) {
        const float cand = half_step(estimate, step);
        if (fits(w, cand, base, low, high, qp + b * kBlock)) {
          dp[b] = cand;
          if (q41) mp[b] = lo;
          found = true;
          break;
        }
      }
    }
    if (!found && q41) found = fit_lattice(w, dp[b], mp[b], qp + b * kBlock);
    if (!found) return none;
  }
  return {q, d, m};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) {
  m.def("find_blocks(Tensor weight, bool q4_1) -> (Tensor, Tensor, Tensor)", &find_blocks);
}
