// Prompts' attention on AMX tiles, to float32 precision (CPUs with AMX-BF16).
//
// A prompt's queries attend over its keys and values: this step's, or a cached context's with
// the step's own at its end. Torch's CPU flash kernel computes the two products, scores q k^T and
// the output p v, in float32 on the vector units; here they run on AMX tiles as the projections
// do (amx.h): every operand split into three bfloat16 pieces, the six products above 2^-23 of
// the result kept, each exact and summed in float32. Between them the softmax computes on the
// vector units in float32: the scores scaled, their maximum subtracted, exp (vec.h, within 2
// ulp), masked keys zero, and each row's output divided by its sum at the end, as the flash
// kernel does. Float32's precision throughout, in another order of sums than torch's.
//
// One chunk of work a prompt's KV head (its query heads' rows stacked), shared with the idle
// helper (idle_helper.h). A chunk takes its query rows 32 at a time (two row tiles), and of the
// keys only those up to the last that one of the 32 sees, so a causal prompt computes about
// half of its scores.
//
// Built and loaded by python_backends/models/kernels.py (for the machine it runs on).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "amx.h"
#include "idle_helper.h"
#include "ops.h"
#include "vec.h"

namespace {

#ifdef LLM_AMX
namespace amx = llm::amx;

constexpr int64_t kRows = 2 * amx::RT;  // query rows a pass: two row tiles

// One prompt: its rows [start, end) of the step's queries, its keys and values [L, K, D]
// (contiguous), and which keys each query sees: mask [n, L] (bool), or where undefined query i
// sees keys [0, L - n + i] (causal, the queries the last n of the L).
struct Prompt {
  int64_t start, end;
  at::Tensor keys, values, mask;
};

// The softmax of a row's scores s[0, width) (width a multiple of 16) in place, times `scale`,
// over the keys it sees (`visible(j)`: a mask of those of keys j .. j + 15), the others zero;
// returns the sum of the exps (the row's output is divided by it).
template <class Visible>
float softmax_row(float* s, int64_t width, float scale, Visible visible) {
  const float lowest = -std::numeric_limits<float>::infinity();
  const __m512 times = _mm512_set1_ps(scale);
  __m512 top = _mm512_set1_ps(lowest);
  for (int64_t j = 0; j < width; j += 16) {
    top = _mm512_mask_max_ps(top, visible(j), top, _mm512_mul_ps(_mm512_loadu_ps(s + j), times));
  }
  const float most = _mm512_reduce_max_ps(top);
  if (most == lowest) {  // sees no key: a zero row
    std::fill(s, s + width, 0.f);
    return 1.f;
  }
  const __m512 shift = _mm512_set1_ps(most);
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; j += 16) {
    const __m512 x = _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(s + j), times), shift);
    const __m512 e = _mm512_maskz_mov_ps(visible(j), (__m512)llm::exp_nonpositive((llm::vec)x));
    total = _mm512_add_ps(total, e);
    _mm512_storeu_ps(s + j, e);
  }
  return _mm512_reduce_add_ps(total);
}

// Which of keys j .. j + 15 a query sees whose last key is `last` (causal).
inline __mmask16 up_to(int64_t j, int64_t last) {
  if (last >= j + 15) return 0xFFFF;
  if (last < j) return 0;
  return static_cast<__mmask16>((1u << (last - j + 1)) - 1u);
}

// Which of keys j .. j + 15 a query's mask row m (L bools) lets it see.
inline __mmask16 masked(const bool* m, int64_t L, int64_t j) {
  if (j >= L) return 0;
  const __mmask16 valid = L - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (L - j)) - 1u);
  const __m128i bytes = _mm_maskz_loadu_epi8(valid, m + j);
  return _mm_test_epi8_mask(bytes, bytes);
}

// Chunk (prompt p, KV head g): out rows [0, n) (ld floats apart), heads g G .. g G + G - 1 at
// columns 0, D, ... of each.
void attend(const at::Tensor& q, const Prompt& p, int64_t g, int64_t G, float scale, float* out,
            int64_t ld) {
  amx::configure();
  const int64_t n = p.end - p.start, L = p.keys.size(0), D = q.size(2), K = p.keys.size(1);
  const int64_t Lp = (L + 31) / 32 * 32, kpanels = Lp / 32, vpanels = D / 32;
  const int64_t kpiece = amx::kPieces * 2 * D * 16;   // uint16 of a key panel's pieces
  const int64_t vpiece = amx::kPieces * 2 * Lp * 16;  // a value panel's
  thread_local std::vector<amx::Line> kb_, vb_, panel_, qrows_, a_, s_, sums_, o_;
  uint16_t* kb = amx::scratch<uint16_t>(kb_, kpanels * kpiece);
  uint16_t* vb = amx::scratch<uint16_t>(vb_, vpanels * vpiece);
  // The keys as B operands: 32 keys a panel, [D][32] floats, split; the values alike, D / 32
  // panels of [Lp][32].
  const float* kp = p.keys.const_data_ptr<float>() + g * D;
  const float* vp = p.values.const_data_ptr<float>() + g * D;
  float* panel = amx::scratch<float>(panel_, std::max(D, Lp) * 32);
  for (int64_t c = 0; c < kpanels; ++c) {
    for (int64_t k = 0; k < D; ++k) {
      for (int64_t j = 0; j < 32; ++j) {
        const int64_t key = c * 32 + j;
        panel[k * 32 + j] = key < L ? kp[key * K * D + k] : 0.f;
      }
    }
    amx::PanelSplit{panel, D, D, kb + c * kpiece}.all();
  }
  for (int64_t c = 0; c < vpanels; ++c) {
    for (int64_t key = 0; key < L; ++key) {
      std::copy_n(vp + key * K * D + c * 32, 32, panel + key * 32);
    }
    amx::PanelSplit{panel, L, Lp, vb + c * vpiece}.all();
  }
  // Each head's queries, contiguous [n][D].
  float* qrows = amx::scratch<float>(qrows_, n * D);
  uint16_t* a = amx::scratch<uint16_t>(a_, amx::kPieces * kRows * std::max(D, Lp));
  float* s = amx::scratch<float>(s_, kRows * Lp);
  float* o = amx::scratch<float>(o_, kRows * D);
  float* sums = amx::scratch<float>(sums_, kRows);
  const float* qp = q.const_data_ptr<float>();
  const int64_t qld = q.stride(0);
  const bool* mask = p.mask.defined() ? p.mask.const_data_ptr<bool>() : nullptr;
  const amx::PanelSplit none;
  // Each pass's width of scores, the same for every head: the keys its rows see at most (up to
  // the last row's own, causal, or the mask's last), in 32s.
  std::vector<int64_t> widths;
  for (int64_t r0 = 0; r0 < n; r0 += kRows) {
    const int64_t rows = std::min(kRows, n - r0);
    int64_t seen = 0;
    if (mask == nullptr) {
      seen = L - n + r0 + rows;
    } else {
      for (int64_t i = r0; i < r0 + rows; ++i) {
        for (int64_t j = L - 1; j >= seen; --j) {
          if (mask[i * L + j]) {
            seen = j + 1;
            break;
          }
        }
      }
    }
    widths.push_back(std::max<int64_t>(32, (seen + 31) / 32 * 32));
  }
  for (int64_t h = 0; h < G; ++h) {
    const int64_t head = g * G + h;
    for (int64_t i = 0; i < n; ++i)
      std::copy_n(qp + (p.start + i) * qld + head * D, D, qrows + i * D);
    for (int64_t r0 = 0; r0 < n; r0 += kRows) {
      const int64_t rows = std::min(kRows, n - r0), Tp = (rows + 15) / 16 * 16;
      const int64_t width = widths[r0 / kRows];
      amx::split_rows(qrows + r0 * D, rows, D, a, Tp, D);
      for (int64_t c = 0; c < width / 32; ++c)
        amx::panel_product(a, rows, Tp, D, kb + c * kpiece, s + c * 32, width, 32, none);
      for (int64_t i = 0; i < rows; ++i) {
        float* row = s + i * width;
        if (mask == nullptr) {
          const int64_t last = L - n + r0 + i;
          sums[i] = softmax_row(row, width, scale, [=](int64_t j) { return up_to(j, last); });
        } else {
          const bool* m = mask + (r0 + i) * L;
          sums[i] = softmax_row(row, width, scale, [=](int64_t j) { return masked(m, L, j); });
        }
      }
      amx::split_rows(s, rows, width, a, Tp, width);
      for (int64_t c = 0; c < vpanels; ++c)
        amx::panel_product(a, rows, Tp, width, vb + c * vpiece, o + c * 32, D, 32, none, Lp);
      for (int64_t i = 0; i < rows; ++i) {
        const llm::vec inv = llm::vec{} + 1.f / sums[i];
        float* dst = out + (r0 + i) * ld + h * D;
        for (int64_t d = 0; d < D; d += llm::VL) llm::store(dst + d, llm::load(o + i * D + d) * inv);
      }
    }
  }
}
#endif

}  // namespace

namespace llm {

bool prompt_attention_amx() {
#ifdef LLM_AMX
  return amx::available();
#else
  return false;
#endif
}

void prompt_attention(const at::Tensor& q, at::Tensor& out, const std::vector<int64_t>& spans,
                      const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                      const std::vector<at::Tensor>& masks, double scale) {
  TORCH_CHECK(prompt_attention_amx(), "prompt_attention: needs AMX tiles (prompt_attention_amx)");
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3 &&
                  q.stride(2) == 1 && q.stride(1) == q.size(2),
              "prompt_attention: q float32 [T, H, D], each row's heads contiguous");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == at::kFloat &&
                  out.stride(2) == 1 && out.stride(1) == out.size(2),
              "prompt_attention: out float32 [T, H, D], each row's heads contiguous");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(D % 32 == 0, "prompt_attention: head size a multiple of 32, got ", D);
  const size_t P = keys.size();
  TORCH_CHECK(spans.size() == 2 * P && values.size() == P && masks.size() == P,
              "prompt_attention: (start, end), keys, values and a mask for each prompt");
#ifdef LLM_AMX
  std::vector<Prompt> prompts;
  int64_t K = 0;
  for (size_t i = 0; i < P; ++i) {
    const int64_t start = spans[2 * i], end = spans[2 * i + 1];
    TORCH_CHECK(0 <= start && start < end && end <= T, "prompt_attention: span out of range");
    const at::Tensor k = keys[i].contiguous(), v = values[i].contiguous();
    TORCH_CHECK(k.scalar_type() == at::kFloat && k.dim() == 3 && k.size(2) == D &&
                    v.sizes() == k.sizes() && v.scalar_type() == at::kFloat,
                "prompt_attention: keys and values float32 [L, K, D]");
    TORCH_CHECK(K == 0 || k.size(1) == K, "prompt_attention: every prompt's KV heads alike");
    K = k.size(1);
    TORCH_CHECK(H % K == 0, "prompt_attention: ", H, " query heads over ", K, " KV heads");
    const int64_t n = end - start, L = k.size(0);
    TORCH_CHECK(L >= n, "prompt_attention: fewer keys than queries");
    at::Tensor mask = masks[i].defined() && masks[i].numel() > 0 ? masks[i].contiguous()
                                                                 : at::Tensor();
    TORCH_CHECK(!mask.defined() || (mask.scalar_type() == at::kBool && mask.dim() == 2 &&
                                    mask.size(0) == n && mask.size(1) == L),
                "prompt_attention: mask bool [n, L]");
    prompts.push_back({start, end, k, v, mask});
  }
  if (prompts.empty()) return;
  const int64_t G = H / K;
  Job job;
  job.chunks = static_cast<int64_t>(prompts.size()) * K;
  // Not heavy (the helper stays SCHED_IDLE for it), as torch's SDPA job was: a prompt's
  // attention is short beside its projections. (Made heavy, the end-to-end cancellation tests,
  // three engines on two shared cores, failed twice in CI; why is not established.)
  float* op = out.mutable_data_ptr<float>();
  constexpr int64_t F = sizeof(float);
  const int64_t ld = out.stride(0);
  job.place = [=](int64_t c) {
    const Prompt& p = prompts[c / K];
    return Block{reinterpret_cast<char*>(op + p.start * ld + c % K * G * D), ld * F,
                 p.end - p.start, G * D * F};
  };
  job.compute = [=](int64_t c, char* dst, int64_t ld) {
    attend(q, prompts[c / K], c % K, G, static_cast<float>(scale), reinterpret_cast<float*>(dst),
           ld / F);
  };
  job.keep = {q, out};
  for (const Prompt& p : prompts) {
    job.keep.push_back(p.keys);
    job.keep.push_back(p.values);
    if (p.mask.defined()) job.keep.push_back(p.mask);
  }
  run(std::move(job));
#else
  (void)out, (void)scale;
#endif
}

}  // namespace llm

namespace {

void prompt_attention_op(const at::Tensor& q, at::Tensor out, std::vector<int64_t> spans,
                         std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                         std::vector<at::Tensor> masks, double scale) {
  llm::prompt_attention(q, out, spans, keys, values, masks, scale);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_kernels, m) {
  m.def("prompt_attention_amx() -> bool", &llm::prompt_attention_amx);
  m.def("prompt_attention(Tensor q, Tensor(a!) out, int[] spans, Tensor[] keys, Tensor[] values, "
        "Tensor[] masks, float scale) -> ()",
        &prompt_attention_op);
}
