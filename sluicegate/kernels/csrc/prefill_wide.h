// The CPU prefill kernel's AVX-512 tiles (csrc/paged_prefill.cpp picks them at run time where
// the CPU has AVX-512; compiled for avx512f by attribute, so the extension still loads on
// AVX2-only CPUs). The same tiles as the AVX2 ones on 16-float registers: a score vector holds
// 16 rows of the task (the rows padded to 16), and a value tile takes up to 64 dimensions of
// six rows at a time. Each sum runs over d (scores) or over the chunk's keys (values) in the
// same order as on AVX2; only the lanes differ.
#pragma once

#include "convert.h"
#include "dispatch.h"

#include <cstdint>

#ifdef SG_VECTOR

namespace sg::prefill {

inline Avx512Path wide_path;

constexpr int64_t kWideLanes = 16;
constexpr int64_t kWideRows = 6;

// scores[t][r0 .. r0 + 16 V) = sum over d of keys[t][d] * qt[d][r0 ..] for four keys.
template <int V>
__attribute__((target("avx512f"))) inline void wide_score_tile(const float* keys, int64_t ld_k,
                                                               const float* qt, int64_t ld_q,
                                                               int64_t D, float* scores,
                                                               int64_t ld_s) {
  __m512 acc[4][V];
#pragma GCC unroll 4
  for (int t = 0; t < 4; ++t)
#pragma GCC unroll 3
    for (int v = 0; v < V; ++v) acc[t][v] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 q[V];
#pragma GCC unroll 3
    for (int v = 0; v < V; ++v) q[v] = _mm512_loadu_ps(qt + d * ld_q + v * kWideLanes);
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      const __m512 k = _mm512_set1_ps(keys[t * ld_k + d]);
#pragma GCC unroll 3
      for (int v = 0; v < V; ++v) acc[t][v] = _mm512_fmadd_ps(k, q[v], acc[t][v]);
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < 4; ++t)
#pragma GCC unroll 3
    for (int v = 0; v < V; ++v)
      _mm512_storeu_ps(scores + t * ld_s + v * kWideLanes, acc[t][v]);
}

// Scores of the chunk's 16 keys for rows padded to ``padded`` (a multiple of 16).
__attribute__((target("avx512f"))) inline void wide_chunk_scores(const float* keys,
                                                                 const float* qt,
                                                                 int64_t padded, int64_t D,
                                                                 float* scores) {
  for (int64_t t = 0; t < 16; t += 4) {
    const float* k = keys + t * D;
    float* s = scores + t * padded;
    int64_t v = 0;
    for (; v + 3 * kWideLanes <= padded; v += 3 * kWideLanes)
      wide_score_tile<3>(k, D, qt + v, padded, D, s + v, padded);
    switch ((padded - v) / kWideLanes) {
      case 2: wide_score_tile<2>(k, D, qt + v, padded, D, s + v, padded); break;
      case 1: wide_score_tile<1>(k, D, qt + v, padded, D, s + v, padded); break;
      default: break;
    }
  }
}

// out[r][d0 .. d0 + 16 C) = out[r][..] * rescale[r] + sum over t < keys of
// p[t][r] * values[t][..] for rows [0, R) (out rows ld_o apart, p rows ld_p apart, values rows
// D apart).
template <int R, int C>
__attribute__((target("avx512f"))) void wide_value_tile(const float* p, int64_t ld_p,
                                                       const float* rescale,
                                                       const float* values, int64_t D,
                                                       int64_t keys, float* out, int64_t ld_o) {
  __m512 acc[R][C];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    const __m512 s = _mm512_set1_ps(rescale[r]);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c)
      acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(out + r * ld_o + 16 * c), s);
  }
  for (int64_t t = 0; t < keys; ++t) {
    __m512 b[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) b[c] = _mm512_loadu_ps(values + t * D + 16 * c);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(p[t * ld_p + r]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(a, b[c], acc[r][c]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + r * ld_o + 16 * c, acc[r][c]);
}

template <int C>
void wide_value_rows(const float* p, int64_t padded, const float* rescale, const float* values,
                     int64_t D, int64_t keys, int64_t rows, float* out) {
  int64_t r = 0;
  for (; r + kWideRows <= rows; r += kWideRows)
    wide_value_tile<kWideRows, C>(p + r, padded, rescale + r, values, D, keys, out + r * D, D);
  if (r < rows) {
    with_count<kWideRows - 1>(rows - r, [&](auto n) {
      wide_value_tile<decltype(n)::value, C>(p + r, padded, rescale + r, values, D, keys,
                                              out + r * D, D);
    });
  }
}

// Rows [0, rows) of out [rows][D] rescaled and given the chunk's weighted values, 64
// dimensions at a time.
inline void wide_chunk_values(const float* p, int64_t padded, const float* rescale,
                              const float* values, int64_t D, int64_t keys, int64_t rows,
                              float* out) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    with_count<4>((D - d0) / 16, [&](auto c) {
      wide_value_rows<decltype(c)::value>(p, padded, rescale, values + d0, D, keys, rows,
                                          out + d0);
    });
  }
}

}  // namespace sg::prefill

#endif  // SG_VECTOR
