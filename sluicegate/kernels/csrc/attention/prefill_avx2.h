// The CPU prefill kernel's AVX2 tiles and online softmax (csrc/attention/paged_prefill.cpp
// runs them where the CPU lacks AVX-512, or where tests and benches turn that path off), and
// the constants both paths share: score vectors of 8 rows, value tiles of 16 dimensions by up
// to six rows.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "convert.h"

#ifdef SG_VECTOR

namespace sg::prefill {

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
inline void chunk_scores(const float* keys, const float* qt, int64_t padded, int64_t D,
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
inline void chunk_values(const float* p, int64_t padded, const float* rescale,
                         const float* values, int64_t D, int64_t keys, int64_t rows,
                         float* out) {
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
inline void scale_and_mask(float* scores, const int32_t* last_key, int32_t key, float scale,
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
inline void softmax_chunk(float* scores, int64_t padded, int64_t keys,
                          const int32_t* last_key, int32_t first_key, float scale, float* peak,
                          float* rescale, float* total) {
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

}  // namespace sg::prefill

#endif
