// Prefill attention on the CPU: several query tokens per request (a prompt, a chunk of one,
// the uncached tail after a prefix-cache hit), keys and values read in place through the
// block table, causal (query j of a request with q_len queries sits at absolute position
// seq_len - q_len + j and sees keys 0 .. that position).
//
// q:            [num_tokens, num_heads, head_dim] float32, bfloat16 or float16 (request i
//               owns rows cu_seqlens_q[i] .. cu_seqlens_q[i + 1]); each token's heads
//               contiguous, tokens at any stride (a view into the fused q/k/v product)
// k/v_cache:    [num_blocks, block_size, num_kv_heads, head_dim] float32, bfloat16 or
//               float16 (both alike), widened to float32 as they are read
// block_tables: [num_seqs, max_blocks] int32;  seq_lens: [num_seqs] int32
// cu_seqlens_q: [num_seqs + 1] int32;          requests: the ones to compute (int64)
// out:          [num_tokens, num_heads, head_dim] contiguous, q's dtype, written for those
//               requests' rows only (16-bit queries widened, results rounded as stored)
//
// Flash-attention order: a task is (request, KV head, tile of 16 query positions); its rows
// are the tile's positions times the query heads sharing the KV head. Keys go by 16 at a
// time. The task's queries are transposed once ([head_dim][rows]), so the scores come out
// key by key as [16 keys][rows] (each key's row broadcast against eight rows of queries at
// a time), and the online softmax (running max and sum per row, in float32) runs across
// rows, eight lanes at a time; the weighted values are then added as rows x keys x
// head_dim. A chunk's keys and values are widened to float32 once, contiguously. Only key
// chunks a row can see are computed; the chunk on the diagonal is masked. On CPUs with AVX-512
// the scores and weighted values take 16 rows a vector (csrc/attention/prefill_wide.h), and so does the
// online softmax, each row vector's 16 scores held in registers through one pass with an
// inline exp (the AVX2 path's three passes over the scores, calling glibc's vector expf, took
// more time there than either tile). Needs AVX2 with
// FMA, head_dim and block_size multiples of 16: paged_prefill_supported() says whether a
// shape runs here (else the caller keeps the reference).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <vector>

#include "convert.h"
#include "parallel_items.h"
#include "prefill_wide.h"

#ifdef SG_VECTOR

namespace {

constexpr int64_t kKeys = 16;       // keys per chunk
constexpr int64_t kPositions = 16;  // query positions per task
constexpr int64_t kLanes = 8;       // rows per score vector
constexpr int64_t kTileRows = 6;
constexpr float kMasked = -1e30f;

// exp(x) for x <= 0, and 0 below kNegligible: a masked score's weight is exactly 0, and the
// vector exp never meets an argument outside float's range (glibc's vector expf redoes such
// lanes one at a time through the scalar expf and its underflow handling).
constexpr float kNegligible = -80.0f;  // exp(-80) ~ 2e-35

#pragma omp declare simd notinbranch
inline float weight(float x) {
  const float e = std::exp(std::max(x, kNegligible));
  return x > kNegligible ? e : 0.0f;
}

// scores[t][r0 .. r0 + 8 V) = sum over d of keys[t][d] * qt[d][r0 ..], for K keys from
// ``first`` (keys and scores rows ld_k and ld_s apart; qt's rows ld_q apart). Four keys by up
// to three vectors of rows: twelve accumulators, each a sum over d in order.
template <int V>
void score_tile(const float* keys, int64_t ld_k, const float* qt, int64_t ld_q, int64_t D,
                float* scores, int64_t ld_s) {
  __m256 acc[4][V];
#pragma GCC unroll 4
  for (int t = 0; t < 4; ++t)
#pragma GCC unroll 3
    for (int v = 0; v < V; ++v) acc[t][v] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m256 q[V];
#pragma GCC unroll 3
    for (int v = 0; v < V; ++v) q[v] = _mm256_loadu_ps(qt + d * ld_q + v * kLanes);
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      const __m256 k = _mm256_broadcast_ss(keys + t * ld_k + d);
#pragma GCC unroll 3
      for (int v = 0; v < V; ++v) acc[t][v] = _mm256_fmadd_ps(k, q[v], acc[t][v]);
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < 4; ++t)
#pragma GCC unroll 3
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(scores + t * ld_s + v * kLanes, acc[t][v]);
}

// out[r][d0 .. d0 + 16) = out[r][..] * rescale[r] + sum over t < keys of p[t][r] * values[t][..]
// for rows [0, R) of the tile (out rows ld_o apart, p rows ld_p apart, values rows D apart).
#define SG_INIT(r)                                                                        \
  if constexpr (R > r) {                                                                  \
    const __m256 s = _mm256_broadcast_ss(rescale + r);                                    \
    c##r##0 = _mm256_mul_ps(_mm256_loadu_ps(out + r * ld_o), s);                          \
    c##r##1 = _mm256_mul_ps(_mm256_loadu_ps(out + r * ld_o + 8), s);                      \
  }
#define SG_ROW(r)                                                 \
  if constexpr (R > r) {                                          \
    const __m256 a = _mm256_broadcast_ss(p + t * ld_p + r);       \
    c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0);                    \
    c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1);                    \
  }
#define SG_STORE(r)                                  \
  if constexpr (R > r) {                             \
    _mm256_storeu_ps(out + r * ld_o, c##r##0);       \
    _mm256_storeu_ps(out + r * ld_o + 8, c##r##1);   \
  }
template <int R>
void value_tile(const float* p, int64_t ld_p, const float* rescale, const float* values,
                int64_t D, int64_t keys, float* out, int64_t ld_o) {
  __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
  SG_INIT(0) SG_INIT(1) SG_INIT(2) SG_INIT(3) SG_INIT(4) SG_INIT(5)
  for (int64_t t = 0; t < keys; ++t) {
    const __m256 b0 = _mm256_loadu_ps(values + t * D), b1 = _mm256_loadu_ps(values + t * D + 8);
    SG_ROW(0) SG_ROW(1) SG_ROW(2) SG_ROW(3) SG_ROW(4) SG_ROW(5)
  }
  SG_STORE(0) SG_STORE(1) SG_STORE(2) SG_STORE(3) SG_STORE(4) SG_STORE(5)
}
#undef SG_INIT
#undef SG_ROW
#undef SG_STORE

// Scores of the chunk's 16 keys (keys past the chunk's end: zero rows) for rows padded to
// ``padded`` (a multiple of 8).
void chunk_scores(const float* keys, const float* qt, int64_t padded, int64_t D,
                  float* scores) {
  for (int64_t t = 0; t < kKeys; t += 4) {
    int64_t v = 0;
    for (; v + 3 * kLanes <= padded; v += 3 * kLanes)
      score_tile<3>(keys + t * D, D, qt + v, padded, D, scores + t * padded + v, padded);
    switch ((padded - v) / kLanes) {
      case 2: score_tile<2>(keys + t * D, D, qt + v, padded, D, scores + t * padded + v, padded); break;
      case 1: score_tile<1>(keys + t * D, D, qt + v, padded, D, scores + t * padded + v, padded); break;
      default: break;
    }
  }
}

// Rows [0, rows) of out [rows][D] rescaled and given the chunk's weighted values.
void chunk_values(const float* p, int64_t padded, const float* rescale, const float* values,
                  int64_t D, int64_t keys, int64_t rows, float* out) {
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    int64_t r = 0;
    for (; r + kTileRows <= rows; r += kTileRows)
      value_tile<6>(p + r, padded, rescale + r, values + d0, D, keys, out + r * D + d0, D);
    const float* pr = p + r;
    const float* sr = rescale + r;
    float* o = out + r * D + d0;
    switch (rows - r) {
      case 5: value_tile<5>(pr, padded, sr, values + d0, D, keys, o, D); break;
      case 4: value_tile<4>(pr, padded, sr, values + d0, D, keys, o, D); break;
      case 3: value_tile<3>(pr, padded, sr, values + d0, D, keys, o, D); break;
      case 2: value_tile<2>(pr, padded, sr, values + d0, D, keys, o, D); break;
      case 1: value_tile<1>(pr, padded, sr, values + d0, D, keys, o, D); break;
      default: break;
    }
  }
}

// Each row's score of one key scaled, or kMasked past the row's last key, and the row's peak
// raised to it; rows is a multiple of 8. (Written out: as a loop, under omp simd or not, the
// compiler left it scalar, a quarter of the kernel's time outside its tiles.)
void scale_and_mask(float* scores, const int32_t* last_key, int32_t key, float scale,
                    float* peak, int64_t rows) {
  const __m256 factor = _mm256_set1_ps(scale), masked = _mm256_set1_ps(kMasked);
  const __m256i position = _mm256_set1_epi32(key);
  for (int64_t r = 0; r < rows; r += kLanes) {
    const __m256i last = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(last_key + r));
    const __m256 hidden = _mm256_castsi256_ps(_mm256_cmpgt_epi32(position, last));
    const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(scores + r), factor);
    const __m256 v = _mm256_blendv_ps(scaled, masked, hidden);
    _mm256_storeu_ps(scores + r, v);
    _mm256_storeu_ps(peak + r, _mm256_max_ps(_mm256_loadu_ps(peak + r), v));
  }
}

// A chunk's 16 keys and values widened to float32 into key_rows and value_rows ([16][D]
// each): the first ``keys`` from cache rows ``stride`` elements apart starting at k and v,
// the rest zero.
template <typename T>
void load_chunk(const T* k, const T* v, int64_t stride, int64_t D, int64_t keys,
                float* key_rows, float* value_rows) {
  for (int64_t t = 0; t < kKeys; ++t) {
    float* key = key_rows + t * D;
    float* value = value_rows + t * D;
    if (t < keys) {
      sg::load_row(k + t * stride, key, D);
      sg::load_row(v + t * stride, value, D);
    } else {
      std::fill(key, key + D, 0.0f);
      std::fill(value, value + D, 0.0f);
    }
  }
}

// The online softmax over one chunk's scores ([16 keys][padded rows]): scaled, kMasked past
// each row's last key (and for keys past the chunk's end), the row's peak raised to the
// chunk's; rescale[r] the weight of the old peak against the new, total[r] rescaled, and each
// score turned into its weight and added to total[r] in key order.
void softmax_chunk(float* scores, int64_t padded, int64_t keys, const int32_t* last_key,
                   int32_t first_key, float scale, float* peak, float* rescale, float* total) {
  std::copy(peak, peak + padded, rescale);  // the old peaks, for now
  for (int64_t t = 0; t < kKeys; ++t) {
    float* sc = scores + t * padded;
    if (t >= keys) {
      std::fill(sc, sc + padded, kMasked);
      continue;
    }
    scale_and_mask(sc, last_key, first_key + static_cast<int32_t>(t), scale, peak, padded);
  }
#pragma omp simd
  for (int64_t r = 0; r < padded; ++r) {
    rescale[r] = weight(rescale[r] - peak[r]);
    total[r] *= rescale[r];
  }
  for (int64_t t = 0; t < kKeys; ++t) {
    float* sc = scores + t * padded;
#pragma omp simd
    for (int64_t r = 0; r < padded; ++r) {
      sc[r] = weight(sc[r] - peak[r]);
      total[r] += sc[r];
    }
  }
}

struct Scratch {
  std::vector<float> qt, keys, values, scores, out, peak, total, rescale, query;
  std::vector<int32_t> last_key;
};

}  // namespace

bool paged_prefill_supported(int64_t head_dim, int64_t block_size) {
  return head_dim % 16 == 0 && block_size % kKeys == 0;
}

bool paged_prefill_allow_avx512(bool allow) { return sg::prefill::wide_path.allow(allow); }

void paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens,
                   const at::Tensor& cu_seqlens_q, const at::Tensor& requests, double scale,
                   at::Tensor& out) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_prefill runs on CPU tensors");
  TORCH_CHECK(sg::is_element(q.scalar_type()) && out.dtype() == q.dtype() &&
                  v_cache.dtype() == k_cache.dtype(),
              "paged_prefill takes float32, bfloat16 or float16 queries, output of their "
              "dtype, caches of one dtype");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "paged_prefill takes queries whose heads are contiguous within each token");
  TORCH_CHECK(block_tables.dtype() == at::kInt && seq_lens.dtype() == at::kInt &&
                  cu_seqlens_q.dtype() == at::kInt && requests.dtype() == at::kLong,
              "paged_prefill takes int32 tables, lengths and offsets, int64 requests");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{
           &k_cache, &v_cache, &block_tables, &seq_lens, &cu_seqlens_q, &requests, &out}) {
    TORCH_CHECK(t->is_contiguous(), "paged_prefill takes contiguous tensors");
  }
  const int64_t num_heads = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  TORCH_CHECK(group * num_kv_heads == num_heads, "query heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.size(3) == D && v_cache.sizes() == k_cache.sizes(),
              "cache shapes disagree with the queries");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must be shaped like q");
  TORCH_CHECK(paged_prefill_supported(D, block_size),
              "paged_prefill needs head_dim and block_size multiples of 16");

  const int64_t q_stride = q.stride(0);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  const int64_t* which = requests.data_ptr<int64_t>();
  const int64_t row = num_kv_heads * D;  // one cache slot's elements
  const float fscale = static_cast<float>(scale);
  // Masked scores (kMasked): a finite stand-in for minus infinity (-ffast-math assumes no
  // infinities); weight() turns them into exactly 0.

  // Score vectors of 16 rows on AVX-512 (csrc/attention/prefill_wide.h), else of 8.
  const bool wide = sg::prefill::wide_path.on();
  const int64_t lanes = wide ? sg::prefill::kWideLanes : kLanes;

  // Tasks: (request, KV head, tile of positions), listed once up front.
  struct Work { int64_t seq, kvh, first; };
  std::vector<Work> work;
  for (int64_t n = 0; n < requests.numel(); ++n) {
    const int64_t i = which[n];
    const int64_t q_len = cu[i + 1] - cu[i];
    TORCH_CHECK(q_len > 0 && q_len <= lens[i] && lens[i] <= max_blocks * block_size,
                "query or sequence length out of range");
    for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh)
      for (int64_t first = 0; first < q_len; first += kPositions) work.push_back({i, kvh, first});
  }

  sg::with_element(k_cache.scalar_type(), "the cache", [&](auto element) {
    sg::with_element(q.scalar_type(), "the queries", [&](auto query_element) {
      using T = decltype(element);
      using Q = decltype(query_element);
      const Q* qp = static_cast<const Q*>(q.data_ptr());
      Q* op = static_cast<Q*>(out.data_ptr());
      const T* kp = static_cast<const T*>(k_cache.data_ptr());
      const T* vp = static_cast<const T*>(v_cache.data_ptr());
      parallel_items(static_cast<int64_t>(work.size()), [&](int64_t item) {
        thread_local Scratch s;
        const Work w = work[item];
        const int64_t seq_len = lens[w.seq], q_len = cu[w.seq + 1] - cu[w.seq];
        const int64_t positions = std::min(kPositions, q_len - w.first);
        const int64_t rows = positions * group;
        const int64_t padded = (rows + lanes - 1) / lanes * lanes;
        const int64_t offset = seq_len - q_len;  // absolute position of query 0
        const int32_t* table = tables + w.seq * max_blocks;
        // The tile's queries transposed: qt[d][r], rows r = [position][group head]; padding
        // rows are zero and see every key (their scores stay finite, and are never stored).
        s.qt.assign(D * padded, 0.0f);
        s.last_key.resize(padded);
        s.query.resize(D);
        for (int64_t j = 0; j < positions; ++j) {
          const Q* src = qp + (cu[w.seq] + w.first + j) * q_stride + w.kvh * group * D;
          for (int64_t g = 0; g < group; ++g) {
            const int64_t r = j * group + g;
            sg::load_row(src + g * D, s.query.data(), D);
            for (int64_t d = 0; d < D; ++d) s.qt[d * padded + r] = s.query[d];
            s.last_key[r] = static_cast<int32_t>(offset + w.first + j);
          }
        }
        for (int64_t r = rows; r < padded; ++r) s.last_key[r] = static_cast<int32_t>(seq_len);
        s.keys.resize(kKeys * D);
        s.values.resize(kKeys * D);
        s.scores.resize(kKeys * padded);
        s.out.assign(rows * D, 0.0f);
        s.peak.assign(padded, kMasked);
        s.total.assign(padded, 0.0f);
        s.rescale.resize(padded);
        const int64_t last_visible = offset + w.first + positions - 1;
        for (int64_t k0 = 0; k0 <= last_visible; k0 += kKeys) {
          const int64_t keys = std::min(kKeys, seq_len - k0);
          const int64_t block = table[k0 / block_size];
          const int64_t slot0 = block * block_size + k0 % block_size;
          const T* chunk_k = kp + slot0 * row + w.kvh * D;
          const T* chunk_v = vp + slot0 * row + w.kvh * D;
          float* keys_f = s.keys.data();
          float* values_f = s.values.data();
          float* scores = s.scores.data();
          const float* qt = s.qt.data();
          // Every row sees key 0, so after the first chunk each row's peak is a real score.
          float* peak = s.peak.data();
          float* rescale = s.rescale.data();
          float* total = s.total.data();
          const int32_t* last_key = s.last_key.data();
          const int32_t first_key = static_cast<int32_t>(k0);
          if (wide) {
            sg::prefill::wide_load_chunk(chunk_k, chunk_v, row, D, keys, keys_f, values_f);
            sg::prefill::wide_chunk_scores(keys_f, qt, padded, D, scores);
            sg::prefill::wide_softmax(scores, padded, keys, last_key, first_key, fscale,
                                      kMasked, kNegligible, peak, rescale, total);
            sg::prefill::wide_chunk_values(scores, padded, rescale, values_f, D, keys, rows,
                                           s.out.data());
          } else {
            load_chunk(chunk_k, chunk_v, row, D, keys, keys_f, values_f);
            chunk_scores(keys_f, qt, padded, D, scores);
            softmax_chunk(scores, padded, keys, last_key, first_key, fscale, peak, rescale,
                          total);
            chunk_values(scores, padded, rescale, values_f, D, keys, rows, s.out.data());
          }
        }
        for (int64_t j = 0; j < positions; ++j) {
          for (int64_t g = 0; g < group; ++g) {
            const int64_t r = j * group + g;
            const float inv = 1.0f / s.total[r];
            float* src = s.out.data() + r * D;
    #pragma omp simd
            for (int64_t d = 0; d < D; ++d) src[d] *= inv;
            Q* dst = op + ((cu[w.seq] + w.first + j) * num_heads + w.kvh * group + g) * D;
            sg::store_row(src, dst, D);
          }
        }
      });
    });
  });
}

#else

bool paged_prefill_supported(int64_t, int64_t) { return false; }

bool paged_prefill_allow_avx512(bool) { return false; }

void paged_prefill(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                   at::Tensor&) {
  TORCH_CHECK(false, "paged_prefill needs AVX2 and FMA");
}

#endif
