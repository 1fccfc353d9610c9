// The native operators that other kernels call directly (decoder_stack.cpp), without going
// through torch's dispatcher: the same functions torch.ops.llm_kernels registers.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace llm {

// linear.cpp: x [T, K] times the weight pack_linear_weight packed (and its narrower form).
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                  const std::optional<at::Tensor>& blocks, const std::string& kind);

// layer_ops.cpp: the float32 work between a layer's projections.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta,
                                                const at::Tensor& w, double eps);
std::tuple<at::Tensor, at::Tensor> rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos,
                                                 const at::Tensor& sin, at::Tensor cache,
                                                 const at::Tensor& slots, int64_t H, int64_t K);
at::Tensor silu_mul(const at::Tensor& gate_up);

// paged_attention.cpp: one query row per decoding sequence over its cached context.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& cache,
                                  const at::Tensor& slots, const at::Tensor& lens, double scale);

// prompt_attention.cpp: prompts' attention on AMX tiles (where prompt_attention_amx()), into
// their rows of out; keys and values [L, K, D] a prompt, masks [n, L] bool (empty: causal).
bool prompt_attention_amx();
void prompt_attention(const at::Tensor& q, at::Tensor& out, const std::vector<int64_t>& spans,
                      const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                      const std::vector<at::Tensor>& masks, double scale);

}  // namespace llm
