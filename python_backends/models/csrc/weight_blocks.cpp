// The search of models/weight_blocks.py: the GGUF blocks a float32 weight is made of, bit for bit
// (Q4_1: w = fl(fl(d q) + m), q in [0, 15]; Q8_0: w = fl(d q), q in [-128, 127]; a float16 d and
// m per kBlock inputs), or nothing. One pass over the weight, block by block: each block's
// estimate of d (Q4_1: (max - m) / 15 with m its minimum; Q8_0: max |w| / 127) rounded to float16,
// then its float16 neighbours nearest first, until one gives back all 32 weights. The first block
// that none does ends the search: a float checkpoint is refused at its first block.
//
// d q is exact in float32 (11 significant bits times at most 8), so whether the compiler fuses
// d q + m into one FMA or not, the sum is gguf's fl(fl(d q) + m).
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

// Whether d (and `low` <= q <= `high`) gives back the block w[kBlock]: fl(fl(d q) + m) for Q4_1
// (`m` given), fl(d q) for Q8_0; q into `q` (as the int8 or uint8 it will be stored as).
bool fits(const float* w, float d, std::optional<float> m, float low, float high, int8_t* q) {
  const float scale = d > 0.f ? d : 1.f;
  const float base = m.value_or(0.f);
  for (int64_t i = 0; i < kBlock; ++i) {
    float level = d > 0.f ? std::clamp(std::nearbyint((w[i] - base) / scale), low, high) : 0.f;
    float got = level * d;
    if (m) got = got + *m;
    if (bits(got) != bits(w[i])) return false;
    q[i] = static_cast<int8_t>(static_cast<int>(level));
  }
  return true;
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
    if (q41) {
      if (static_cast<float>(c10::Half(lo)) != lo) return none;  // no float16 minimum
      base = lo;
    }
    const float estimate = q41 ? (hi - lo) / kLevels : mag / kQ8Max;
    bool found = false;
    for (int step : kSteps) {
      const float cand = half_step(estimate, step);
      if (fits(w, cand, base, low, high, qp + b * kBlock)) {
        dp[b] = cand;
        if (q41) mp[b] = lo;
        found = true;
        break;
      }
    }
    if (!found) return none;
  }
  return {q, d, m};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) {
  m.def("find_blocks(Tensor weight, bool q4_1) -> (Tensor, Tensor, Tensor)", &find_blocks);
}
