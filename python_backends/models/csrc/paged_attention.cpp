// Decode attention read in place from the paged KV cache (CPU).
//
// One query token per sequence attends over its context, whose keys and values sit in the
// cache's slots in any order (a sequence's blocks are scattered over the pool). The torch path
// (python_backends/models/attention.py) first copies every context into a padded batch with
// index_select and then runs scaled_dot_product_attention over the copy: three passes over the
// KV bytes. This reads each slot's keys and values once, where they are, prefetching ahead.
// Exact softmax (scores kept, maximum subtracted), float32 arithmetic for every storage dtype:
// the same math as the torch path, in another summation order. float32 caches take a vectorized
// path (vec.h: tree-summed dot products, exp sixteen scores at a time, within 2 ulp): 22 -> 14
// us for a 150-token context here; 16-bit caches convert element by element.
//
// Built and loaded by python_backends/models/kernels.py (for the machine it runs on).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "idle_helper.h"
#include "ops.h"
#include "vec.h"

namespace {

template <typename T>
inline void prefetch_row(const T* row, int64_t n) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t c = 0; c < n * static_cast<int64_t>(sizeof(T)); c += 64) __builtin_prefetch(p + c);
}

// One sequence's working memory, per thread (the caller's and the idle helper's): the scaled
// query, the scores (then their exps), the weighted values, and each head's maximum and total.
struct Scratch {
  std::vector<float> qf, scores, acc, top, total;

  template <typename T>
  void start(const T* q, int64_t H, int64_t D, int64_t n, float scale) {
    qf.resize(H * D);
    scores.resize(H * n);
    acc.assign(H * D, 0.f);
    top.assign(H, -std::numeric_limits<float>::infinity());
    total.resize(H);
    for (int64_t i = 0; i < H * D; ++i) qf[i] = static_cast<float>(q[i]) * scale;
  }

  template <typename T>
  void finish(T* o, int64_t H, int64_t D) const {
    for (int64_t h = 0; h < H; ++h) {
      const float inv = 1.f / total[h];
      for (int64_t d = 0; d < D; ++d) o[h * D + d] = static_cast<T>(acc[h * D + d] * inv);
    }
  }
};
thread_local Scratch tls;

// The arithmetic of decode_one for any storage dtype: element by element, in float32.
template <typename T>
struct Scalar {
  static constexpr int64_t kAhead = 2;  // rows prefetched ahead

  static float dot(const float* q, const T* k, int64_t D) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < D; ++d) s += q[d] * static_cast<float>(k[d]);
    return s;
  }

  static void axpy(float* a, float p, const T* v, int64_t D) {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) a[d] += p * static_cast<float>(v[d]);
  }

  // s[t] = exp(s[t] - top) for t < n; returns their sum.
  static float exps(float* s, int64_t n, float top) {
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      s[t] = std::exp(s[t] - top);
      sum += s[t];
    }
    return sum;
  }
};

// The same for float32 caches whose head size is a multiple of the vector width (vec.h):
// tree-summed dot products, exp eight or sixteen scores at a time (llm::exp_nonpositive).
struct Vectorized {
  static constexpr int64_t kAhead = 8;

  static float dot(const float* q, const float* k, int64_t D) { return llm::dot(q, k, D); }

  static void axpy(float* a, float p, const float* v, int64_t D) {
    for (int64_t d = 0; d < D; d += llm::VL)
      llm::store(a + d, llm::load(a + d) + p * llm::load(v + d));
  }

  static float exps(float* s, int64_t n, float top) {
    using llm::VL;
    const llm::vec shift = llm::vec{} + top;
    llm::vec sum = llm::vec{};
    int64_t t = 0;
    for (; t + VL <= n; t += VL) {
      const llm::vec e = llm::exp_nonpositive(llm::load(s + t) - shift);
      llm::store(s + t, e);
      sum += e;
    }
    float rest = 0.f;
    if (t < n) {  // the last few scores, through the same exp
      float lanes[VL] = {};
      std::copy(s + t, s + n, lanes);
      const llm::vec e = llm::exp_nonpositive(llm::load(lanes) - shift);
      llm::store(lanes, e);
      for (int64_t i = 0; i < n - t; ++i) {
        s[t + i] = lanes[i];
        rest += lanes[i];
      }
    }
    return llm::hsum(sum) + rest;
  }
};

// One sequence's query q [H, D] over its n context slots `row` into o [H, D]. Query head h
// reads KV head h / (H / K), as Hugging Face's repeat_kv lays them out. Each slot's keys (then
// values) are read once by every query head, which measured faster than reading one KV head's
// rows at a time.
template <typename Ops, typename T>
void decode_one(const T* q, const T* keys, const T* values, const int64_t* row, int64_t n, T* o,
                int64_t H, int64_t K, int64_t D, float scale) {
  const int64_t G = H / K, KD = K * D;
  tls.start(q, H, D, n, scale);
  auto& [qf, scores, acc, top, total] = tls;
  for (int64_t t = 0; t < n; ++t) {
    if (t + Ops::kAhead < n) prefetch_row(keys + row[t + Ops::kAhead] * KD, KD);
    const T* k = keys + row[t] * KD;
    for (int64_t h = 0; h < H; ++h) {
      const float s = Ops::dot(qf.data() + h * D, k + (h / G) * D, D);
      scores[h * n + t] = s;
      top[h] = std::max(top[h], s);
    }
  }
  for (int64_t h = 0; h < H; ++h) total[h] = Ops::exps(scores.data() + h * n, n, top[h]);
  for (int64_t t = 0; t < n; ++t) {
    if (t + Ops::kAhead < n) prefetch_row(values + row[t + Ops::kAhead] * KD, KD);
    const T* v = values + row[t] * KD;
    for (int64_t h = 0; h < H; ++h)
      Ops::axpy(acc.data() + h * D, scores[h * n + t], v + (h / G) * D, D);
  }
  tls.finish(o, H, D);
}

// decode_one<Vectorized> with each query head's vectors and sums in registers: for one KV head
// at a time, up to HG of the query heads that read it pass over its rows together (each key and
// value row loaded once for them), holding the query (then the weighted values) in DV vectors
// each. The same operations in the same order as decode_one<Vectorized>, so the same results
// bit for bit, in about half the time a row (docs/benchmarks.md).
template <int DV, int HG>
void decode_heads(const float* q, const float* keys, const float* values, const int64_t* row,
                  int64_t n, float* o, int64_t H, int64_t K, float scale) {
  using llm::vec;
  constexpr int64_t D = DV * llm::VL, kAhead = Vectorized::kAhead;
  const int64_t G = H / K, KD = K * D;
  auto& s = tls;
  s.scores.resize(H * n);
  for (int64_t kh = 0; kh < K; ++kh) {
    for (int64_t h0 = kh * G; h0 < (kh + 1) * G; h0 += HG) {
      const int m = static_cast<int>(std::min<int64_t>(HG, (kh + 1) * G - h0));
      vec qv[HG][DV], acc[HG][DV];
      float top[HG];
      for (int g = 0; g < HG; ++g) {
        top[g] = -std::numeric_limits<float>::infinity();
        for (int i = 0; i < DV; ++i) {
          qv[g][i] = g < m ? llm::load(q + (h0 + g) * D + i * llm::VL) * scale : vec{};
          acc[g][i] = vec{};
        }
      }
      // Slot t's row of this KV head from `base` (keys or values), prefetching kAhead on.
      auto load_row = [&](const float* base, int64_t t, vec(&out)[DV]) {
        if (t + kAhead < n) prefetch_row(base + row[t + kAhead] * KD + kh * D, D);
        const float* r = base + row[t] * KD + kh * D;
        for (int i = 0; i < DV; ++i) out[i] = llm::load(r + i * llm::VL);
      };
      for (int64_t t = 0; t < n; ++t) {
        vec kv[DV];
        load_row(keys, t, kv);
        for (int g = 0; g < HG; ++g) {
          if (g >= m) break;
          vec a = vec{};
          for (int i = 0; i < DV; ++i) a += qv[g][i] * kv[i];
          const float score = llm::hsum(a);
          s.scores[(h0 + g) * n + t] = score;
          top[g] = std::max(top[g], score);
        }
      }
      float total[HG];
      for (int g = 0; g < m; ++g)
        total[g] = Vectorized::exps(s.scores.data() + (h0 + g) * n, n, top[g]);
      for (int64_t t = 0; t < n; ++t) {
        vec vv[DV];
        load_row(values, t, vv);
        for (int g = 0; g < HG; ++g) {
          if (g >= m) break;
          const float p = s.scores[(h0 + g) * n + t];
          for (int i = 0; i < DV; ++i) acc[g][i] = acc[g][i] + p * vv[i];
        }
      }
      for (int g = 0; g < m; ++g) {
        const float inv = 1.f / total[g];
        for (int i = 0; i < DV; ++i) llm::store(o + (h0 + g) * D + i * llm::VL, acc[g][i] * inv);
      }
    }
  }
}

template <typename T>
inline void decode_seq(const T* q, const T* keys, const T* values, const int64_t* row, int64_t n,
                       T* o, int64_t H, int64_t K, int64_t D, float scale) {
  if constexpr (std::is_same_v<T, float>) {
    if (D == 4 * llm::VL) return decode_heads<4, 4>(q, keys, values, row, n, o, H, K, scale);
    if (D == 8 * llm::VL) return decode_heads<8, 2>(q, keys, values, row, n, o, H, K, scale);
    if (D % llm::VL == 0)
      return decode_one<Vectorized>(q, keys, values, row, n, o, H, K, D, scale);
  }
  decode_one<Scalar<T>>(q, keys, values, row, n, o, H, K, D, scale);
}

// q: [B, H, D]; cache: [2, S, K, D]; slots: [B, L] (row b's first lens[b] are its context, in
// order); lens: [B]; out: [B, H, D]. An engine of several torch threads splits the sequences
// over them; one of a single thread shares them with the idle-CPU helper (idle_helper.h), a
// sequence per chunk.
template <typename T>
void decode(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& slots,
            const at::Tensor& lens, const at::Tensor& out, float scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), S = cache.size(1), K = cache.size(2),
                L = slots.size(1), HD = H * D;
  const T* qp = q.const_data_ptr<T>();
  const T* keys = cache.const_data_ptr<T>();
  const T* values = keys + S * K * D;
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  const int64_t* lp = lens.const_data_ptr<int64_t>();
  T* op = out.mutable_data_ptr<T>();
  if (at::get_num_threads() > 1) {
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        decode_seq(qp + b * HD, keys, values, sp + b * L, lp[b], op + b * HD, H, K, D, scale);
      }
    });
    return;
  }
  llm::Job job;
  job.chunks = B;
  job.place = [=](int64_t b) {
    return llm::Block{reinterpret_cast<char*>(op + b * HD), 0, 1,
                      static_cast<int64_t>(HD * sizeof(T))};
  };
  job.compute = [=](int64_t b, char* dst, int64_t) {
    decode_seq(qp + b * HD, keys, values, sp + b * L, lp[b], reinterpret_cast<T*>(dst), H, K, D,
               scale);
  };
  job.keep = {q, cache, slots, lens, out};
  llm::run(std::move(job));
}

}  // namespace

namespace llm {

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& cache,
                                  const at::Tensor& slots, const at::Tensor& lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 4 && cache.size(0) == 2, "q [B, H, D], cache [2, S, K, D]");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "q and cache differ in dtype");
  TORCH_CHECK(q.is_contiguous() && cache.is_contiguous() && slots.is_contiguous() && lens.is_contiguous(),
              "contiguous tensors only");
  TORCH_CHECK(slots.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "int64 slots and lens");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), S = cache.size(1), K = cache.size(2);
  TORCH_CHECK(cache.size(3) == D && H % K == 0, "head sizes do not match");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == B && lens.numel() == B, "one slots row and length per query");
  const int64_t L = slots.size(1);
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= L, "context length out of range");
    for (int64_t t = 0; t < lp[b]; ++t) TORCH_CHECK(sp[b * L + t] >= 0 && sp[b * L + t] < S, "slot out of range");
  }
  at::Tensor out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode<scalar_t>(q, cache, slots, lens, out, static_cast<float>(scale));
  });
  return out;
}

}  // namespace llm

TORCH_LIBRARY(llm_kernels, m) {
  m.def("paged_decode_attention(Tensor q, Tensor cache, Tensor slots, Tensor lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_kernels, CPU, m) { m.impl("paged_decode_attention", &llm::paged_decode_attention); }
