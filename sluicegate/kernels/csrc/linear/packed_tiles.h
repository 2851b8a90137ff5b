// The packed linear's register tiles (csrc/linear/packed_linear.cpp): rows of x times one or two
// 16-column weight panels over all of K, float32 accumulators.
//
// A panel's element type P is the weight's: float32, or bfloat16 / float16 kept in 16 bits,
// half the bytes a decode step streams from memory. A 16-bit panel row is widened to float32
// in registers as it is loaded (a shift for bf16, vcvtph2ps for fp16) and then takes the same
// fused multiply-adds as a float32 one: the product is that of the widened weight, as
// torch.nn.functional.linear computes it in float32 on the same values.
//
// AVX2 tiles: two 8-float vectors per panel row, up to 6 rows. AVX-512 tiles (compiled for
// avx512f by attribute, run only where the CPU has it): one 16-float register per panel row,
// up to 12 rows, alone or two panels side by side, optionally storing the rows they widen.
#pragma once

#include "convert.h"
#include "dispatch.h"

#include <cstring>
#include <type_traits>

namespace sg::packed {

constexpr int64_t kCols = 16;      // columns per panel: two 8-float vectors
constexpr int64_t kRows = 6;       // rows per register tile: 12 accumulators of 16 registers
constexpr int64_t kWideRows = 12;  // rows per AVX-512 tile: 12 accumulators of 32 registers

// Panel row k's 16 columns as two float32 vectors. A bf16 row is one 32-byte load whose
// values two unpacks slide into the top halves of 32-bit lanes (a shift would take a port
// the multiply-adds need); unpacks stay within 128-bit lanes, so the vectors hold columns
// 0-3 and 8-11, then 4-7 and 12-15, until in_order() sorts the accumulators after the k loop.
inline void panel_row(const float* p, __m256& b0, __m256& b1) {
  b0 = _mm256_load_ps(p);
  b1 = _mm256_load_ps(p + 8);
}

inline void panel_row(const c10::BFloat16* p, __m256& b0, __m256& b1) {
  const __m256i bits = _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i zero = _mm256_setzero_si256();
  b0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, bits));
  b1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, bits));
}

inline void panel_row(const c10::Half* p, __m256& b0, __m256& b1) {
  b0 = sg::load8(p);
  b1 = sg::load8(p + 8);
}

template <typename P>
constexpr bool kInterleaved = std::is_same_v<P, c10::BFloat16>;

inline void in_order(__m256& lo, __m256& hi) {
  const __m256 first = _mm256_permute2f128_ps(lo, hi, 0x20);
  const __m256 second = _mm256_permute2f128_ps(lo, hi, 0x31);
  lo = first;
  hi = second;
}

// One register tile: rows [0, R) of A times one panel, over all of K.
#define SG_ROW(r)                                               \
  if constexpr (R > r) {                                        \
    const __m256 a = _mm256_broadcast_ss(A + r * lda + k);      \
    c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0);                  \
    c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1);                  \
  }
#define SG_ORDER(r) \
  if constexpr (R > r) in_order(c##r##0, c##r##1);
#define SG_STORE(r)                                                    \
  if constexpr (R > r) {                                               \
    const __m256 lo = _mm256_add_ps(c##r##0, bias_lo);                 \
    const __m256 hi = _mm256_add_ps(c##r##1, bias_hi);                 \
    if (cols == kCols) {                                               \
      _mm256_storeu_ps(C + r * ldc, lo);                               \
      _mm256_storeu_ps(C + r * ldc + 8, hi);                           \
    } else {                                                           \
      alignas(32) float row[kCols];                                    \
      _mm256_store_ps(row, lo);                                        \
      _mm256_store_ps(row + 8, hi);                                    \
      std::memcpy(C + r * ldc, row, cols * sizeof(float));             \
    }                                                                  \
  }

template <int R, typename P>
void tile(const float* A, int64_t lda, const P* panel, int64_t K, float* C, int64_t ldc,
          const float* bias, int64_t cols) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t k = 0; k < K; ++k) {
    __m256 b0, b1;
    panel_row(panel + k * kCols, b0, b1);
    SG_ROW(0) SG_ROW(1) SG_ROW(2) SG_ROW(3) SG_ROW(4) SG_ROW(5)
  }
  if constexpr (kInterleaved<P>) {
    SG_ORDER(0) SG_ORDER(1) SG_ORDER(2) SG_ORDER(3) SG_ORDER(4) SG_ORDER(5)
  }
  alignas(32) float padded[kCols] = {0};
  if (bias != nullptr) std::memcpy(padded, bias, cols * sizeof(float));
  const __m256 bias_lo = _mm256_load_ps(padded), bias_hi = _mm256_load_ps(padded + 8);
  SG_STORE(0) SG_STORE(1) SG_STORE(2) SG_STORE(3) SG_STORE(4) SG_STORE(5)
}
#undef SG_ROW
#undef SG_ORDER
#undef SG_STORE

// Rows [0, rows) of A (rows <= kRows) times one panel in one AVX2 tile.
template <typename P>
void tile_rows(const float* A, int64_t lda, int64_t rows, const P* panel, int64_t K, float* C,
               int64_t ldc, const float* bias, int64_t cols) {
  sg::with_count<kRows>(rows, [&](auto r) {
    tile<decltype(r)::value>(A, lda, panel, K, C, ldc, bias, cols);
  });
}

// The first ``cols`` lanes of a panel (a model's last panel may be narrower than 16).
inline __mmask16 columns_mask(int64_t cols) {
  return cols >= kCols ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
}

// A panel's bias in one register (zero where there is none or past ``mask``).
__attribute__((target("avx512f"))) inline __m512 wide_bias(const float* bias, __mmask16 mask) {
  return bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, bias);
}

// Keep: the tile also stores each panel row, as widened, to ``kept`` ([K][16] float32, 64-byte
// aligned), so that the block's other tiles read float32 rows (the stores take a port the
// multiply-adds do not use).
template <int R, bool Keep, typename P>
__attribute__((target("avx512f"))) void wide_tile(const float* A, int64_t lda, const P* panel,
                                                 int64_t K, float* C, int64_t ldc,
                                                 const float* bias, int64_t cols,
                                                 float* kept) {
  __m512 c[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) c[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 b = sg::load16(panel + k * kCols);
    if constexpr (Keep) _mm512_store_ps(kept + k * kCols, b);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) c[r] = _mm512_fmadd_ps(_mm512_set1_ps(A[r * lda + k]), b, c[r]);
  }
  const __mmask16 mask = columns_mask(cols);
  const __m512 bias_v = wide_bias(bias, mask);
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(C + r * ldc, mask, _mm512_add_ps(c[r], bias_v));
}

// Rows [0, R) of A times two panels side by side (24 accumulators): each x value loaded
// serves two panels, so a tile does twice the multiply-adds per load of x.
template <int R, bool Keep, typename P>
__attribute__((target("avx512f"))) void wide_pair_tile(const float* A, int64_t lda,
                                                      const P* p0, const P* p1, int64_t K,
                                                      float* C0, float* C1, int64_t ldc,
                                                      const float* b0, const float* b1,
                                                      int64_t cols0, int64_t cols1,
                                                      float* kept0, float* kept1) {
  __m512 c0[R], c1[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = sg::load16(p0 + k * kCols);
    const __m512 w1 = sg::load16(p1 + k * kCols);
    if constexpr (Keep) {
      _mm512_store_ps(kept0 + k * kCols, w0);
      _mm512_store_ps(kept1 + k * kCols, w1);
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(A[r * lda + k]);
      c0[r] = _mm512_fmadd_ps(a, w0, c0[r]);
      c1[r] = _mm512_fmadd_ps(a, w1, c1[r]);
    }
  }
  const __mmask16 m0 = columns_mask(cols0), m1 = columns_mask(cols1);
  const __m512 bias0 = wide_bias(b0, m0), bias1 = wide_bias(b1, m1);
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(C0 + r * ldc, m0, _mm512_add_ps(c0[r], bias0));
    _mm512_mask_storeu_ps(C1 + r * ldc, m1, _mm512_add_ps(c1[r], bias1));
  }
}

// Rows [0, rows) of A times one panel in one AVX-512 tile (rows <= kWideRows); ``kept``
// given: the panel's rows widened are stored there too.
template <typename P>
void wide_tile_rows(const float* A, int64_t lda, int64_t rows, const P* panel, int64_t K,
                    float* C, int64_t ldc, const float* bias, int64_t cols,
                    float* kept = nullptr) {
  sg::with_count<kWideRows>(rows, [&](auto r) {
    if (kept != nullptr) {
      wide_tile<decltype(r)::value, true>(A, lda, panel, K, C, ldc, bias, cols, kept);
    } else {
      wide_tile<decltype(r)::value, false>(A, lda, panel, K, C, ldc, bias, cols, nullptr);
    }
  });
}

// Rows [0, rows) of A (rows <= kWideRows) times two panels in one AVX-512 tile; ``kept0``
// given: both panels' rows widened are stored there and in ``kept1`` too.
template <typename P>
void wide_pair_rows(const float* A, int64_t lda, int64_t rows, const P* p0, const P* p1,
                    int64_t K, float* C0, float* C1, int64_t ldc, const float* b0,
                    const float* b1, int64_t cols0, int64_t cols1, float* kept0 = nullptr,
                    float* kept1 = nullptr) {
  sg::with_count<kWideRows>(rows, [&](auto r) {
    if (kept0 != nullptr) {
      wide_pair_tile<decltype(r)::value, true>(A, lda, p0, p1, K, C0, C1, ldc, b0, b1, cols0,
                                               cols1, kept0, kept1);
    } else {
      wide_pair_tile<decltype(r)::value, false>(A, lda, p0, p1, K, C0, C1, ldc, b0, b1, cols0,
                                                cols1, nullptr, nullptr);
    }
  });
}

}  // namespace sg::packed
