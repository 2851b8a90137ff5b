// What the CPU decode kernels share (csrc/attention/paged_decode.cpp,
// csrc/attention/decode_wide.h): one task per request and span of its KV heads, its cache rows
// found through per-token offsets, and the float32 softmax.
#pragma once

#include "convert.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace sg::decode {

template <typename T>
struct Task {
  const float* q;       // the span's first query head: [kv_heads * group, head_dim]
  const T* k;           // the span's first KV head's slice of the cache
  const T* v;
  const int64_t* offsets;  // each token's slot in the cache, in elements (from the table)
  int64_t len, group, head_dim;
  float scale;
  float* out;           // [kv_heads * group, head_dim]
  int64_t kv_heads;     // KV heads in the span, each with `group` query heads
};

// KV head h of a span as a task of its own (its scores start at h * group rows).
template <typename T>
inline Task<T> one_head(const Task<T>& t, int64_t h) {
  const int64_t queries = h * t.group * t.head_dim;
  return {t.q + queries, t.k + h * t.head_dim, t.v + h * t.head_dim, t.offsets, t.len,
          t.group, t.head_dim, t.scale, t.out + queries, 1};
}

template <typename T>
inline const T* slot(const T* cache, const Task<T>& t, int64_t token) {
  return cache + t.offsets[token];
}

// Each token's slot offset, block by block: the kernels read every key and value several
// times, and a division by the block size per read cost more than the arithmetic on it.
inline void slot_offsets(const int32_t* table, int64_t len, int64_t block_size, int64_t row,
                  std::vector<int64_t>& offsets) {
  offsets.resize(len);
  for (int64_t start = 0, b = 0; start < len; start += block_size, ++b) {
    const int64_t base = static_cast<int64_t>(table[b]) * block_size * row;
    const int64_t count = std::min(block_size, len - start);
    for (int64_t j = 0; j < count; ++j) offsets[start + j] = base + j * row;
  }
}

inline void softmax_rows(float* scores, int64_t rows, int64_t len) {
  for (int64_t g = 0; g < rows; ++g) {
    float* s = scores + g * len;
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
  }
}

#ifdef SG_VECTOR

// Rows fetched ahead: a request's blocks lie anywhere in the cache, so the hardware
// prefetcher loses the stream at every block boundary. 8 measured best of 4, 8 and 16
// (SmolLM2 bf16, 32 rows: the decode kernel's time a step 18.3 -> 11.5 ms).
constexpr int64_t kAhead = 8;

template <typename T>
inline void prefetch_row(const T* row, int64_t head_dim) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < head_dim * static_cast<int64_t>(sizeof(T)); b += 64)
    _mm_prefetch(bytes + b, _MM_HINT_T0);
}
#endif

}  // namespace sg::decode
