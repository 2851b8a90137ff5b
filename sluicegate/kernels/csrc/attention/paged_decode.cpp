// Decode attention on the CPU: one query token per request, keys and values read in place
// through the block table (no gathered copy, no padding to the longest request).
//
// q:            [batch, num_heads, head_dim] float32, bfloat16 or float16; each token's heads
//               contiguous, tokens at any stride (a view into the fused q/k/v product)
// k/v_cache:    [num_blocks, block_size, num_kv_heads, head_dim] float32, bfloat16 or
//               float16 (both alike), read in place and widened to float32 in registers
// block_tables: [batch, max_blocks] int32
// seq_lens:     [batch] int32 (tokens in the cache per request, this step's included)
// returns       [batch, num_heads, head_dim] in q's dtype, contiguous
//
// 16-bit queries are widened per task and the output rounded as it is stored: the same bits
// as widening q and rounding the float32 result with torch, without the two whole-tensor
// conversions (each a parallel region of its own, which cost more than the copies).
//
// One task per request and span of its KV heads (one head on the AVX2 and scalar paths): the
// query heads sharing a KV head (GQA) read each key and value row once. Scores and softmax in
// fp32, as sluicegate/kernels/reference.py defines them.
// Where head_dim is a multiple of 8 and the compiler targets AVX2 with FMA, the dot products
// and the weighted sum of values run on 8-float registers: two keys and up to four query
// heads at a time for the scores, two query heads and 32 dimensions at a time for the
// values, so each loaded key or value vector feeds several multiply-adds. Where head_dim is a
// multiple of 16 and the CPU has AVX-512 (compiled by attribute, chosen at run time), 16-float
// registers: four keys by up to four heads for the scores, summed across lanes four at a time,
// and every dimension of up to four heads in one pass over the values.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "convert.h"
#include "decode_task.h"
#include "decode_wide.h"
#include "parallel_items.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

using sg::to_float;
using namespace sg::decode;

template <typename T>
void scalar_task(const Task<T>& t, float* scores) {
  const int64_t D = t.head_dim;
  for (int64_t i = 0; i < t.len; ++i) {
    const T* key = slot(t.k, t, i);
    for (int64_t g = 0; g < t.group; ++g) {
      const float* query = t.q + g * D;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += query[d] * to_float(key[d]);
      scores[g * t.len + i] = dot * t.scale;
    }
  }
  softmax_rows(scores, t.group, t.len);
  std::fill(t.out, t.out + t.group * D, 0.0f);
  for (int64_t i = 0; i < t.len; ++i) {
    const T* value = slot(t.v, t, i);
    for (int64_t g = 0; g < t.group; ++g) {
      const float p = scores[g * t.len + i];
      float* o = t.out + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += p * to_float(value[d]);
    }
  }
}

#ifdef SG_VECTOR
inline float hsum(__m256 x) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}

// Scores of query heads [g0, g0 + G) against keys i and i + 1 (i + 1 == len: key i twice,
// the second result dropped).
template <int G, typename T>
void score_pair(const Task<T>& t, int64_t g0, int64_t i, float* scores) {
  const int64_t D = t.head_dim;
  const T* k0 = slot(t.k, t, i);
  const bool pair = i + 1 < t.len;
  const T* k1 = pair ? slot(t.k, t, i + 1) : k0;
  if (i + kAhead + 1 < t.len) {
    prefetch_row(slot(t.k, t, i + kAhead), t.head_dim);
    prefetch_row(slot(t.k, t, i + kAhead + 1), t.head_dim);
  }
  __m256 a[2][G];
#pragma GCC unroll 4
  for (int j = 0; j < G; ++j) a[0][j] = a[1][j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 x0 = sg::load8(k0 + d), x1 = sg::load8(k1 + d);
#pragma GCC unroll 4
    for (int j = 0; j < G; ++j) {
      const __m256 qv = _mm256_loadu_ps(t.q + (g0 + j) * D + d);
      a[0][j] = _mm256_fmadd_ps(qv, x0, a[0][j]);
      a[1][j] = _mm256_fmadd_ps(qv, x1, a[1][j]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < G; ++j) {
    float* s = scores + (g0 + j) * t.len + i;
    s[0] = hsum(a[0][j]) * t.scale;
    if (pair) s[1] = hsum(a[1][j]) * t.scale;
  }
}

// out[g0 + j][d0 .. d0 + 8 C) for query heads [g0, g0 + G): the weighted sum of values.
template <int G, int C, typename T>
void weigh_values(const Task<T>& t, int64_t g0, int64_t d0, const float* scores) {
  const int64_t D = t.head_dim;
  __m256 acc[G][C];
#pragma GCC unroll 4
  for (int j = 0; j < G; ++j)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[j][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < t.len; ++i) {
    const T* value = slot(t.v, t, i) + d0;
    if (i + kAhead < t.len) {
      _mm_prefetch(reinterpret_cast<const char*>(slot(t.v, t, i + kAhead) + d0), _MM_HINT_T0);
    }
    __m256 p[G];
#pragma GCC unroll 4
    for (int j = 0; j < G; ++j) p[j] = _mm256_broadcast_ss(scores + (g0 + j) * t.len + i);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const __m256 x = sg::load8(value + 8 * c);
#pragma GCC unroll 4
      for (int j = 0; j < G; ++j) acc[j][c] = _mm256_fmadd_ps(p[j], x, acc[j][c]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < G; ++j)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(t.out + (g0 + j) * D + d0 + 8 * c, acc[j][c]);
}

template <int G, typename T>
void weigh_chunk(const Task<T>& t, int64_t g0, int64_t d0, int64_t chunks, const float* scores) {
  switch (chunks) {
    case 4: weigh_values<G, 4>(t, g0, d0, scores); break;
    case 3: weigh_values<G, 3>(t, g0, d0, scores); break;
    case 2: weigh_values<G, 2>(t, g0, d0, scores); break;
    default: weigh_values<G, 1>(t, g0, d0, scores); break;
  }
}

template <typename T>
void vector_task(const Task<T>& t, float* scores) {
  for (int64_t g0 = 0; g0 < t.group; g0 += 4) {
    const int64_t heads = std::min<int64_t>(4, t.group - g0);
    for (int64_t i = 0; i < t.len; i += 2) {
      switch (heads) {
        case 4: score_pair<4>(t, g0, i, scores); break;
        case 3: score_pair<3>(t, g0, i, scores); break;
        case 2: score_pair<2>(t, g0, i, scores); break;
        default: score_pair<1>(t, g0, i, scores); break;
      }
    }
  }
  softmax_rows(scores, t.group, t.len);
  for (int64_t g0 = 0; g0 < t.group; g0 += 2) {
    for (int64_t d0 = 0; d0 < t.head_dim; d0 += 32) {
      const int64_t chunks = std::min<int64_t>(32, t.head_dim - d0) / 8;
      if (t.group - g0 >= 2) {
        weigh_chunk<2>(t, g0, d0, chunks, scores);
      } else {
        weigh_chunk<1>(t, g0, d0, chunks, scores);
      }
    }
  }
}

#endif

template <typename T, typename Q>
void decode_all(const Q* qp, int64_t q_stride, const T* kp, const T* vp, const int32_t* tables,
                const int32_t* lens, Q* op, int64_t batch, int64_t num_heads,
                int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                float scale) {
  constexpr bool kFloat = std::is_same_v<Q, float>;
  const int64_t group = num_heads / num_kv_heads, row = num_kv_heads * head_dim;
#ifdef SG_VECTOR
  const bool vector = head_dim % 8 == 0;
  const bool wide = head_dim % 16 == 0 && wide_path.on();
#endif
  // A task takes a span of a request's KV heads (all of them where there are requests enough
  // to keep every thread busy): the wide path then reads each token's row once, whole.
  int64_t span = 1;
#ifdef SG_VECTOR
  if (wide) {
    const int64_t pieces = std::min<int64_t>(
        num_kv_heads, (8 * at::get_num_threads() + batch - 1) / batch);
    span = (num_kv_heads + pieces - 1) / pieces;
  }
#endif
  const int64_t spans = (num_kv_heads + span - 1) / span;
  parallel_items(batch * spans, [&](int64_t task) {
    thread_local std::vector<float> scores;
    thread_local std::vector<int64_t> offsets;
    thread_local std::vector<float> wide_q, wide_out;  // a 16-bit span's query and output
    const int64_t b = task / spans, h0 = task % spans * span;
    const int64_t heads = std::min(span, num_kv_heads - h0);
    const int64_t len = lens[b];
    TORCH_CHECK(len > 0 && len <= max_blocks * block_size, "sequence length out of range");
    slot_offsets(tables + b * max_blocks, len, block_size, row, offsets);
    const int64_t values = heads * group * head_dim;
    const Q* query = qp + b * q_stride + h0 * group * head_dim;
    Q* out = op + (b * num_heads + h0 * group) * head_dim;
    const float* q32;
    float* out32;
    if constexpr (kFloat) {
      q32 = query;
      out32 = out;
    } else {
      wide_q.resize(values);
      wide_out.resize(values);
      sg::load_row(query, wide_q.data(), values);
      q32 = wide_q.data();
      out32 = wide_out.data();
    }
    const Task<T> t{q32, kp + h0 * head_dim, vp + h0 * head_dim, offsets.data(), len, group,
                    head_dim, scale, out32, heads};
    scores.resize(heads * group * len);
#ifdef SG_VECTOR
    if (wide) {
      wide_task(t, scores.data());
    } else
#endif
      for (int64_t h = 0; h < heads; ++h) {
        float* head_scores = scores.data() + h * group * len;
#ifdef SG_VECTOR
        if (vector) {
          vector_task(one_head(t, h), head_scores);
          continue;
        }
#endif
        scalar_task(one_head(t, h), head_scores);
      }
    if constexpr (!kFloat) sg::store_row(out32, out, values);
  });
}

}  // namespace

bool paged_decode_allow_avx512(bool allow) {
#ifdef SG_VECTOR
  return sg::decode::wide_path.allow(allow);
#else
  return false;
#endif
}

at::Tensor paged_decode(
    const at::Tensor& q,
    const at::Tensor& k_cache,
    const at::Tensor& v_cache,
    const at::Tensor& block_tables,
    const at::Tensor& seq_lens,
    double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_decode runs on CPU tensors");
  TORCH_CHECK(sg::is_element(q.scalar_type()) && v_cache.dtype() == k_cache.dtype(),
              "paged_decode takes float32, bfloat16 or float16 queries and caches of one dtype");
  TORCH_CHECK(block_tables.dtype() == at::kInt && seq_lens.dtype() == at::kInt,
              "paged_decode takes int32 block tables and lengths");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "paged_decode takes queries whose heads are contiguous within each token");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "paged_decode takes contiguous caches, tables and lengths");
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK((num_heads / num_kv_heads) * num_kv_heads == num_heads,
              "query heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.size(3) == head_dim && v_cache.sizes() == k_cache.sizes(),
              "cache shapes disagree with the queries");

  auto out = at::empty(q.sizes(), q.options());
  sg::with_element(k_cache.scalar_type(), "the cache", [&](auto element) {
    using T = decltype(element);
    sg::with_element(q.scalar_type(), "the queries", [&](auto query_element) {
      using Q = decltype(query_element);
      decode_all(static_cast<const Q*>(q.data_ptr()), q.stride(0),
                 static_cast<const T*>(k_cache.data_ptr()),
                 static_cast<const T*>(v_cache.data_ptr()), block_tables.data_ptr<int32_t>(),
                 seq_lens.data_ptr<int32_t>(), static_cast<Q*>(out.data_ptr()), batch,
                 num_heads, num_kv_heads, head_dim, block_size, block_tables.size(1),
                 static_cast<float>(scale));
    });
  });
  return out;
}
