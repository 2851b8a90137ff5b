// Decode attention on the CPU: one query token per request, keys and values read in place
// through the block table (no gathered copy, no padding to the longest request).
//
// q:            [batch, num_heads, head_dim] float32
// k/v_cache:    [num_blocks, block_size, num_kv_heads, head_dim] float32
// block_tables: [batch, max_blocks] int32
// seq_lens:     [batch] int32 (tokens in the cache per request, this step's included)
// returns       [batch, num_heads, head_dim] float32
//
// One task per (request, KV head): the query heads sharing that KV head (GQA) read each key
// and value row once. Scores and softmax in fp32, as kernels/reference.py defines them.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

torch::Tensor paged_decode(
    const torch::Tensor& q,
    const torch::Tensor& k_cache,
    const torch::Tensor& v_cache,
    const torch::Tensor& block_tables,
    const torch::Tensor& seq_lens,
    double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_decode runs on CPU tensors");
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
                  v_cache.dtype() == torch::kFloat32,
              "paged_decode takes float32 queries and caches");
  TORCH_CHECK(block_tables.dtype() == torch::kInt32 && seq_lens.dtype() == torch::kInt32,
              "paged_decode takes int32 block tables and lengths");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "paged_decode takes contiguous tensors");
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  TORCH_CHECK(group * num_kv_heads == num_heads, "query heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.size(3) == head_dim && v_cache.sizes() == k_cache.sizes(),
              "cache shapes disagree with the queries");

  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const int64_t row = num_kv_heads * head_dim;  // one cache slot's floats
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_kv_heads, kvh = task % num_kv_heads;
      const int64_t len = lens[b];
      TORCH_CHECK(len > 0 && len <= max_blocks * block_size, "sequence length out of range");
      const int32_t* table = tables + b * max_blocks;
      const float* qg = qp + (b * num_heads + kvh * group) * head_dim;
      float* og = op + (b * num_heads + kvh * group) * head_dim;
      scores.assign(group * len, 0.0f);
      // Block by block: a slot's address without a division per token.
      for (int64_t first = 0; first < len; first += block_size) {
        const float* keys = kp + int64_t(table[first / block_size]) * block_size * row;
        const int64_t count = std::min(block_size, len - first);
        for (int64_t i = 0; i < count; ++i) {
          const float* key = keys + i * row + kvh * head_dim;
          for (int64_t g = 0; g < group; ++g) {
            const float* query = qg + g * head_dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += query[d] * key[d];
            scores[g * len + first + i] = dot * fscale;
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        const float peak = *std::max_element(s, s + len);
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < len; ++t) {
          s[t] = std::exp(s[t] - peak);
          total += s[t];
        }
        const float inv = 1.0f / total;
#pragma omp simd
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
        std::fill(og + g * head_dim, og + (g + 1) * head_dim, 0.0f);
      }
      for (int64_t first = 0; first < len; first += block_size) {
        const float* values = vp + int64_t(table[first / block_size]) * block_size * row;
        const int64_t count = std::min(block_size, len - first);
        for (int64_t i = 0; i < count; ++i) {
          const float* value = values + i * row + kvh * head_dim;
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * len + first + i];
            float* o = og + g * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) o[d] += p * value[d];
          }
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Decode attention read through block tables (CPU)");
}
