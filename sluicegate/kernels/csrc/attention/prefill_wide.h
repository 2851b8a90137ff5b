// The CPU prefill kernel's AVX-512 tiles (csrc/attention/paged_prefill.cpp picks them at run time
// where the CPU has AVX-512; compiled for avx512f by attribute, so the extension still loads on
// AVX2-only CPUs). The same tiles as the AVX2 ones on 16-float registers: a score vector holds 16
// rows of the task (the rows padded to 16), and a value tile takes up to 64 dimensions of six rows
// at a time. Each sum runs over d (scores) or over the chunk's keys (values) in the same order as
// on AVX2; only the lanes differ. The chunk's widening and its online softmax run here too, 16
// lanes at a time; the softmax's exp is exp16's polynomial, not glibc's expf, so weights may differ
// from the AVX2 path's in their last bit. Bfloat16 queries and cache on a CPU with AVX512_BF16 take
// their scores on its dot products instead: keys read in place, two products of d a step, on an
// AMD EPYC with a 256-bit datapath twice the float32 FMAs' rate (bench/cpu_prefill.py).
#pragma once

#include "convert.h"
#include "dispatch.h"
#include "exp16.h"

#include <cstdint>
#include <cstring>

#ifdef SG_VECTOR

namespace sg::prefill {

inline Avx512Path wide_path;
inline KernelPath<Bf16Dots> pair_path;

constexpr int64_t kWideLanes = 16;
constexpr int64_t kWideRows = 6;

// ``count`` cache rows ``stride`` elements apart from ``src`` widened to float32 into
// ``rows`` ([16][D], D a multiple of 16), the rest of the 16 zero.
template <typename T>
__attribute__((target("avx512f"))) inline void wide_load_rows(const T* src, int64_t stride,
                                                              int64_t D, int64_t count,
                                                              float* rows) {
  for (int64_t t = 0; t < 16; ++t) {
    float* row = rows + t * D;
    for (int64_t d = 0; d < D; d += kWideLanes)
      _mm512_storeu_ps(row + d, t < count ? load16(src + t * stride + d) : _mm512_setzero_ps());
  }
}

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

// Row r's D bfloat16 queries into qt2 ([D / 2][padded rows][2]: pairs of d, as the dot
// products take them).
inline void pair_query_row(const uint16_t* src, int64_t D, int64_t padded, int64_t r,
                           uint16_t* qt2) {
  for (int64_t d = 0; d < D; ++d) qt2[((d / 2) * padded + r) * 2 + d % 2] = src[d];
}

// The same scores on AVX512_BF16's dot products, for bfloat16 queries and cache: qt2 holds
// the queries in pairs of d ([D / 2][padded rows][2] bfloat16), and each key's pair of d is
// broadcast against 16 rows' pairs. Nothing is rounded (both sides are bfloat16 already, the
// products exact in float32); the sum runs over pairs of d, two products a step, so a score
// may differ from the float32 tiles' in its last bits.
#define SG_PAIRS_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

template <int V>
SG_PAIRS_TARGET inline void pair_score_tile(const uint16_t* const* keys, const uint16_t* qt2,
                                            int64_t padded, int64_t D, float* scores) {
  __m512 acc[4][V];
#pragma GCC unroll 4
  for (int t = 0; t < 4; ++t)
#pragma GCC unroll 3
    for (int v = 0; v < V; ++v) acc[t][v] = _mm512_setzero_ps();
  for (int64_t pair = 0; pair < D / 2; ++pair) {
    __m512bh q[V];
#pragma GCC unroll 3
    for (int v = 0; v < V; ++v)
      q[v] = (__m512bh)_mm512_loadu_si512(qt2 + (pair * padded + v * kWideLanes) * 2);
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      int32_t both;
      std::memcpy(&both, keys[t] + 2 * pair, sizeof(both));
      const __m512bh k = (__m512bh)_mm512_set1_epi32(both);
#pragma GCC unroll 3
      for (int v = 0; v < V; ++v) acc[t][v] = _mm512_dpbf16_ps(acc[t][v], k, q[v]);
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < 4; ++t)
#pragma GCC unroll 3
    for (int v = 0; v < V; ++v)
      _mm512_storeu_ps(scores + t * padded + v * kWideLanes, acc[t][v]);
}

// Scores of a chunk's 16 keys read in place (cache rows ``stride`` elements apart; keys past
// ``keys`` read from ``zero``, a zero row of D) for rows padded to ``padded`` (a multiple of
// 16).
SG_PAIRS_TARGET inline void pair_chunk_scores(const uint16_t* k, int64_t stride, int64_t keys,
                                              const uint16_t* zero, const uint16_t* qt2,
                                              int64_t padded, int64_t D, float* scores) {
  for (int64_t t = 0; t < 16; t += 4) {
    const uint16_t* rows[4];
    for (int64_t i = 0; i < 4; ++i) rows[i] = t + i < keys ? k + (t + i) * stride : zero;
    float* s = scores + t * padded;
    int64_t v = 0;
    for (; v + 3 * kWideLanes <= padded; v += 3 * kWideLanes)
      pair_score_tile<3>(rows, qt2 + v * 2, padded, D, s + v);
    switch ((padded - v) / kWideLanes) {
      case 2: pair_score_tile<2>(rows, qt2 + v * 2, padded, D, s + v); break;
      case 1: pair_score_tile<1>(rows, qt2 + v * 2, padded, D, s + v); break;
      default: break;
    }
  }
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

// The online softmax over one chunk's scores ([16 keys][padded rows], padded a multiple of
// 16), the AVX2 path's steps on 16 rows at a time with each row's scores held in registers:
// scaled, ``masked`` past the row's last key, the row's peak raised to the chunk's; then
// rescale[r] the weight of the old peak against the new one, total[r] rescaled, and each of
// the chunk's first ``keys`` scores turned into its weight and added to total[r] in key order.
// A weight is exp(x - peak), 0 at or below ``negligible``. Scores of keys past the chunk's end
// are left as they are: the value tiles read only the first ``keys``.
__attribute__((target("avx512f"))) inline void wide_softmax(float* scores, int64_t padded,
                                                            int64_t keys,
                                                            const int32_t* last_key,
                                                            int32_t first_key, float scale,
                                                            float masked, float negligible,
                                                            float* peak, float* rescale,
                                                            float* total) {
  const __m512 factor = _mm512_set1_ps(scale), hidden_score = _mm512_set1_ps(masked);
  const __m512 floor = _mm512_set1_ps(negligible);
  const auto weight = [&](__m512 x) __attribute__((target("avx512f"))) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, floor, _CMP_GT_OQ),
                               exp16(_mm512_max_ps(x, floor)));
  };
  for (int64_t r = 0; r < padded; r += kWideLanes) {
    const __m512i last = _mm512_loadu_si512(last_key + r);
    const __m512 old_peak = _mm512_loadu_ps(peak + r);
    __m512 top = old_peak;
    __m512 s[16];
#pragma GCC unroll 16
    for (int64_t t = 0; t < 16; ++t) {
      if (t >= keys) break;
      const __mmask16 hidden = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(first_key + t), last);
      s[t] = _mm512_mask_blend_ps(hidden, _mm512_mul_ps(_mm512_loadu_ps(scores + t * padded + r),
                                                        factor),
                                  hidden_score);
      top = _mm512_max_ps(top, s[t]);
    }
    const __m512 kept = weight(_mm512_sub_ps(old_peak, top));
    __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(total + r), kept);
#pragma GCC unroll 16
    for (int64_t t = 0; t < 16; ++t) {
      if (t >= keys) break;
      const __m512 w = weight(_mm512_sub_ps(s[t], top));
      _mm512_storeu_ps(scores + t * padded + r, w);
      sum = _mm512_add_ps(sum, w);
    }
    _mm512_storeu_ps(peak + r, top);
    _mm512_storeu_ps(rescale + r, kept);
    _mm512_storeu_ps(total + r, sum);
  }
}

}  // namespace sg::prefill

#endif  // SG_VECTOR
