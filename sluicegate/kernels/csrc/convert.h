// The element types the CPU kernels read and write: float32, bfloat16 and float16 stored,
// float32 computed. A bf16 or fp16 tensor is read in place (half the bytes of float32 from
// memory, the point of keeping a model in 16 bits) and widened in registers; results are
// rounded to the stored type only as they are written, as torch rounds its own bf16/fp16 ops
// (round to nearest even; NaN stays NaN).
//
// Widening bf16 is a shift (its bits are a float32's top half); fp16 takes F16C's vcvtph2ps
// (sluicegate/kernels/cpu_build.py passes -mf16c where the CPU has it). Without F16C or AVX2
// the same conversions go one value at a time through c10's.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SG_VECTOR 1
#endif

namespace sg {

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);
}

// f(T{}) for a tensor's element type T: float, c10::BFloat16 or c10::Half.
template <typename F>
void with_element(at::ScalarType type, const char* what, F&& f) {
  switch (type) {
    case at::kFloat: f(float{}); return;
    case at::kBFloat16: f(c10::BFloat16{}); return;
    case at::kHalf: f(c10::Half{}); return;
    default: TORCH_CHECK(false, what, " must be float32, bfloat16 or float16, not ", type);
  }
}

inline bool is_element(at::ScalarType type) {
  return type == at::kFloat || type == at::kBFloat16 || type == at::kHalf;
}

#ifdef SG_VECTOR

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

inline __m256 load8(const c10::Half* p) {
#ifdef __F16C__
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float wide[8];
  for (int i = 0; i < 8; ++i) wide[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(wide);
#endif
}

inline void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }

// c10's round_to_nearest_even eight at a time, in integer arithmetic (which -ffast-math
// leaves alone: its NaN test on floats it may drop).
inline void store8(c10::BFloat16* p, __m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF));
  __m256i top = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
  const __m256i nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7F800000));
  top = _mm256_blendv_epi8(top, _mm256_set1_epi32(0x7FC0), nan);
  const __m128i packed =
      _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

inline void store8(c10::Half* p, __m256 x) {
#ifdef __F16C__
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  alignas(32) float wide[8];
  _mm256_store_ps(wide, x);
  for (int i = 0; i < 8; ++i) p[i] = static_cast<c10::Half>(wide[i]);
#endif
}

// 16 values as one float32 register, for code compiled for avx512f by attribute (and run only
// where the CPU has it).
__attribute__((target("avx512f"))) inline __m512 load16(const float* p) {
  return _mm512_loadu_ps(p);
}

__attribute__((target("avx512f"))) inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

__attribute__((target("avx512f"))) inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}


// Sixteen floats rounded to T as store8 rounds them (c10's round_to_nearest_even for
// bfloat16, the F16C conversion for float16), as the 16-bit values' bits.
__attribute__((target("avx512f"))) inline __m256i narrow16(__m512 x, const c10::BFloat16*) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF));
  const __m512i top = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(
      _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(top, nan, _mm512_set1_epi32(0x7FC0)));
}

__attribute__((target("avx512f"))) inline __m256i narrow16(__m512 x, const c10::Half*) {
  return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

__attribute__((target("avx512f"))) inline __m512 widen16(__m256i bits, const c10::BFloat16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

__attribute__((target("avx512f"))) inline __m512 widen16(__m256i bits, const c10::Half*) {
  return _mm512_cvtph_ps(bits);
}

template <typename T>
__attribute__((target("avx512f"))) inline void store16(T* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow16(x, p));
}

// x rounded to T's precision and widened back: what storing and reloading it gives (bfloat16
// in the 32-bit lanes themselves: no pack and unpack).
template <typename T>
__attribute__((target("avx512f"))) inline __m512 round16(__m512 x) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF));
    const __m512i top = _mm512_and_si512(_mm512_add_epi32(bits, bias),
                                         _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(
        _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(top, nan, _mm512_set1_epi32(0x7FC00000)));
  } else {
    const T* tag = nullptr;
    return widen16(narrow16(x, tag), tag);
  }
}

#endif  // SG_VECTOR

// n values of src widened into dst.
template <typename T>
void load_row(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef SG_VECTOR
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
#endif
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

// n values of src rounded into dst.
template <typename T>
void store_row(const float* src, T* dst, int64_t n) {
  int64_t i = 0;
#ifdef SG_VECTOR
  for (; i + 8 <= n; i += 8) store8(dst + i, _mm256_loadu_ps(src + i));
#endif
  for (; i < n; ++i) dst[i] = from_float<T>(src[i]);
}

// Each of n floats rounded to T's precision, in place: what a torch op on T tensors stores
// between two steps of a computation.
template <typename T>
void round_row(float* values, int64_t n) {
  int64_t i = 0;
#ifdef SG_VECTOR
  alignas(32) T narrow[8];
  for (; i + 8 <= n; i += 8) {
    store8(narrow, _mm256_loadu_ps(values + i));
    _mm256_storeu_ps(values + i, load8(narrow));
  }
#endif
  for (; i < n; ++i) values[i] = to_float(from_float<T>(values[i]));
}

}  // namespace sg
