// The CPU decode kernel's AVX-512 path (csrc/paged_decode.cpp picks it at run time where the
// CPU has AVX-512 and head_dim is a multiple of 16; compiled for avx512f by attribute, so the
// extension still loads on AVX2-only CPUs). Per task: scores of four keys by up to four query
// heads at a time on 16-float registers, summed across lanes four dot products at a time
// (one tree instead of four); softmax as the other paths; then every dimension of up to four
// heads (two of up to 128 dimensions) in one pass over the values.
#pragma once

#include "decode_task.h"
#include "dispatch.h"

#include <atomic>

#ifdef SG_VECTOR

namespace sg::decode {

inline std::atomic<bool> wide_allowed{true};

inline bool wide_decode() {
  static const bool supported = __builtin_cpu_supports("avx512f");
  return supported && wide_allowed.load(std::memory_order_relaxed);
}

// {sum(a), sum(b), sum(c), sum(d)}: one lane-summing tree for four dot products instead of
// four (unpack pairs within 128-bit lanes, then add the four lanes).
__attribute__((target("avx512f"))) inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  const __m512 lanes = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                     _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  const __m256 half = _mm256_add_ps(
      _mm512_castps512_ps256(lanes),
      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lanes), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// Scores of query heads [g0, g0 + G) against every key, four keys at a time.
template <int G, typename T>
__attribute__((target("avx512f"))) void wide_scores(const Task<T>& t, int64_t g0, float* scores) {
  const int64_t D = t.head_dim;
  const __m128 scale = _mm_set1_ps(t.scale);
  int64_t i = 0;
  for (; i + 4 <= t.len; i += 4) {
    const T* k[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) k[j] = slot(t.k, t, i + j);
    if (i + kAhead + 4 <= t.len) {
      for (int j = 0; j < 4; ++j) prefetch_row(slot(t.k, t, i + kAhead + j), D);
    }
    __m512 acc[G][4];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      __m512 x[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) x[j] = load16(k[j] + d);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        const __m512 q = _mm512_loadu_ps(t.q + (g0 + g) * D + d);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_fmadd_ps(q, x[j], acc[g][j]);
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      const __m128 sums = sum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
      _mm_storeu_ps(scores + (g0 + g) * t.len + i, _mm_mul_ps(sums, scale));
    }
  }
  for (; i < t.len; ++i) {
    const T* key = slot(t.k, t, i);
    __m512 acc[G];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 x = load16(key + d);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g)
        acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(t.q + (g0 + g) * D + d), x, acc[g]);
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g)
      scores[(g0 + g) * t.len + i] = _mm512_reduce_add_ps(acc[g]) * t.scale;
  }
}

// out[g0 + g][d0 .. d0 + 16 C) for query heads [g0, g0 + G): one pass over the values.
template <int G, int C, typename T>
__attribute__((target("avx512f"))) void wide_values(const Task<T>& t, int64_t g0, int64_t d0,
                                                   const float* scores) {
  const int64_t D = t.head_dim;
  __m512 acc[G][C];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < t.len; ++i) {
    const T* value = slot(t.v, t, i) + d0;
    if (i + kAhead < t.len) prefetch_row(slot(t.v, t, i + kAhead) + d0, 16 * C);
    __m512 p[G];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) p[g] = _mm512_set1_ps(scores[(g0 + g) * t.len + i]);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m512 x = load16(value + 16 * c);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) acc[g][c] = _mm512_fmadd_ps(p[g], x, acc[g][c]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(t.out + (g0 + g) * D + d0 + 16 * c, acc[g][c]);
}

// Up to four heads of at most four 16-float chunks (64 dimensions), or two of up to eight:
// 16 accumulators either way.
template <int C, typename T>
void wide_value_heads(const Task<T>& t, int64_t d0, const float* scores) {
  constexpr int kHeads = C <= 4 ? 4 : 2;
  for (int64_t g0 = 0; g0 < t.group; g0 += kHeads) {
    with_count<kHeads>(t.group - g0, [&](auto g) {
      wide_values<decltype(g)::value, C>(t, g0, d0, scores);
    });
  }
}

template <typename T>
void wide_task(const Task<T>& t, float* scores) {
  for (int64_t g0 = 0; g0 < t.group; g0 += 4) {
    with_count<4>(t.group - g0, [&](auto g) { wide_scores<decltype(g)::value>(t, g0, scores); });
  }
  softmax_rows(scores, t.group, t.len);
  for (int64_t d0 = 0; d0 < t.head_dim; d0 += 128) {
    with_count<8>((t.head_dim - d0) / 16,
                  [&](auto c) { wide_value_heads<decltype(c)::value>(t, d0, scores); });
  }
}

}  // namespace sg::decode

#endif  // SG_VECTOR
