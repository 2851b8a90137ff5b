// The CPU decode kernel's AVX-512 path (csrc/attention/paged_decode.cpp picks it at run time where
// the CPU has AVX-512 and head_dim is a multiple of 16; compiled for avx512f by attribute, so the
// extension still loads on AVX2-only CPUs). Per task (a request's span of KV heads): scores of four
// keys by up to four query heads at a time on 16-float registers, summed across lanes four dot
// products at a time (one tree instead of four); softmax as the other paths; then every dimension
// of up to four heads (two of up to 128 dimensions), 16 rows of values at a time. Both passes take
// every head of the span from a token's row before the next rows.
#pragma once

#include "decode_task.h"
#include "dispatch.h"

#ifdef SG_VECTOR

namespace sg::decode {

inline Avx512Path wide_path;

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

// Scores of KV head h's query heads [g0, g0 + G) against the four keys in `rows` (each a span
// row: the span's first KV head's slot of a token), stored at key i.
template <int G, typename T>
__attribute__((target("avx512f"))) inline void score_tile(const Task<T>& t, int64_t h,
                                                          int64_t g0, const T* const* rows,
                                                          int64_t i, float* scores) {
  const int64_t D = t.head_dim, first = h * t.group + g0;
  __m512 acc[G][4];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    __m512 x[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) x[j] = load16(rows[j] + h * D + d);
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      const __m512 q = _mm512_loadu_ps(t.q + (first + g) * D + d);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_fmadd_ps(q, x[j], acc[g][j]);
    }
  }
  const __m128 scale = _mm_set1_ps(t.scale);
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
    const __m128 sums = sum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
    _mm_storeu_ps(scores + (first + g) * t.len + i, _mm_mul_ps(sums, scale));
  }
}

// The same for one key (the last len % 4).
template <int G, typename T>
__attribute__((target("avx512f"))) inline void score_one(const Task<T>& t, int64_t h, int64_t g0,
                                                         const T* row, int64_t i,
                                                         float* scores) {
  const int64_t D = t.head_dim, first = h * t.group + g0;
  __m512 acc[G];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 x = load16(row + h * D + d);
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g)
      acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(t.q + (first + g) * D + d), x, acc[g]);
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
    scores[(first + g) * t.len + i] = _mm512_reduce_add_ps(acc[g]) * t.scale;
}

// Scores of every query head of the span against every key, four keys at a time, each tile
// taking all the span's heads before the next: a token's row of the span is read once,
// whole, and the rows ahead are fetched whole. (Head by head, each pass read a strided part of
// every row: 26 against 38 GB/s for the same bytes on a 2-vCPU Xeon, a C loop over
// SmolLM2's cache.)
template <typename T>
__attribute__((target("avx512f"))) void wide_scores(const Task<T>& t, float* scores) {
  const int64_t row = t.kv_heads * t.head_dim;
  for (int64_t i = 0; i < kAhead && i < t.len; ++i) prefetch_row(slot(t.k, t, i), row);
  int64_t i = 0;
  for (; i + 4 <= t.len; i += 4) {
    const T* rows[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) rows[j] = slot(t.k, t, i + j);
    if (i + kAhead + 4 <= t.len) {
      for (int j = 0; j < 4; ++j) prefetch_row(slot(t.k, t, i + kAhead + j), row);
    }
    for (int64_t h = 0; h < t.kv_heads; ++h) {
      for (int64_t g0 = 0; g0 < t.group; g0 += 4) {
        switch (std::min<int64_t>(4, t.group - g0)) {
          case 4: score_tile<4>(t, h, g0, rows, i, scores); break;
          case 3: score_tile<3>(t, h, g0, rows, i, scores); break;
          case 2: score_tile<2>(t, h, g0, rows, i, scores); break;
          default: score_tile<1>(t, h, g0, rows, i, scores); break;
        }
      }
    }
  }
  for (; i < t.len; ++i) {
    const T* key = slot(t.k, t, i);
    for (int64_t h = 0; h < t.kv_heads; ++h) {
      for (int64_t g0 = 0; g0 < t.group; g0 += 4) {
        switch (std::min<int64_t>(4, t.group - g0)) {
          case 4: score_one<4>(t, h, g0, key, i, scores); break;
          case 3: score_one<3>(t, h, g0, key, i, scores); break;
          case 2: score_one<2>(t, h, g0, key, i, scores); break;
          default: score_one<1>(t, h, g0, key, i, scores); break;
        }
      }
    }
  }
}

// Rows of values a pass takes for every head of the span before the next rows (their span
// rows, 16 x 384 bytes for SmolLM2 in bfloat16, stay in L1 meanwhile).
constexpr int64_t kValueRows = 16;

// out[h * group + g0 + g][d0 .. d0 + 16 C) for KV head h's query heads [g0, g0 + G), adding
// rows [i0, i1)'s weighted values (onto zero where `first`). `fetch`: this is the rows' first
// pass, which fetches the span rows kValueRows ahead, whole.
template <int G, int C, typename T>
__attribute__((target("avx512f"))) void wide_values(const Task<T>& t, int64_t h, int64_t g0,
                                                   int64_t d0, int64_t i0, int64_t i1,
                                                   const float* scores, bool first, bool fetch) {
  const int64_t D = t.head_dim, head = h * t.group + g0, row = t.kv_heads * D;
  float* out = t.out + head * D + d0;
  __m512 acc[G][C];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
      acc[g][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + g * D + 16 * c);
  for (int64_t i = i0; i < i1; ++i) {
    const T* value = slot(t.v, t, i) + h * D + d0;
    if (fetch && i + kValueRows < t.len) prefetch_row(slot(t.v, t, i + kValueRows), row);
    __m512 p[G];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) p[g] = _mm512_set1_ps(scores[(head + g) * t.len + i]);
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
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + g * D + 16 * c, acc[g][c]);
}

// Up to four heads of at most four 16-float chunks (64 dimensions), or two of up to eight:
// 16 accumulators either way.
template <int C, typename T>
void wide_value_heads(const Task<T>& t, int64_t h, int64_t d0, int64_t i0, int64_t i1,
                      const float* scores, bool fetch) {
  constexpr int kHeads = C <= 4 ? 4 : 2;
  for (int64_t g0 = 0; g0 < t.group; g0 += kHeads) {
    with_count<kHeads>(t.group - g0, [&](auto g) {
      wide_values<decltype(g)::value, C>(t, h, g0, d0, i0, i1, scores, i0 == 0, fetch);
    });
    fetch = false;
  }
}

template <typename T>
void wide_task(const Task<T>& t, float* scores) {
  wide_scores(t, scores);
  // The first values' rows arrive while the softmax runs.
  const int64_t row = t.kv_heads * t.head_dim;
  for (int64_t i = 0; i < kValueRows && i < t.len; ++i) prefetch_row(slot(t.v, t, i), row);
  softmax_rows(scores, t.kv_heads * t.group, t.len);
  for (int64_t i0 = 0; i0 < t.len; i0 += kValueRows) {
    const int64_t i1 = std::min(t.len, i0 + kValueRows);
    bool fetch = true;
    for (int64_t h = 0; h < t.kv_heads; ++h) {
      for (int64_t d0 = 0; d0 < t.head_dim; d0 += 128) {
        with_count<8>((t.head_dim - d0) / 16, [&](auto c) {
          wide_value_heads<decltype(c)::value>(t, h, d0, i0, i1, scores, fetch);
        });
        fetch = false;
      }
    }
  }
}

}  // namespace sg::decode

#endif  // SG_VECTOR
