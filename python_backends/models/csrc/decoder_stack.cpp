// A step through a stack of standard decoder layers in one call (models/decoder.py,
// `DecoderModel.native_stack`).
//
// Each layer is pre-norm attention (fused q/k/v projection, rotate-half rotary embedding of
// the whole head, grouped KV heads over the paged cache) and a SwiGLU MLP, the residual add
// joined to the norm after it: Llama's shape, which most families share. Run layer by layer from
// Python, a step calls a dozen torch operators a layer, and every call pays microseconds of
// Python and dispatch whatever its size: at one sequence about a third of a decode step on the
// engine thread, work the idle-CPU helper cannot share. Here the step calls the same native
// kernels (ops.h) directly, in the same order on the same operands, so the results are the
// Python path's bit for bit; prompts' attention goes through the same torch operators
// (index_select and scaled_dot_product_attention) as there.
//
// Built and loaded by python_backends/models/kernels.py (for the machine it runs on).
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ops.h"

namespace {

// One projection as the native kernel reads it (layers.Linear.pack_native).
struct Projection {
  at::Tensor packed;
  std::optional<at::Tensor> blocks;  // its exact narrower form, if it has one
  std::string kind;                  // that form's layout
  int64_t n = 0;                     // output features

  at::Tensor operator()(const at::Tensor& x) const { return llm::linear(x, packed, n, blocks, kind); }
};

struct Layer {
  at::Tensor input_norm, post_attention_norm;
  Projection qkv, o, gate_up, down;
};

constexpr int64_t kTensorsPerLayer = 10;  // see DecoderStack's constructor
constexpr int64_t kKindsPerLayer = 4;

class DecoderStack : public torch::CustomClassHolder {
 public:
  // Per layer, in order: the input norm's weight, the q/k/v projection's packed weight and
  // narrower form (an empty tensor: none), the output projection's two, the post-attention
  // norm's weight, the gate/up projection's two, the down projection's two; `kinds` the four
  // projections' layouts ("" where none); `dims` (heads H, KV heads K, head size D, hidden size
  // E, intermediate size I).
  DecoderStack(std::vector<at::Tensor> weights, std::vector<std::string> kinds,
               std::vector<int64_t> dims, double eps, double scale)
      : eps_(eps), scale_(scale) {
    TORCH_CHECK(dims.size() == 5, "DecoderStack: dims (heads, kv_heads, head_dim, hidden, "
                "intermediate)");
    H_ = dims[0], K_ = dims[1], D_ = dims[2], E_ = dims[3], I_ = dims[4];
    const int64_t L = static_cast<int64_t>(weights.size()) / kTensorsPerLayer;
    TORCH_CHECK(static_cast<int64_t>(weights.size()) == L * kTensorsPerLayer &&
                    static_cast<int64_t>(kinds.size()) == L * kKindsPerLayer,
                "DecoderStack: ", kTensorsPerLayer, " weights and ", kKindsPerLayer,
                " kinds a layer");
    const int64_t widths[kKindsPerLayer] = {(H_ + 2 * K_) * D_, E_, 2 * I_, E_};
    for (int64_t l = 0; l < L; ++l) {
      const at::Tensor* w = weights.data() + l * kTensorsPerLayer;
      const std::string* k = kinds.data() + l * kKindsPerLayer;
      auto projection = [&](int64_t i, const at::Tensor& packed, const at::Tensor& blocks) {
        return Projection{packed, blocks.numel() ? std::optional<at::Tensor>(blocks) : std::nullopt,
                          k[i], widths[i]};
      };
      layers_.push_back({w[0], w[5], projection(0, w[1], w[2]), projection(1, w[3], w[4]),
                         projection(2, w[6], w[7]), projection(3, w[8], w[9])});
    }
  }

  // The step through every layer: x [T, E] the residual stream, delta what the layer before
  // adds to it (None: nothing); cos, sin the step's rotary tables; slot_mapping [T] where each
  // token's keys and values go; caches [2, S, K, D] one a layer. Attention metadata as
  // models/attention.py's: decode rows (their index in the step [B], context slots [B, L] and
  // lengths [B]; empty tensors where the step has none) and prompt spans (start and end rows,
  // pairs in `spans`; each one's context slots and mask, empty where it has no cached context).
  // Returns (x, delta) for the final norm.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, at::Tensor delta, at::Tensor cos,
                                             at::Tensor sin, at::Tensor slot_mapping,
                                             std::vector<at::Tensor> caches,
                                             at::Tensor decode_index, at::Tensor decode_slots,
                                             at::Tensor decode_lens, std::vector<int64_t> spans,
                                             std::vector<at::Tensor> span_slots,
                                             std::vector<at::Tensor> span_masks) const {
    TORCH_CHECK(caches.size() == layers_.size(), "DecoderStack: ", layers_.size(),
                " caches, got ", caches.size());
    TORCH_CHECK(spans.size() == 2 * span_slots.size() && span_slots.size() == span_masks.size(),
                "DecoderStack: (start, end), slots and a mask for each prompt span");
    const bool has_delta = delta.numel() > 0;
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& layer = layers_[l];
      at::Tensor h;
      if (has_delta || l > 0) {
        std::tie(x, h) = llm::add_rms_norm(x, delta, layer.input_norm, eps_);
      } else {
        h = llm::rms_norm(x, layer.input_norm, eps_);
      }
      const at::Tensor qkv = layer.qkv(h);
      const int64_t T = qkv.size(0);
      auto [q, k] = llm::rope_write_kv(qkv, cos, sin, caches[l], slot_mapping, H_, K_);
      const at::Tensor o = attention(q, k, qkv, caches[l], decode_index, decode_slots,
                                     decode_lens, spans, span_slots, span_masks);
      at::Tensor attended = layer.o(o.reshape({T, H_ * D_}));
      std::tie(x, h) = llm::add_rms_norm(x, attended, layer.post_attention_norm, eps_);
      delta = layer.down(llm::silu_mul(layer.gate_up(h)));
    }
    return {x, delta};
  }

 private:
  // models/attention.py's paged_attention without a softcap, step for step.
  at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& qkv,
                       const at::Tensor& cache, const at::Tensor& decode_index,
                       const at::Tensor& decode_slots, const at::Tensor& decode_lens,
                       const std::vector<int64_t>& spans, const std::vector<at::Tensor>& span_slots,
                       const std::vector<at::Tensor>& span_masks) const {
    const bool decodes = decode_index.numel() > 0;
    if (decodes && span_slots.empty())  // every token a decode, in step order
      return llm::paged_decode_attention(q, cache, decode_slots, decode_lens, scale_);
    const int64_t T = q.size(0);
    const at::Tensor v = qkv.slice(1, (H_ + K_) * D_).view({T, K_, D_});
    at::Tensor out = at::empty_like(q);
    for (size_t i = 0; i < span_slots.size(); ++i) {
      const int64_t start = spans[2 * i], end = spans[2 * i + 1];
      const at::Tensor qs = q.slice(0, start, end).transpose(0, 1).unsqueeze(0);
      at::Tensor o;
      if (!span_masks[i].defined() || span_masks[i].numel() == 0) {  // nothing cached before
        const at::Tensor ks = k.slice(0, start, end).transpose(0, 1).unsqueeze(0);
        const at::Tensor vs = v.slice(0, start, end).transpose(0, 1).unsqueeze(0);
        o = at::scaled_dot_product_attention(qs, ks, vs, std::nullopt, 0.0, true, scale_, true);
      } else {
        const at::Tensor ks =
            cache[0].index_select(0, span_slots[i]).transpose(0, 1).unsqueeze(0);
        const at::Tensor vs =
            cache[1].index_select(0, span_slots[i]).transpose(0, 1).unsqueeze(0);
        o = at::scaled_dot_product_attention(qs, ks, vs, span_masks[i], 0.0, false, scale_, true);
      }
      out.slice(0, start, end).copy_(o[0].transpose(0, 1));
    }
    if (decodes) {
      const at::Tensor rows = q.index_select(0, decode_index).contiguous();
      out.index_put_({decode_index},
                     llm::paged_decode_attention(rows, cache, decode_slots, decode_lens, scale_));
    }
    return out;
  }

  std::vector<Layer> layers_;
  int64_t H_ = 0, K_ = 0, D_ = 0, E_ = 0, I_ = 0;
  double eps_, scale_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<std::string>, std::vector<int64_t>,
                       double, double>())
      .def("forward", &DecoderStack::forward);
}
