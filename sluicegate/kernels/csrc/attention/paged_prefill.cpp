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
// Flash-attention order: a task is (request, KV head, tile of 16 query positions); its rows are
// the tile's positions times the query heads sharing the KV head. Keys go by 16 at a time. The
// task's queries are transposed once ([head_dim][rows]), so the scores come out key by key as
// [16 keys][rows] (each key's row broadcast against eight rows of queries at a time), and the
// online softmax (running max and sum per row, in float32) runs across rows, eight lanes at a
// time; the weighted values are then added as rows x keys x head_dim
// (csrc/attention/prefill_avx2.h). A chunk's keys and values are widened to float32 once,
// contiguously. Only key chunks a row can see are computed; the chunk on the diagonal is masked.
// On CPUs with AVX-512 the scores and weighted values take 16 rows a vector
// (csrc/attention/prefill_wide.h), and so does the online softmax, each row vector's 16 scores
// held in registers through one pass with an inline exp (the AVX2 path's three passes over the
// scores, calling glibc's vector expf, took more time there than either tile); bfloat16 queries
// over a bfloat16 cache take their scores on AVX512_BF16's dot products where the CPU has them.
// Needs AVX2 with FMA, head_dim and block_size multiples of 16: paged_prefill_supported() says
// whether a shape runs here (else the caller keeps the reference).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <type_traits>
#include <vector>

#include "convert.h"
#include "parallel_items.h"
#include "prefill_avx2.h"
#include "prefill_wide.h"

#ifdef SG_VECTOR

using namespace sg::prefill;

namespace {

struct Scratch {
  std::vector<float> qt, keys, values, scores, out, peak, total, rescale, query;
  std::vector<uint16_t> qt2, zero;  // the bfloat16 dot products' queries, a zero key row
  std::vector<int32_t> last_key;
};

}  // namespace

bool paged_prefill_supported(int64_t head_dim, int64_t block_size) {
  return head_dim % 16 == 0 && block_size % kKeys == 0;
}

bool paged_prefill_allow_avx512(bool allow) { return sg::prefill::wide_path.allow(allow); }

bool paged_prefill_allow_bf16_dots(bool allow) { return sg::prefill::pair_path.allow(allow); }

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
      // Bfloat16 queries and cache: the scores on the CPU's bfloat16 dot products, keys read
      // in place (csrc/attention/prefill_wide.h), where it has them.
      constexpr bool bf16 =
          std::is_same_v<T, c10::BFloat16> && std::is_same_v<Q, c10::BFloat16>;
      const bool pairs = bf16 && wide && sg::prefill::pair_path.on();
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
        // With the dot products, in pairs of d instead: qt2[d / 2][r][d % 2].
        if (pairs) {
          s.qt2.assign(D * padded, 0);
          s.zero.assign(D, 0);
        } else {
          s.qt.assign(D * padded, 0.0f);
        }
        s.last_key.resize(padded);
        s.query.resize(D);
        for (int64_t j = 0; j < positions; ++j) {
          const Q* src = qp + (cu[w.seq] + w.first + j) * q_stride + w.kvh * group * D;
          for (int64_t g = 0; g < group; ++g) {
            const int64_t r = j * group + g;
            s.last_key[r] = static_cast<int32_t>(offset + w.first + j);
            if (pairs) {
              sg::prefill::pair_query_row(reinterpret_cast<const uint16_t*>(src + g * D), D,
                                          padded, r, s.qt2.data());
              continue;
            }
            sg::load_row(src + g * D, s.query.data(), D);
            for (int64_t d = 0; d < D; ++d) s.qt[d * padded + r] = s.query[d];
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
            if (pairs) {
              sg::prefill::pair_chunk_scores(reinterpret_cast<const uint16_t*>(chunk_k), row,
                                             keys, s.zero.data(), s.qt2.data(), padded, D,
                                             scores);
            } else {
              sg::prefill::wide_load_rows(chunk_k, row, D, keys, keys_f);
              sg::prefill::wide_chunk_scores(keys_f, qt, padded, D, scores);
            }
            sg::prefill::wide_load_rows(chunk_v, row, D, keys, values_f);
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

bool paged_prefill_allow_bf16_dots(bool) { return false; }

void paged_prefill(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                   at::Tensor&) {
  TORCH_CHECK(false, "paged_prefill needs AVX2 and FMA");
}

#endif
