// The decoder layer's small operations on the CPU in float32, each one pass over its rows:
// what eager torch runs as three to eight separate operators (each with its own dispatch,
// allocation and pass over memory), for a decode step's few rows mostly dispatch.
//
// rms_norm(x [T, H], weight [H], eps) -> [T, H]          weight * x / sqrt(mean(x^2) + eps)
// add_rms_norm_(x [T, H], residual [T, H], weight, eps)  residual += x, then x = rms_norm
//                                                        (residual): both in place
// silu_and_mul(x [T, 2I]) -> [T, I]                      silu(x[:, :I]) * x[:, I:]
// rotary_(x [T, heads, D], cos [T, D], sin [T, D])       neox-style rotation in place (the
//                                                        halves of cos and sin are equal)
// store_kv(key, value [T, kv_heads, D], k_cache, v_cache [blocks, block_size, kv_heads, D],
//          slots [T])                                    each token's rows into its slot;
//                                                        slot -1 (padding) is skipped
//
// Rows may be strided (x.stride(0)); within a row, elements are contiguous. The references,
// whose maths these follow, are sluicegate/engine/models/layers.py (RMSNorm, apply_rotary, GatedMLP)
// and sluicegate/kernels/reference.py (store_kv).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <tuple>

namespace {

// Rows per task: a decode step's few rows run on the calling thread.
constexpr int64_t kGrainRows = 64;

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dtype() == at::kFloat, name, " must be float32 on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be 2-D rows of unit stride");
}

inline void normalize_row(const float* in, float* out, const float* weight, int64_t H,
                          float eps) {
  float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < H; ++i) squares += in[i] * in[i];
  const float scale = 1.0f / std::sqrt(squares / static_cast<float>(H) + eps);
#pragma omp simd
  for (int64_t i = 0; i < H; ++i) out[i] = weight[i] * (in[i] * scale);
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == H && weight.dtype() == at::kFloat,
              "weight must be H contiguous float32 values");
  auto out = at::empty({T, H}, x.options());
  const float* in = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t stride = x.stride(0);
  at::parallel_for(0, T, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      normalize_row(in + t * stride, o + t * H, w, H, static_cast<float>(eps));
  });
  return out;
}

void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(residual.size(0) == T && residual.size(1) == H, "x and residual differ in shape");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == H && weight.dtype() == at::kFloat,
              "weight must be H contiguous float32 values");
  float* xs = x.data_ptr<float>();
  float* rs = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const int64_t x_stride = x.stride(0), r_stride = residual.stride(0);
  at::parallel_for(0, T, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* xr = xs + t * x_stride;
      float* rr = rs + t * r_stride;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) rr[i] += xr[i];
      normalize_row(rr, xr, w, H, static_cast<float>(eps));
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  TORCH_CHECK(x.size(1) == 2 * I, "x must have an even number of columns");
  auto out = at::empty({T, I}, x.options());
  const float* in = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t stride = x.stride(0);
  at::parallel_for(0, T, kGrainRows / 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* gate = in + t * stride;
      const float* up = gate + I;
      float* row = o + t * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) row[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    }
  });
  return out;
}

void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dtype() == at::kFloat && x.dim() == 3 && x.stride(2) == 1,
              "x must be [tokens, heads, head_dim] float32 with unit stride along head_dim");
  const int64_t T = x.size(0), heads = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dtype() == at::kFloat &&
                  sin.dtype() == at::kFloat && cos.numel() == T * D && sin.numel() == T * D,
              "cos and sin must be contiguous [tokens, head_dim] float32");
  float* xs = x.data_ptr<float>();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  at::parallel_for(0, T, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cs + t * D;
      const float* s = sn + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        float* row = xs + t * token_stride + h * head_stride;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float first = row[i], second = row[i + half];
          row[i] = first * c[i] - second * s[i];
          row[i + half] = second * c[i + half] + first * s[i + half];
        }
      }
    }
  });
}

void store_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
              at::Tensor& v_cache, const at::Tensor& slots) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.dtype() == at::kFloat &&
                  v_cache.dtype() == at::kFloat,
              "the caches must be contiguous float32 of one shape");
  const int64_t T = key.size(0), kv_heads = k_cache.size(2), D = k_cache.size(3);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (const auto* source : {&key, &value}) {
    TORCH_CHECK(source->dtype() == at::kFloat && source->dim() == 3 && source->size(0) == T &&
                    source->size(1) == kv_heads && source->size(2) == D && source->stride(2) == 1,
                "key and value must be [tokens, kv_heads, head_dim] float32 like the cache");
  }
  const auto slot_ids = slots.to(at::kLong).contiguous();
  TORCH_CHECK(slot_ids.numel() == T, "one slot per token");
  const int64_t* sl = slot_ids.data_ptr<int64_t>();
  const float* ks = key.data_ptr<float>();
  const float* vs = value.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t row = kv_heads * D;
  at::parallel_for(0, T, kGrainRows * 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = sl[t];
      if (slot < 0) continue;
      TORCH_CHECK(slot < num_slots, "slot ", slot, " is past the cache's ", num_slots);
      for (int64_t h = 0; h < kv_heads; ++h) {
        std::memcpy(kc + slot * row + h * D, ks + t * key.stride(0) + h * key.stride(1),
                    D * sizeof(float));
        std::memcpy(vc + slot * row + h * D, vs + t * value.stride(0) + h * value.stride(1),
                    D * sizeof(float));
      }
    }
  });
}
