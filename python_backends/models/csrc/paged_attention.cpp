// Decode attention read in place from the paged KV cache (CPU).
//
// One query token per sequence attends over its context, whose keys and values sit in the
// cache's slots in any order (a sequence's blocks are scattered over the pool). The torch path
// (python_backends/models/attention.py) first copies every context into a padded batch with
// index_select and then runs scaled_dot_product_attention over the copy: three passes over the
// KV bytes. This reads each slot's keys and values once, where they are, prefetching the slot
// two ahead. Exact softmax (scores kept, maximum subtracted), float32 arithmetic for every
// storage dtype: the same math as the torch path, in another summation order.
//
// Built and loaded by python_backends/models/kernels.py (for the machine it runs on).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline void prefetch_row(const T* row, int64_t n) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t c = 0; c < n * static_cast<int64_t>(sizeof(T)); c += 64) __builtin_prefetch(p + c);
}

// q: [B, H, D]; cache: [2, S, K, D]; slots: [B, L] (row b's first lens[b] are its context, in
// order); lens: [B]. Returns [B, H, D]. Query head h reads KV head h / (H / K), as Hugging
// Face's repeat_kv lays them out.
template <typename T>
void decode(const T* q, const T* cache, const int64_t* slots, const int64_t* lens, T* out,
            int64_t B, int64_t H, int64_t K, int64_t D, int64_t S, int64_t L, float scale) {
  const int64_t G = H / K, KD = K * D;
  const T* keys = cache;
  const T* values = cache + S * KD;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), scores(H * L), acc(H * D), top(H), total(H);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = lens[b];
      const int64_t* row = slots + b * L;
      for (int64_t i = 0; i < H * D; ++i) qf[i] = static_cast<float>(q[b * H * D + i]) * scale;
      std::fill(top.begin(), top.end(), -std::numeric_limits<float>::infinity());
      for (int64_t t = 0; t < n; ++t) {
        if (t + 2 < n) prefetch_row(keys + row[t + 2] * KD, KD);
        const T* k = keys + row[t] * KD;
        for (int64_t h = 0; h < H; ++h) {
          const float* qh = qf.data() + h * D;
          const T* kh = k + (h / G) * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qh[d] * static_cast<float>(kh[d]);
          scores[h * L + t] = s;
          top[h] = std::max(top[h], s);
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        float* sh = scores.data() + h * L;
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) {
          sh[t] = std::exp(sh[t] - top[h]);
          sum += sh[t];
        }
        total[h] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {
        if (t + 2 < n) prefetch_row(values + row[t + 2] * KD, KD);
        const T* v = values + row[t] * KD;
        for (int64_t h = 0; h < H; ++h) {
          const float p = scores[h * L + t];
          const T* vh = v + (h / G) * D;
          float* a = acc.data() + h * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * static_cast<float>(vh[d]);
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        const float inv = 1.f / total[h];
        T* o = out + (b * H + h) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[h * D + d] * inv);
      }
    }
  });
}

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
    decode<scalar_t>(q.const_data_ptr<scalar_t>(), cache.const_data_ptr<scalar_t>(), sp, lp,
                     out.mutable_data_ptr<scalar_t>(), B, H, K, D, S, L, static_cast<float>(scale));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(llm_kernels, m) {
  m.def("paged_decode_attention(Tensor q, Tensor cache, Tensor slots, Tensor lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_kernels, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
