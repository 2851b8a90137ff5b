// The decoder layer's small operations on the CPU, each one pass over its rows: what eager
// torch runs as three to eight separate operators (each with its own dispatch, allocation
// and pass over memory), for a decode step's few rows mostly dispatch.
//
// rms_norm(x [T, H], weight [H], eps) -> [T, H]          weight * x / sqrt(mean(x^2) + eps)
// add_rms_norm_(x [T, H], residual [T, H], weight, eps)  residual += x, then x = rms_norm
//                                                        (residual): both in place
// silu_and_mul(x [T, 2I]) -> [T, I]                      silu(x[:, :I]) * x[:, I:]
// silu_and_mul_into(x [T, 2I], out [T, I])               the same into out's rows (at any
//                                                        row stride: a column slice)
// rotary_(x [T, heads, D], cos [T, D], sin [T, D])       neox-style rotation in place (the
//                                                        halves of cos and sin are equal)
// store_kv(key, value [T, kv_heads, D], k_cache, v_cache [blocks, block_size, kv_heads, D],
//          slots [T])                                    each token's rows into its slot;
//                                                        slot -1 (padding) is skipped
//
// Every tensor of one call has one dtype: float32, bfloat16 or float16. A 16-bit row is
// widened to float32 (convert.h), computed in float32 and rounded as it is stored (on CPUs
// with AVX-512, RMSNorm and SiLU x mul do so in registers: csrc/layer_ops_wide.h). RMSNorm
// also rounds the normalised row before the weight multiplies it, where the reference casts
// back to the model's dtype; the float32 path is the float32 maths with no conversions.
//
// Rows may be strided (x.stride(0)); within a row, elements are contiguous. The references,
// whose maths these follow, are sluicegate/engine/models/layers.py (RMSNorm, apply_rotary,
// GatedMLP) and sluicegate/kernels/reference.py (store_kv).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "convert.h"
#include "layer_ops_wide.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// Rows per task: a decode step's few rows run on the calling thread.
constexpr int64_t kGrainRows = 64;

// Below float32's overflow of exp (88.72).
constexpr float kExpLimit = 88.0f;

// Whether 16-bit rows of T take the AVX-512 rows (csrc/layer_ops_wide.h).
template <typename T>
bool wide(const T*) {
#ifdef SG_VECTOR
  return !std::is_same_v<T, float> && sg::layer_rows::wide_path.on();
#else
  return false;
#endif
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && sg::is_element(x.scalar_type()), name,
              " must be float32, bfloat16 or float16 on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be 2-D rows of unit stride");
}

void check_vector(const at::Tensor& v, const at::Tensor& x, int64_t n, const char* what) {
  TORCH_CHECK(v.is_contiguous() && v.numel() == n && v.scalar_type() == x.scalar_type(), what,
              " must be ", n, " contiguous values of x's dtype");
}

// A row as float32: the row itself when it is float32, else widened into `buffer`.
template <typename T>
const float* widen(const T* row, std::vector<float>& buffer, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    buffer.resize(n);
    sg::load_row(row, buffer.data(), n);
    return buffer.data();
  }
}

// Where a row's float32 values are worked on in place: the row itself when it is float32,
// else `buffer` (loaded with the row when `load`), which narrow() rounds back into the row.
template <typename T>
float* scratch(T* row, std::vector<float>& buffer, int64_t n, bool load) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    buffer.resize(n);
    if (load) sg::load_row(row, buffer.data(), n);
    return buffer.data();
  }
}

template <typename T>
void narrow(const float* values, T* row, int64_t n) {
  if constexpr (!std::is_same_v<T, float>) sg::store_row(values, row, n);
}

template <typename T>
inline void normalize_row(const float* in, float* out, const float* weight, int64_t H,
                          float eps) {
  float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < H; ++i) squares += in[i] * in[i];
  const float scale = 1.0f / std::sqrt(squares / static_cast<float>(H) + eps);
  if constexpr (std::is_same_v<T, float>) {
#pragma omp simd
    for (int64_t i = 0; i < H; ++i) out[i] = weight[i] * (in[i] * scale);
  } else {
#pragma omp simd
    for (int64_t i = 0; i < H; ++i) out[i] = in[i] * scale;
    sg::round_row<T>(out, H);
#pragma omp simd
    for (int64_t i = 0; i < H; ++i) out[i] *= weight[i];
  }
}

template <typename T>
void rms_norm_rows(const T* in, int64_t stride, T* out, const float* w, int64_t rows,
                   int64_t H, float eps) {
  const bool by_registers = wide(in);
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> wide_in, wide_out;
    for (int64_t t = begin; t < end; ++t) {
#ifdef SG_VECTOR
      if constexpr (!std::is_same_v<T, float>) {
        if (by_registers) {
          sg::layer_rows::rms_norm_row(in + t * stride, out + t * H, w, H, eps);
          continue;
        }
      }
#endif
      const float* row = widen(in + t * stride, wide_in, H);
      float* o = scratch(out + t * H, wide_out, H, false);
      normalize_row<T>(row, o, w, H, eps);
      narrow(o, out + t * H, H);
    }
  });
}

template <typename T>
void add_rms_norm_rows(T* xs, int64_t x_stride, T* rs, int64_t r_stride, const float* w,
                       int64_t rows, int64_t H, float eps) {
  const bool by_registers = wide(xs);
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> wide_x, wide_r, wide_out;
    for (int64_t t = begin; t < end; ++t) {
      T* xr = xs + t * x_stride;
      T* rr = rs + t * r_stride;
#ifdef SG_VECTOR
      if constexpr (!std::is_same_v<T, float>) {
        if (by_registers) {
          sg::layer_rows::add_rms_norm_row(xr, rr, w, H, eps);
          continue;
        }
      }
#endif
      const float* x = widen(xr, wide_x, H);
      float* r = scratch(rr, wide_r, H, true);
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) r[i] += x[i];
      // The norm reads the sum as stored (the reference adds in the model's dtype too).
      narrow(r, rr, H);
      if constexpr (!std::is_same_v<T, float>) sg::round_row<T>(r, H);
      float* o = scratch(xr, wide_out, H, false);
      normalize_row<T>(r, o, w, H, eps);
      narrow(o, xr, H);
    }
  });
}

// The weight as float32 values: the tensor's own when float32, else widened into the calling
// thread's buffer (H values; not a tensor, whose allocation and conversion cost a decode
// step's norm more than the norm itself).
template <typename E>
const float* float_weight(const at::Tensor& weight, int64_t H) {
  thread_local std::vector<float> wide_weight;
  return widen(static_cast<const E*>(weight.data_ptr()), wide_weight, H);
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  const int64_t T = x.size(0), H = x.size(1);
  check_vector(weight, x, H, "weight");
  auto out = at::empty({T, H}, x.options());
  sg::with_element(x.scalar_type(), "x", [&](auto element) {
    using E = decltype(element);
    rms_norm_rows(static_cast<const E*>(x.data_ptr()), x.stride(0),
                  static_cast<E*>(out.data_ptr()), float_weight<E>(weight, H), T, H,
                  static_cast<float>(eps));
  });
  return out;
}

void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(residual.size(0) == T && residual.size(1) == H &&
                  residual.scalar_type() == x.scalar_type(),
              "x and residual differ in shape or dtype");
  check_vector(weight, x, H, "weight");
  sg::with_element(x.scalar_type(), "x", [&](auto element) {
    using E = decltype(element);
    add_rms_norm_rows(static_cast<E*>(x.data_ptr()), x.stride(0),
                      static_cast<E*>(residual.data_ptr()), residual.stride(0),
                      float_weight<E>(weight, H), T, H, static_cast<float>(eps));
  });
}

void silu_and_mul_into(const at::Tensor& x, at::Tensor& out) {
  check_rows(x, "x");
  check_rows(out, "out");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  TORCH_CHECK(x.size(1) == 2 * I, "x must have an even number of columns");
  TORCH_CHECK(out.size(0) == T && out.size(1) == I && out.scalar_type() == x.scalar_type(),
              "out must be [rows, half of x's columns] of x's dtype");
  const int64_t stride = x.stride(0), out_stride = out.stride(0);
  sg::with_element(x.scalar_type(), "x", [&](auto element) {
    using E = decltype(element);
    const E* in = static_cast<const E*>(x.data_ptr());
    E* o = static_cast<E*>(out.data_ptr());
    const bool by_registers = wide(in);
    at::parallel_for(0, T, kGrainRows / 4, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> wide_in, wide_out;
      for (int64_t t = begin; t < end; ++t) {
        E* row_out = o + t * out_stride;
#ifdef SG_VECTOR
        if constexpr (!std::is_same_v<E, float>) {
          if (by_registers) {
            sg::layer_rows::silu_and_mul_row(in + t * stride, row_out, I);
            continue;
          }
        }
#endif
        const float* gate = widen(in + t * stride, wide_in, 2 * I);
        const float* up = gate + I;
        float* row = scratch(row_out, wide_out, I, false);
        // exp's argument held below float32's overflow: 1 + inf made these rows NaN (under
        // -ffast-math) wherever a gate fell below about -88.7, where silu is -0.
#pragma omp simd
        for (int64_t i = 0; i < I; ++i)
          row[i] = gate[i] / (1.0f + std::exp(std::min(-gate[i], kExpLimit))) * up[i];
        narrow(row, row_out, I);
      }
    });
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  silu_and_mul_into(x, out);
  return out;
}

bool layer_ops_allow_avx512(bool allow) {
#ifdef SG_VECTOR
  return sg::layer_rows::wide_path.allow(allow);
#else
  return false;
#endif
}

void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && sg::is_element(x.scalar_type()) && x.dim() == 3 &&
                  x.stride(2) == 1,
              "x must be [tokens, heads, head_dim] float32, bfloat16 or float16 with unit "
              "stride along head_dim");
  const int64_t T = x.size(0), heads = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  check_vector(cos, x, T * D, "cos");
  check_vector(sin, x, T * D, "sin");
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  sg::with_element(x.scalar_type(), "x", [&](auto element) {
    using E = decltype(element);
    E* xs = static_cast<E*>(x.data_ptr());
    const E* cs = static_cast<const E*>(cos.data_ptr());
    const E* sn = static_cast<const E*>(sin.data_ptr());
    at::parallel_for(0, T, kGrainRows, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> wide_cos, wide_sin, wide_row;
      for (int64_t t = begin; t < end; ++t) {
        const float* c = widen(cs + t * D, wide_cos, D);
        const float* s = widen(sn + t * D, wide_sin, D);
        for (int64_t h = 0; h < heads; ++h) {
          E* stored = xs + t * token_stride + h * head_stride;
          float* row = scratch(stored, wide_row, D, true);
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float first = row[i], second = row[i + half];
            row[i] = first * c[i] - second * s[i];
            row[i + half] = second * c[i + half] + first * s[i + half];
          }
          narrow(row, stored, D);
        }
      }
    });
  });
}

void store_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
              at::Tensor& v_cache, const at::Tensor& slots) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && sg::is_element(k_cache.scalar_type()) &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "the caches must be contiguous float32, bfloat16 or float16 of one shape and "
              "dtype");
  const int64_t T = key.size(0), kv_heads = k_cache.size(2), D = k_cache.size(3);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (const auto* source : {&key, &value}) {
    TORCH_CHECK(source->scalar_type() == k_cache.scalar_type() && source->dim() == 3 &&
                    source->size(0) == T && source->size(1) == kv_heads &&
                    source->size(2) == D && source->stride(2) == 1,
                "key and value must be [tokens, kv_heads, head_dim] of the cache's dtype");
  }
  const auto slot_ids = slots.to(at::kLong).contiguous();
  TORCH_CHECK(slot_ids.numel() == T, "one slot per token");
  const int64_t* sl = slot_ids.data_ptr<int64_t>();
  // Rows copied as bytes: key, value and cache share one element type.
  const int64_t size = k_cache.element_size();
  const char* ks = static_cast<const char*>(key.data_ptr());
  const char* vs = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t row = kv_heads * D;
  at::parallel_for(0, T, kGrainRows * 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = sl[t];
      if (slot < 0) continue;
      TORCH_CHECK(slot < num_slots, "slot ", slot, " is past the cache's ", num_slots);
      for (int64_t h = 0; h < kv_heads; ++h) {
        std::memcpy(kc + (slot * row + h * D) * size,
                    ks + (t * key.stride(0) + h * key.stride(1)) * size, D * size);
        std::memcpy(vc + (slot * row + h * D) * size,
                    vs + (t * value.stride(0) + h * value.stride(1)) * size, D * size);
      }
    }
  });
}
