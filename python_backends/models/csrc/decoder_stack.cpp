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
// Python path's bit for bit; prompts' attention goes through the same operators as there
// (index_select, then prompt_attention.cpp's tiles on AMX, else scaled_dot_product_attention a
// chunk a prompt shared with the idle-CPU helper).
//
// Built and loaded by python_backends/models/kernels.py (for the machine it runs on).
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "idle_helper.h"
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
  at::Tensor q_norm, k_norm;  // Qwen3's norms of each head's query and key (undefined: none)
  at::Tensor qkv_bias;        // Qwen2's (undefined: none)
  Projection qkv, o, gate_up, down;
};

constexpr int64_t kTensorsPerLayer = 13;  // see DecoderStack's constructor
constexpr int64_t kKindsPerLayer = 4;

class DecoderStack : public torch::CustomClassHolder {
 public:
  // Per layer, in order: the input and post-attention norms' weights, the q and k norms'
  // weights and the q/k/v bias (empty tensors where the layer has none), then the q/k/v, output,
  // gate/up and down projections' packed weights, each followed by its narrower form (empty:
  // none); `kinds` the four projections' layouts ("" where none); `dims` (heads H, KV heads K,
  // head size D, hidden size E, intermediate size I).
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
    auto given = [](const at::Tensor& t) { return t.numel() ? t : at::Tensor(); };
    for (int64_t l = 0; l < L; ++l) {
      const at::Tensor* w = weights.data() + l * kTensorsPerLayer;
      const std::string* k = kinds.data() + l * kKindsPerLayer;
      auto projection = [&](int64_t i) {
        const at::Tensor& blocks = w[6 + 2 * i];
        return Projection{w[5 + 2 * i],
                          blocks.numel() ? std::optional<at::Tensor>(blocks) : std::nullopt,
                          k[i], widths[i]};
      };
      TORCH_CHECK(given(w[2]).defined() == given(w[3]).defined(),
                  "DecoderStack: q and k norms together or neither");
      layers_.push_back({w[0], w[1], given(w[2]), given(w[3]), given(w[4]), projection(0),
                         projection(1), projection(2), projection(3)});
    }
  }

  // The step through every layer: x [T, E] the residual stream (the embeddings); cos, sin the
  // step's rotary tables; slot_mapping [T] where each token's keys and values go; caches
  // [2, S, K, D] one a layer. Attention metadata as models/attention.py's: decode rows (their
  // index in the step [B], context slots [B, L] and lengths [B]; empty tensors where the step
  // has none) and prompt spans (start and end rows, pairs in `spans`; each one's context slots
  // and mask, empty where it has no cached context). Returns (x, delta) for the final norm.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, at::Tensor cos, at::Tensor sin,
                                             at::Tensor slot_mapping,
                                             std::vector<at::Tensor> caches,
                                             at::Tensor decode_index, at::Tensor decode_slots,
                                             at::Tensor decode_lens, std::vector<int64_t> spans,
                                             std::vector<at::Tensor> span_slots,
                                             std::vector<at::Tensor> span_masks) const {
    TORCH_CHECK(caches.size() == layers_.size(), "DecoderStack: ", layers_.size(),
                " caches, got ", caches.size());
    TORCH_CHECK(spans.size() == 2 * span_slots.size() && span_slots.size() == span_masks.size(),
                "DecoderStack: (start, end), slots and a mask for each prompt span");
    at::Tensor delta;  // what the layer before adds to the residual stream
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& layer = layers_[l];
      at::Tensor h;
      if (l > 0) {
        std::tie(x, h) = llm::add_rms_norm(x, delta, layer.input_norm, eps_);
      } else {
        h = llm::rms_norm(x, layer.input_norm, eps_);
      }
      at::Tensor qkv = layer.qkv(h);
      const int64_t T = qkv.size(0);
      if (layer.qkv_bias.defined()) qkv = qkv + layer.qkv_bias;
      if (layer.q_norm.defined()) {  // each head's query and key normalized before the rotation
        const std::vector<at::Tensor> p = qkv.split({H_ * D_, K_ * D_, K_ * D_}, -1);
        auto heads = [&](const at::Tensor& x, const at::Tensor& w) {
          return llm::rms_norm(x.reshape({-1, D_}).contiguous(), w, eps_).view({T, -1});
        };
        qkv = at::cat({heads(p[0], layer.q_norm), heads(p[1], layer.k_norm), p[2]}, -1);
      }
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
  // models/attention.py's paged_attention without a softcap, step for step: prompts on AMX
  // tiles where it takes them there (prompt_attention.cpp), else through torch's SDPA a chunk a
  // prompt, which the engine thread shares with the idle-CPU helper (idle_helper.h). (Not finer:
  // torch's CPU flash kernel over some heads of a prompt does not always round as over all of
  // them.)
  at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& qkv,
                       const at::Tensor& cache, const at::Tensor& decode_index,
                       const at::Tensor& decode_slots, const at::Tensor& decode_lens,
                       const std::vector<int64_t>& spans, const std::vector<at::Tensor>& span_slots,
                       const std::vector<at::Tensor>& span_masks) const {
    const bool decodes = decode_index.numel() > 0;
    if (decodes && span_slots.empty())  // every token a decode, in step order
      return llm::paged_decode_attention(q, cache, decode_slots, decode_lens, scale_);
    const int64_t T = q.size(0), H = H_, K = K_, D = D_;
    const at::Tensor v = qkv.slice(1, (H + K) * D).view({T, K, D});
    at::Tensor out = at::empty_like(q);
    if (q.scalar_type() == at::kFloat && D % 32 == 0 && llm::prompt_attention_amx()) {
      // On AMX tiles, as models/attention.py's prompt_attention_on_tiles takes them.
      std::vector<at::Tensor> keys, values, masks;
      for (size_t i = 0; i < span_slots.size(); ++i) {
        auto [ks, vs, mask] = span_kv(i, k, v, cache, spans, span_slots, span_masks);
        keys.push_back(std::move(ks));
        values.push_back(std::move(vs));
        masks.push_back(std::move(mask));
      }
      llm::prompt_attention(q, out, spans, keys, values, masks, scale_);
    } else {
      sdpa_prompts(q, k, v, cache, spans, span_slots, span_masks, out);
    }
    if (decodes) {
      const at::Tensor rows = q.index_select(0, decode_index).contiguous();
      out.index_put_({decode_index},
                     llm::paged_decode_attention(rows, cache, decode_slots, decode_lens, scale_));
    }
    return out;
  }

  // What prompt i's queries attend over, as models/attention.py's span_kv: keys and values
  // [L, K, D] and its mask [n, L]; with nothing cached before (mask undefined: causal) this
  // step's own, else the context's from the cache.
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> span_kv(
      size_t i, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cache,
      const std::vector<int64_t>& spans, const std::vector<at::Tensor>& span_slots,
      const std::vector<at::Tensor>& span_masks) {
    const at::Tensor& mask = span_masks[i];
    if (!mask.defined() || mask.numel() == 0)
      return {k.slice(0, spans[2 * i], spans[2 * i + 1]),
              v.slice(0, spans[2 * i], spans[2 * i + 1]), at::Tensor()};
    return {cache[0].index_select(0, span_slots[i]), cache[1].index_select(0, span_slots[i]),
            mask};
  }

  // The prompts' rows of out through torch's scaled_dot_product_attention, a chunk a prompt.
  void sdpa_prompts(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& cache, const std::vector<int64_t>& spans,
                    const std::vector<at::Tensor>& span_slots,
                    const std::vector<at::Tensor>& span_masks, at::Tensor& out) const {
    const int64_t H = H_, D = D_;
    // Each prompt's rows, mask (undefined: causal over this step's keys and values alone) and
    // keys and values [1, K, n, D]: this step's, or its cached context's.
    std::vector<std::tuple<int64_t, int64_t, at::Tensor, at::Tensor, at::Tensor>> prompts;
    for (size_t i = 0; i < span_slots.size(); ++i) {
      const auto [ks, vs, mask] = span_kv(i, k, v, cache, spans, span_slots, span_masks);
      prompts.emplace_back(spans[2 * i], spans[2 * i + 1], mask,
                           ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0));
    }
    llm::Job job;
    job.chunks = static_cast<int64_t>(prompts.size());
    float* op = out.mutable_data_ptr<float>();
    const int64_t row_bytes = static_cast<int64_t>(H * D * sizeof(float));
    job.place = [=](int64_t c) {
      const auto& [start, end, mask, ks, vs] = prompts[c];
      return llm::Block{reinterpret_cast<char*>(op + start * H * D), row_bytes, end - start,
                        row_bytes};
    };
    const double scale = scale_;
    job.compute = [=](int64_t c, char* dst, int64_t ld) {
      c10::InferenceMode inference;  // as the engine's step (the helper's thread has no mode)
      const auto& [start, end, mask, ks, vs] = prompts[c];
      const at::Tensor o = at::scaled_dot_product_attention(
          q.slice(0, start, end).transpose(0, 1).unsqueeze(0), ks, vs,
          mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt, 0.0,
          !mask.defined(), scale, true);
      at::from_blob(dst, {end - start, H, D}, {ld / static_cast<int64_t>(sizeof(float)), D, 1},
                    q.options())
          .copy_(o[0].transpose(0, 1));
    };
    job.keep = {q, out};
    llm::run(std::move(job));
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
