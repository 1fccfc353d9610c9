// The float32 work between a decoder layer's projections, one operator per step of it: RMS norm
// (with the residual add before it), the rotary embedding of q and k together with the KV cache
// write, and SiLU(gate) * up. In torch these are 4-10 operators each, and on the CPU every
// operator costs microseconds of dispatch whatever its size: at batch 1 the glue took about a
// quarter of a decode step. Same math as the torch path (python_backends/models/llama.py), in
// another rounding order; called by the engine's thread alone (the work is small).
//
// Built and loaded by python_backends/models/kernels.py (for the machine it runs on).
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <tuple>

#include "ops.h"
#include "vec.h"

namespace {

using llm::load;
using llm::store;
using llm::vec;
using llm::VL;

void check_float_cpu(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), op,
              ": ", name, " must be a contiguous float32 CPU tensor");
}

// y = x / sqrt(mean(x^2) + eps) * w, for one row of E features.
void norm_row(const float* x, const float* w, float* y, int64_t E, float eps) {
  const float squares = llm::dot(x, x, E);
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(E) + eps);
  int64_t i = 0;
  for (; i + VL <= E; i += VL) store(y + i, load(x + i) * inv * load(w + i));
  for (; i < E; ++i) y[i] = x[i] * inv * w[i];
}

int64_t check_norm(const at::Tensor& x, const at::Tensor& w, const char* op) {
  check_float_cpu(x, op, "x");
  check_float_cpu(w, op, "weight");
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && x.size(-1) == w.size(0), op, ": x [..., ",
              w.size(0), "] for a weight of ", w.size(0), ", got ", x.sizes());
  return w.size(0);
}

// Rotate-half rotary embedding of one head: out = x * cos + rotate_half(x) * sin.
void rotate(const float* x, const float* cos, const float* sin, float* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    out[i] = x[i] * cos[i] - x[i + half] * sin[i];
    out[i + half] = x[i + half] * cos[i + half] + x[i] * sin[i + half];
  }
}

// SiLU(g) = g * sigmoid(g), with sigmoid from exp of -|g| (exp_nonpositive's range).
inline vec silu(vec g) {
  const vec e = llm::exp_nonpositive(g < 0 ? g : -g);
  const vec one = vec{} + 1.f;
  return g * (g < 0 ? e : one) / (one + e);
}

}  // namespace

namespace llm {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t E = check_norm(x, w, "rms_norm");
  at::Tensor y = at::empty_like(x);
  const int64_t rows = E ? x.numel() / E : 0;
  const float *xp = x.const_data_ptr<float>(), *wp = w.const_data_ptr<float>();
  float* yp = y.mutable_data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) norm_row(xp + r * E, wp, yp + r * E, E, eps);
  return y;
}

// (x + delta, rms_norm(x + delta)): a layer's residual add and the next norm in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta,
                                                const at::Tensor& w, double eps) {
  const int64_t E = check_norm(x, w, "add_rms_norm");
  check_float_cpu(delta, "add_rms_norm", "delta");
  TORCH_CHECK(delta.sizes() == x.sizes(), "add_rms_norm: delta ", delta.sizes(), " for x ",
              x.sizes());
  at::Tensor sum = at::empty_like(x), y = at::empty_like(x);
  const int64_t rows = E ? x.numel() / E : 0;
  const float *xp = x.const_data_ptr<float>(), *dp = delta.const_data_ptr<float>();
  float *sp = sum.mutable_data_ptr<float>(), *yp = y.mutable_data_ptr<float>();
  for (int64_t i = 0; i < rows * E; ++i) sp[i] = xp[i] + dp[i];
  for (int64_t r = 0; r < rows; ++r)
    norm_row(sp + r * E, w.const_data_ptr<float>(), yp + r * E, E, eps);
  return {sum, y};
}

// qkv [T, (H + 2K) * D], the step's tables cos and sin [T, D] (any [T, 1, D] view): q and k
// rotated, returned as q [T, H, D] and k [T, K, D]; k and v written to cache [2, S, K, D] at
// slots [T].
std::tuple<at::Tensor, at::Tensor> rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos_in,
                                                 const at::Tensor& sin_in, at::Tensor cache,
                                                 const at::Tensor& slots, int64_t H, int64_t K) {
  check_float_cpu(qkv, "rope_write_kv", "qkv");
  check_float_cpu(cache, "rope_write_kv", "cache");
  TORCH_CHECK(cache.dim() == 4 && cache.size(0) == 2 && cache.size(2) == K,
              "rope_write_kv: cache [2, slots, ", K, ", head_dim], got ", cache.sizes());
  const int64_t T = qkv.size(0), D = cache.size(3), S = cache.size(1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (H + 2 * K) * D && D % 2 == 0,
              "rope_write_kv: qkv [T, ", (H + 2 * K) * D, "], got ", qkv.sizes());
  const at::Tensor cos = cos_in.reshape({T, D}).contiguous();
  const at::Tensor sin = sin_in.reshape({T, D}).contiguous();
  check_float_cpu(cos, "rope_write_kv", "cos");
  check_float_cpu(sin, "rope_write_kv", "sin");
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.dim() == 1 &&
              slots.size(0) == T, "rope_write_kv: slots, one int64 per token");
  const at::Tensor slot = slots.contiguous();
  const int64_t* sl = slot.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sl[t] >= 0 && sl[t] < S, "rope_write_kv: slot ", sl[t], " outside the cache's ", S);
  at::Tensor q = at::empty({T, H, D}, qkv.options()), k = at::empty({T, K, D}, qkv.options());
  const float* in = qkv.const_data_ptr<float>();
  const float *cp = cos.const_data_ptr<float>(), *sp = sin.const_data_ptr<float>();
  float *qp = q.mutable_data_ptr<float>(), *kp = k.mutable_data_ptr<float>();
  float* kc = cache.mutable_data_ptr<float>();
  float* vc = kc + S * K * D;
  for (int64_t t = 0; t < T; ++t) {
    const float* row = in + t * (H + 2 * K) * D;
    const float *c = cp + t * D, *s = sp + t * D;
    for (int64_t h = 0; h < H; ++h) rotate(row + h * D, c, s, qp + (t * H + h) * D, D);
    for (int64_t h = 0; h < K; ++h) rotate(row + (H + h) * D, c, s, kp + (t * K + h) * D, D);
    std::memcpy(kc + sl[t] * K * D, kp + t * K * D, K * D * sizeof(float));
    std::memcpy(vc + sl[t] * K * D, row + (H + K) * D, K * D * sizeof(float));
  }
  return {q, k};
}

// gate_up [T, 2I] -> SiLU(gate) * up [T, I].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_float_cpu(gate_up, "silu_mul", "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up [T, 2 * intermediate], got ", gate_up.sizes());
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor out = at::empty({T, I}, gate_up.options());
  const float* in = gate_up.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float *g = in + t * 2 * I, *u = g + I;
    float* o = op + t * I;
    int64_t i = 0;
    for (; i + VL <= I; i += VL) store(o + i, silu(load(g + i)) * load(u + i));
    for (; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  }
  return out;
}

}  // namespace llm

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &llm::rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)",
        &llm::add_rms_norm);
  m.def("rope_write_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) cache, Tensor slots, "
        "int num_heads, int num_kv_heads) -> (Tensor, Tensor)", &llm::rope_write_kv);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &llm::silu_mul);
}
