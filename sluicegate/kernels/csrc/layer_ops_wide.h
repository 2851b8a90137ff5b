// The layer operations' AVX-512 rows for 16-bit dtypes (csrc/layer_ops.cpp picks them at run
// time where the CPU has AVX-512; compiled for avx512f by attribute, so the extension still
// loads on AVX2-only CPUs). The same maths as the AVX2 rows, in registers: those widen a row
// into a float32 buffer, round it back in a pass of its own wherever the reference casts to the
// model's dtype, and narrow it in another; here each 16 values are loaded, rounded and stored
// in one go (two passes over the row for a norm, one for SiLU x mul). Float32 rows keep the
// AVX2 code, whose summation order the float32 token-exactness tests pin.
#pragma once

#include "convert.h"
#include "dispatch.h"
#include "exp16.h"

#include <algorithm>
#include <cmath>

#ifdef SG_VECTOR

namespace sg::layer_rows {

inline Avx512Path wide_path;

template <typename T>
inline float rounded(float x) {
  return to_float(from_float<T>(x));
}

// out = weight * round(sums * scale), rounded as stored: RMSNorm's second half (the reference
// casts the normalised row back to the model's dtype before the weight multiplies it).
template <typename T>
__attribute__((target("avx512f"))) inline void scale_row(const T* sums, T* out, const float* w,
                                                         int64_t H, float scale) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= H; i += 16) {
    const __m512 normalized = round16<T>(_mm512_mul_ps(load16(sums + i), s));
    store16(out + i, _mm512_mul_ps(normalized, _mm512_loadu_ps(w + i)));
  }
  for (; i < H; ++i) out[i] = from_float<T>(rounded<T>(to_float(sums[i]) * scale) * w[i]);
}

inline float inverse_rms(float squares, int64_t H, float eps) {
  return 1.0f / std::sqrt(squares / static_cast<float>(H) + eps);
}

template <typename T>
__attribute__((target("avx512f"))) void rms_norm_row(const T* in, T* out, const float* w,
                                                    int64_t H, float eps) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= H; i += 16) {
    const __m512 x = load16(in + i);
    acc = _mm512_fmadd_ps(x, x, acc);
  }
  float squares = _mm512_reduce_add_ps(acc);
  for (; i < H; ++i) squares += to_float(in[i]) * to_float(in[i]);
  scale_row(in, out, w, H, inverse_rms(squares, H, eps));
}

// r += x, rounded as stored; then x = RMSNorm(r), reading the sum as stored.
template <typename T>
__attribute__((target("avx512f"))) void add_rms_norm_row(T* x, T* r, const float* w, int64_t H,
                                                        float eps) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= H; i += 16) {
    const __m256i sum = narrow16(_mm512_add_ps(load16(r + i), load16(x + i)), r);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r + i), sum);
    const __m512 stored = widen16(sum, r);
    acc = _mm512_fmadd_ps(stored, stored, acc);
  }
  float squares = _mm512_reduce_add_ps(acc);
  for (; i < H; ++i) {
    r[i] = from_float<T>(to_float(r[i]) + to_float(x[i]));
    squares += to_float(r[i]) * to_float(r[i]);
  }
  scale_row(r, x, w, H, inverse_rms(squares, H, eps));
}

// 1 / x from the 14-bit estimate and one Newton step (within a float32 rounding or two; a
// division takes 16 lanes several times as long).
__attribute__((target("avx512f"))) inline __m512 reciprocal16(__m512 x) {
  const __m512 estimate = _mm512_rcp14_ps(x);
  return _mm512_mul_ps(estimate, _mm512_fnmadd_ps(x, estimate, _mm512_set1_ps(2.0f)));
}

// out = silu(gate) * up, gate and up the two halves of `in` (I values each).
template <typename T>
__attribute__((target("avx512f"))) void silu_and_mul_row(const T* in, T* out, int64_t I) {
  const T* up = in + I;
  const __m512 one = _mm512_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 16 <= I; i += 16) {
    const __m512 gate = load16(in + i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate));
    // Past exp's range (gate below about -88.7) 1 + e is infinite, whose estimated reciprocal
    // the Newton step would turn into NaN: the sigmoid there is 0.
    const __m512 denominator = _mm512_add_ps(one, e);
    const __mmask16 infinite =
        _mm512_cmp_ps_mask(denominator, _mm512_set1_ps(INFINITY), _CMP_EQ_OQ);
    const __m512 sigmoid =
        _mm512_mask_mov_ps(reciprocal16(denominator), infinite, _mm512_setzero_ps());
    store16(out + i, _mm512_mul_ps(_mm512_mul_ps(gate, sigmoid), load16(up + i)));
  }
  for (; i < I; ++i) {
    const float gate = to_float(in[i]);
    out[i] = from_float<T>(gate / (1.0f + std::exp(std::min(-gate, 88.0f))) * to_float(up[i]));
  }
}

}  // namespace sg::layer_rows

#endif  // SG_VECTOR
