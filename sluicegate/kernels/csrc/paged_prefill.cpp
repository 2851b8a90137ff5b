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
// time: scores = rows x keys as a register-tiled product (the keys transposed once per
// 16), an online softmax (running max and sum per row, in float32), then the weighted
// values added the same way. Only key chunks a row can see are computed; the chunk on the
// diagonal is masked. Needs AVX2 with FMA, head_dim and block_size multiples of 16:
// paged_prefill_supported() says whether a shape runs here (else the caller keeps the
// reference).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <vector>

#include "convert.h"
#include "parallel_items.h"

#ifdef SG_VECTOR

namespace {

constexpr int64_t kKeys = 16;       // keys per chunk: two 8-float vectors of scores
constexpr int64_t kPositions = 16;  // query positions per task
constexpr int64_t kTileRows = 6;
constexpr float kMasked = -1e30f;

// C[0..R)[0..16) (+)= A[0..R)[0..K) x B[0..K)[0..16), B's rows ldb apart (B float32, or
// a 16-bit cache's values widened as they are loaded). Named accumulators (an array of
// them, GCC keeps in memory).
#define SG_INIT(r)                                                                       \
  if constexpr (R > r) {                                                                 \
    c##r##0 = Accumulate ? _mm256_loadu_ps(C + r * ldc) : _mm256_setzero_ps();           \
    c##r##1 = Accumulate ? _mm256_loadu_ps(C + r * ldc + 8) : _mm256_setzero_ps();       \
  }
#define SG_ROW(r)                                                 \
  if constexpr (R > r) {                                          \
    const __m256 a = _mm256_broadcast_ss(A + r * lda + k);        \
    c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0);                    \
    c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1);                    \
  }
#define SG_STORE(r)                                  \
  if constexpr (R > r) {                             \
    _mm256_storeu_ps(C + r * ldc, c##r##0);          \
    _mm256_storeu_ps(C + r * ldc + 8, c##r##1);      \
  }
template <int R, bool Accumulate, typename TB>
void tile(const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t K, float* C,
          int64_t ldc) {
  __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
  SG_INIT(0) SG_INIT(1) SG_INIT(2) SG_INIT(3) SG_INIT(4) SG_INIT(5)
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = sg::load8(B + k * ldb), b1 = sg::load8(B + k * ldb + 8);
    SG_ROW(0) SG_ROW(1) SG_ROW(2) SG_ROW(3) SG_ROW(4) SG_ROW(5)
  }
  SG_STORE(0) SG_STORE(1) SG_STORE(2) SG_STORE(3) SG_STORE(4) SG_STORE(5)
}
#undef SG_INIT
#undef SG_ROW
#undef SG_STORE

template <bool Accumulate, typename TB>
void product(const float* A, int64_t lda, int64_t rows, const TB* B, int64_t ldb, int64_t K,
             float* C, int64_t ldc) {
  int64_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows)
    tile<6, Accumulate>(A + r * lda, lda, B, ldb, K, C + r * ldc, ldc);
  const float* a = A + r * lda;
  float* c = C + r * ldc;
  switch (rows - r) {
    case 5: tile<5, Accumulate>(a, lda, B, ldb, K, c, ldc); break;
    case 4: tile<4, Accumulate>(a, lda, B, ldb, K, c, ldc); break;
    case 3: tile<3, Accumulate>(a, lda, B, ldb, K, c, ldc); break;
    case 2: tile<2, Accumulate>(a, lda, B, ldb, K, c, ldc); break;
    case 1: tile<1, Accumulate>(a, lda, B, ldb, K, c, ldc); break;
    default: break;
  }
}

struct Scratch {
  std::vector<float> q, keys_t, scores, out, peak, total;
};

}  // namespace

bool paged_prefill_supported(int64_t head_dim, int64_t block_size) {
  return head_dim % 16 == 0 && block_size % kKeys == 0;
}

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
  // Masked scores: a finite stand-in for minus infinity (-ffast-math assumes no infinities).
  // exp(masked - a real score) is 0; a row whose peak is still `masked` has seen no key.

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
        const int64_t offset = seq_len - q_len;  // absolute position of query 0
        const int32_t* table = tables + w.seq * max_blocks;
        s.q.resize(rows * D);
        s.keys_t.resize(D * kKeys);
        s.scores.resize(rows * kKeys);
        s.out.assign(rows * D, 0.0f);
        s.peak.assign(rows, kMasked);
        s.total.assign(rows, 0.0f);
        // The tile's queries as rows [position][group head], contiguous.
        for (int64_t j = 0; j < positions; ++j) {
          const Q* src = qp + (cu[w.seq] + w.first + j) * q_stride + w.kvh * group * D;
          sg::load_row(src, s.q.data() + j * group * D, group * D);
        }
        const int64_t last_visible = offset + w.first + positions - 1;
        for (int64_t k0 = 0; k0 <= last_visible; k0 += kKeys) {
          const int64_t keys = std::min(kKeys, seq_len - k0);
          const int64_t block = table[k0 / block_size];
          const int64_t slot0 = block * block_size + k0 % block_size;
          const T* kbase = kp + slot0 * row + w.kvh * D;
          const T* vbase = vp + slot0 * row + w.kvh * D;
          // Keys transposed to [D][16] (missing keys of a short last chunk are zero).
          for (int64_t t = 0; t < kKeys; ++t) {
            if (t < keys) {
              const T* key = kbase + t * row;
              for (int64_t d = 0; d < D; ++d) s.keys_t[d * kKeys + t] = sg::to_float(key[d]);
            } else {
              for (int64_t d = 0; d < D; ++d) s.keys_t[d * kKeys + t] = 0.0f;
            }
          }
          product<false>(s.q.data(), D, rows, s.keys_t.data(), kKeys, D, s.scores.data(), kKeys);
          const bool diagonal = k0 + kKeys - 1 > offset + w.first;  // some row cannot see a key
          for (int64_t r = 0; r < rows; ++r) {
            float* sc = s.scores.data() + r * kKeys;
            const int64_t visible = diagonal ? std::min<int64_t>(
                                                   keys, offset + w.first + r / group - k0 + 1)
                                             : keys;
            float chunk_peak = kMasked;
            for (int64_t t = 0; t < kKeys; ++t) {
              sc[t] = t < visible ? sc[t] * fscale : kMasked;
              chunk_peak = std::max(chunk_peak, sc[t]);
            }
            const float peak = std::max(s.peak[r], chunk_peak);
            if (peak <= kMasked) {  // nothing visible yet in this row
              std::fill(sc, sc + kKeys, 0.0f);
              continue;
            }
            const float rescale = std::exp(s.peak[r] - peak);
            float sum = 0.0f;
    #pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < kKeys; ++t) {
              sc[t] = std::exp(sc[t] - peak);
              sum += sc[t];
            }
            s.total[r] = s.total[r] * rescale + sum;
            s.peak[r] = peak;
            if (rescale != 1.0f) {
              float* o = s.out.data() + r * D;
    #pragma omp simd
              for (int64_t d = 0; d < D; ++d) o[d] *= rescale;
            }
          }
          // Weighted values: out[rows][D] += P[rows][16 keys] x V[16 keys][D], 16 columns of D
          // at a time (a short chunk's missing keys have weight 0; their rows are not read).
          for (int64_t d0 = 0; d0 < D; d0 += 16) {
            product<true>(s.scores.data(), kKeys, rows, vbase + d0, row, keys,
                          s.out.data() + d0, D);
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

void paged_prefill(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                   at::Tensor&) {
  TORCH_CHECK(false, "paged_prefill needs AVX2 and FMA");
}

#endif
