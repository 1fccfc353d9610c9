// The search of models/weight_blocks.py: the GGUF blocks a float32 weight is made of, or nothing.
// Each kind is a layout of the native kernel (csrc/linear.cpp), with a float32 scale d (and offset
// m) per group of inputs and a small integer level q per weight, w = fma(q, d, m) (Q8_0: d q):
// - "q4" (4-bit, groups of 32, q in [0, 15]): gguf's Q4_1 (d, m float16), Q4_0 (w = d (q - 8),
//   m = -8 d) and Q4_K (d = a float16 x a 6-bit scale, m = -(a float16 x a 6-bit min));
// - "u8g32" (5-bit, groups of 32, q in [0, 31]): Q5_0, Q5_1, Q5_K, the same forms with 5 bits;
// - "u8g16" (6-bit, groups of 16, q + 32 in [0, 63]): Q6_K, w = fl(d q) with d = a float16 x an
//   int8 scale (19 significant bits) and q in [-32, 31]: as fma(q + 32, d, -32 d), whose one
//   rounding is that of d q;
// - "q8" (groups of 32, q in [-128, 127]): Q8_0, w = fl(d q), d float16.
// One pass over the weight, group by group. Q4_1 and Q8_0 first try the quick estimate: d the
// float16 nearest (max - m) / 15 with m the group's minimum (Q8_0: max |w| / 127), then its
// float16 neighbours nearest first. Other groups are fitted as a grid: the smallest gap between
// the group's values gives how many levels its span covers, d is near span / levels at the
// form's significant bits, and m the minimum less d times its level (`fit_offset`), or -32 d
// (`fit_symmetric`). The first group that nothing fits ends the search: a float checkpoint is
// refused at its first group.
//
// A group is kept only if fma(q, d, m) (Q8_0: q d) gives back each of its weights, as the kernel
// computes them; where d q is exact (the 4- and 5-bit forms, Q8_0) that is gguf's fl(fl(d q) + m).
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
#include <string>
#include <tuple>

namespace {

constexpr int64_t kMaxGroup = 32;
constexpr float kQ8Max = 127.f;  // Q8_0: llama.cpp's quantizer maps max |w| to it
constexpr int kSteps[] = {0, -1, 1, -2, 2};  // neighbours of an estimate, nearest first
constexpr uint16_t kLargestHalf = 0x7BFF;

struct Kind {
  int64_t group;  // inputs per d (and m)
  float levels;   // q in [0, levels] (Q8_0: [-128, 127])
  int scale_bits;  // at most this many significant bits in d and m
  bool quick;      // try the float16 estimate first (Q4_1, Q8_0)
  bool symmetric;  // m = -(levels + 1) / 2 d (Q6_K)
  bool q8;         // Q8_0: no m, q an int8
};

Kind kind_of(const std::string& name) {
  if (name == "q4") return {32, 15.f, 17, true, false, false};
  if (name == "u8g32") return {32, 31.f, 17, false, false, false};
  if (name == "u8g16") return {16, 63.f, 19, false, true, false};
  if (name == "q8") return {32, kQ8Max, 11, true, false, true};
  TORCH_CHECK(false, "find_blocks: kind q4, u8g32, u8g16 or q8, not '", name, "'");
}

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

// Whether d (and `low` <= q <= `high`) gives back the group w[G]: fma(q, d, m) (`m` given), else
// fl(d q); q into `q` (as the int8 or uint8 it will be stored as).
bool fits(const float* w, int64_t G, float d, std::optional<float> m, float low, float high,
          int8_t* q) {
  const float base = m.value_or(0.f);
  for (int64_t i = 0; i < G; ++i) {
    const float level = d != 0.f ? std::clamp(std::nearbyint((w[i] - base) / d), low, high) : 0.f;
    const float got = m ? std::fma(level, d, *m) : level * d;
    if (got != w[i]) return false;  // the value; a zero's sign no product sum sees
    q[i] = static_cast<int8_t>(static_cast<int>(level));
  }
  return true;
}

// `v` rounded to nearest at `sig` significant bits, moved `step` such values along (toward larger
// magnitudes for a positive step).
float at_bits(float v, int sig, int step) {
  const uint32_t unit = 1u << (24 - sig);
  const uint32_t rounded = (bits(v) + unit / 2) & ~(unit - 1);
  const uint32_t moved = rounded + static_cast<uint32_t>(step) * unit;
  if ((moved & 0x7F800000u) == 0x7F800000u || ((moved ^ rounded) & 0x80000000u)) return v;
  float out;
  std::memcpy(&out, &moved, sizeof out);
  return out;
}

// A group's values: their extremes and the smallest gap between them (0 where it holds one
// value).
struct Spread {
  float lo, hi, gap;
};

Spread spread(const float* w, int64_t G) {
  float v[kMaxGroup];
  std::copy(w, w + G, v);
  std::sort(v, v + G);
  Spread s{v[0], v[G - 1], v[G - 1] - v[0]};
  for (int64_t i = 1; i < G; ++i) {
    if (v[i] > v[i - 1]) s.gap = std::min(s.gap, v[i] - v[i - 1]);
  }
  return s;
}

// Calls try(d) for each d that could put the group's values on a grid of at most `levels`
// steps, until one returns true: its span is n steps of d for an n at least span / gap (the
// smallest gap is a whole number of steps: with few values not every level occurs) whose steps
// make that gap whole, and d is near span / n at `sig` significant bits, nearest first. The span
// is off by up to an ulp of the largest magnitude: where that is large against d (values far
// from 0), d is searched as many steps either side as that error spans.
template <class Try>
bool grid_scales(const Spread& s, float levels, int sig, Try&& attempt) {
  const float span = s.hi - s.lo, big = std::max(std::fabs(s.lo), std::fabs(s.hi));
  for (float n = std::nearbyint(span / s.gap); n <= levels; n += 1.f) {
    const float whole = s.gap * n / span;
    if (std::fabs(whole - std::nearbyint(whole)) > 1e-3f) continue;
    const float d0 = span / n;
    const float step = at_bits(d0, sig, 1) - at_bits(d0, sig, 0);
    const float error = (std::nextafter(big, INFINITY) - big) / n;
    const int window = static_cast<int>(std::min(256.f, std::ceil(error / step))) + 2;
    for (int k = 0; k <= 2 * window; ++k) {
      if (attempt(at_bits(d0, sig, (k + 1) / 2 * (k % 2 ? -1 : 1)), n)) return true;
    }
  }
  return false;
}

// Levels in [0, levels], a free offset m (Q4_0, Q4_K, the 5-bit forms): m = min - d q0 for the
// minimum's level q0.
bool fit_offset(const float* w, const Kind& kind, float& d_out, float& m_out, int8_t* q) {
  const Spread s = spread(w, kind.group);
  auto fit = [&](float d, float m) {
    if (!fits(w, kind.group, d, m, 0.f, kind.levels, q)) return false;
    d_out = d;
    m_out = m;
    return true;
  };
  if (!(s.gap > 0.f)) return fit(0.f, s.lo);  // one value: d = 0, m = that value
  return grid_scales(s, kind.levels, kind.scale_bits, [&](float d, float n) {
    for (float q0 = 0.f; q0 + n <= kind.levels; q0 += 1.f) {
      for (int ms : kSteps) {
        if (fit(d, at_bits(s.lo - d * q0, kind.scale_bits, ms))) return true;
      }
    }
    return false;
  });
}

// Levels q + c in [0, levels] with c = (levels + 1) / 2 and w = fl(d q), d of either sign (Q6_K):
// m = -c d.
bool fit_symmetric(const float* w, const Kind& kind, float& d_out, float& m_out, int8_t* q) {
  const Spread s = spread(w, kind.group);
  const float c = (kind.levels + 1.f) / 2.f;
  auto fit = [&](float d) {
    if (!fits(w, kind.group, d, -c * d, 0.f, kind.levels, q)) return false;
    d_out = d;
    m_out = -c * d;
    return true;
  };
  if (!(s.gap > 0.f)) return fit(s.lo);  // one value v: q = 1, d = v (or d = 0 for zeros)
  return grid_scales(s, kind.levels, kind.scale_bits,
                     [&](float d, float) { return fit(d) || fit(-d); });
}

// (q [N, K] uint8 (int8 for "q8"), d [N, K / group], m [N, K / group] (an empty tensor for "q8"));
// q.numel() == 0: `weight` is not made of such blocks.
std::tuple<at::Tensor, at::Tensor, at::Tensor> find_blocks(const at::Tensor& weight_in,
                                                           const std::string& name) {
  const Kind kind = kind_of(name);
  TORCH_CHECK(weight_in.device().is_cpu() && weight_in.scalar_type() == at::kFloat &&
                  weight_in.dim() == 2,
              "find_blocks: a float32 CPU weight [N, K]");
  const auto none = std::make_tuple(at::empty({0}, at::kByte), at::empty({0}, at::kFloat),
                                    at::empty({0}, at::kFloat));
  const int64_t N = weight_in.size(0), K = weight_in.size(1), G = kind.group;
  if (N == 0 || K == 0 || K % G) return none;
  const at::Tensor weight = weight_in.contiguous();
  const int64_t groups = N * K / G;
  at::Tensor q = at::empty({N, K}, kind.q8 ? at::kChar : at::kByte);
  at::Tensor d = at::empty({N, K / G}, at::kFloat);
  at::Tensor m = kind.q8 ? at::empty({0}, at::kFloat) : at::empty({N, K / G}, at::kFloat);
  const float* wp = weight.const_data_ptr<float>();
  auto* qp = static_cast<int8_t*>(q.mutable_data_ptr());
  float* dp = d.mutable_data_ptr<float>();
  float* mp = kind.q8 ? nullptr : m.mutable_data_ptr<float>();
  for (int64_t b = 0; b < groups; ++b) {
    const float* w = wp + b * G;
    int8_t* qb = qp + b * G;
    float lo = w[0], hi = w[0], mag = 0.f;
    for (int64_t i = 0; i < G; ++i) {
      lo = std::min(lo, w[i]);
      hi = std::max(hi, w[i]);
      mag = std::max(mag, std::fabs(w[i]));
    }
    if (!std::isfinite(lo) || !std::isfinite(hi)) return none;
    bool found = false;
    // The quick estimate: float16 scales, the minimum on level 0 (a float16 itself).
    if (kind.quick && (kind.q8 || static_cast<float>(c10::Half(lo)) == lo)) {
      const float estimate = kind.q8 ? mag / kQ8Max : (hi - lo) / kind.levels;
      const std::optional<float> base = kind.q8 ? std::nullopt : std::optional<float>(lo);
      const float low = kind.q8 ? -kQ8Max - 1.f : 0.f;
      for (int step : kSteps) {
        const float cand = half_step(estimate, step);
        if (fits(w, G, cand, base, low, kind.levels, qb)) {
          dp[b] = cand;
          if (mp != nullptr) mp[b] = lo;
          found = true;
          break;
        }
      }
    }
    if (!found && !kind.q8) {  // every kind but q8 has m
      found = kind.symmetric ? fit_symmetric(w, kind, dp[b], mp[b], qb)
                             : fit_offset(w, kind, dp[b], mp[b], qb);
    }
    if (!found) return none;
  }
  return {q, d, m};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) {
  m.def("find_blocks(Tensor weight, str kind) -> (Tensor, Tensor, Tensor)", &find_blocks);
}
