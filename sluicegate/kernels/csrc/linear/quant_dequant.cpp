// A block of a quantized linear's weight rows dequantized to float32, one pass: what
// sluicegate/engine/models/quant/linear.py computes in torch, bit for bit. Each weight is one
// float multiply of exact operands: an e4m3 value (from a 256-entry table) times its scale,
// or an integer code minus its zero point (subtracted as integers, so exactly) times its
// scale. No sum is reordered, so -ffast-math cannot change a result.
//
// For a few activation rows (decode) the product itself: each weight row dequantized into a
// buffer the size of one row and dotted with every activation row at once, so the dense
// weight never goes to memory.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "parallel_items.h"

namespace {

// Weights a work item dequantizes at least: a smaller call runs on one thread, since waking
// another costs more than it saves.
constexpr int64_t kWeightsPerItem = 1 << 16;

int64_t rows_per_item(int64_t columns) {
  return std::max<int64_t>(1, kWeightsPerItem / std::max<int64_t>(columns, 1));
}

float e4m3_value(int bits) {
  const int exponent = (bits >> 3) & 15, mantissa = bits & 7;
  float value;
  if (exponent == 15 && mantissa == 7) {
    value = std::numeric_limits<float>::quiet_NaN();  // e4m3fn has no infinities
  } else if (exponent == 0) {
    value = std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: m/8 * 2^-6
  } else {
    value = std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);  // (1 + m/8) * 2^(e-7)
  }
  return (bits & 128) ? -value : value;
}

struct E4M3Table {
  float values[256];
  E4M3Table() {
    for (int bits = 0; bits < 256; ++bits) values[bits] = e4m3_value(bits);
  }
};

const float* e4m3_table() {
  static const E4M3Table table;
  return table.values;
}

void check_common(const at::Tensor& stored, const at::Tensor& scales, int64_t group) {
  TORCH_CHECK(stored.device().is_cpu() && scales.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(stored.dim() == 2 && stored.is_contiguous(), "stored weights: contiguous 2-D");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2,
              "scales: contiguous float32 [rows, groups]");
  TORCH_CHECK(scales.size(0) == stored.size(0), "one row of scales per weight row");
  TORCH_CHECK(group > 0, "group must be positive");
}

// Row r of a linear in either storage, dequantized into out[0, columns).
struct Fp8Rows {
  const uint8_t* stored;
  const float* scales;
  int64_t groups, group, columns;
  const float* table;

  void row(int64_t r, float* out) const {
    const uint8_t* w = stored + r * columns;
    for (int64_t g = 0; g < groups; ++g) {
      const float s = scales[r * groups + g];
      const int64_t stop = std::min(columns, (g + 1) * group);
      for (int64_t i = g * group; i < stop; ++i) out[i] = table[w[i]] * s;
    }
  }
};

struct IntRows {
  const uint8_t* stored;
  const uint8_t* zeros;
  const float* scales;
  int64_t groups, group, columns, width, bits;

  void row(int64_t r, float* out) const {
    const uint8_t* c = stored + r * width;
    for (int64_t g = 0; g < groups; ++g) {
      const int z = zeros[r * groups + g];
      const float s = scales[r * groups + g];
      const int64_t stop = std::min(columns, (g + 1) * group);
      if (bits == 4) {
        // Two codes a byte, the even column in the low nibble.
        for (int64_t i = g * group; i < stop; ++i) {
          const int code = (c[i >> 1] >> ((i & 1) * 4)) & 15;
          out[i] = static_cast<float>(code - z) * s;
        }
      } else {
        for (int64_t i = g * group; i < stop; ++i) out[i] = static_cast<float>(c[i] - z) * s;
      }
    }
  }
};

template <typename Rows>
at::Tensor dequantize_rows(const Rows& rows, int64_t count, const at::TensorOptions& options) {
  at::Tensor out = at::empty({count, rows.columns}, options);
  float* result = out.data_ptr<float>();
  const int64_t per_item = rows_per_item(rows.columns);
  parallel_items((count + per_item - 1) / per_item, [&](int64_t item) {
    const int64_t last = std::min(count, (item + 1) * per_item);
    for (int64_t r = item * per_item; r < last; ++r) rows.row(r, result + r * rows.columns);
  });
  return out;
}

// x [tokens, columns] @ the dequantized weight [count, columns]^T.
template <typename Rows>
at::Tensor product_rows(const at::Tensor& x, const Rows& rows, int64_t count) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() &&
                  x.size(1) == rows.columns,
              "x: contiguous float32 [tokens, in]");
  const int64_t tokens = x.size(0), columns = rows.columns;
  at::Tensor out = at::empty({tokens, count}, x.options());
  const float* activations = x.data_ptr<float>();
  float* result = out.data_ptr<float>();
  const int64_t per_item = rows_per_item(columns);
  parallel_items((count + per_item - 1) / per_item, [&](int64_t item) {
    std::vector<float> weight(columns);
    const int64_t last = std::min(count, (item + 1) * per_item);
    for (int64_t r = item * per_item; r < last; ++r) {
      rows.row(r, weight.data());
      for (int64_t t = 0; t < tokens; ++t) {
        const float* a = activations + t * columns;
        float sum = 0.0f;
        for (int64_t i = 0; i < columns; ++i) sum += a[i] * weight[i];
        result[t * count + r] = sum;
      }
    }
  });
  return out;
}

Fp8Rows fp8_rows(const at::Tensor& weight, const at::Tensor& scales, int64_t group) {
  check_common(weight, scales, group);
  TORCH_CHECK(weight.scalar_type() == at::kFloat8_e4m3fn, "weight: float8_e4m3fn");
  TORCH_CHECK(scales.size(1) * group >= weight.size(1), "too few scales for the row");
  return Fp8Rows{reinterpret_cast<const uint8_t*>(weight.data_ptr()), scales.data_ptr<float>(),
                 scales.size(1), group, weight.size(1), e4m3_table()};
}

IntRows int_rows(const at::Tensor& codes, const at::Tensor& zeros, const at::Tensor& scales,
                 int64_t bits, int64_t group, int64_t columns) {
  check_common(codes, scales, group);
  TORCH_CHECK(bits == 4 || bits == 8, "4- or 8-bit codes");
  TORCH_CHECK(codes.scalar_type() == at::kByte && zeros.scalar_type() == at::kByte,
              "codes and zeros: uint8");
  TORCH_CHECK(zeros.sizes() == scales.sizes() && zeros.is_contiguous(),
              "zeros: contiguous, shaped as the scales");
  TORCH_CHECK(codes.size(1) == (bits == 4 ? (columns + 1) / 2 : columns),
              "codes do not hold the row's columns");
  TORCH_CHECK(scales.size(1) * group >= columns, "too few scales for the row");
  return IntRows{codes.data_ptr<uint8_t>(), zeros.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                 scales.size(1), group, columns, codes.size(1), bits};
}

}  // namespace

at::Tensor dequantize_fp8(const at::Tensor& weight, const at::Tensor& scales, int64_t group) {
  return dequantize_rows(fp8_rows(weight, scales, group), weight.size(0), scales.options());
}

at::Tensor dequantize_int(const at::Tensor& codes, const at::Tensor& zeros,
                          const at::Tensor& scales, int64_t bits, int64_t group,
                          int64_t columns) {
  return dequantize_rows(int_rows(codes, zeros, scales, bits, group, columns), codes.size(0),
                         scales.options());
}

at::Tensor linear_fp8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                      int64_t group) {
  return product_rows(x, fp8_rows(weight, scales, group), weight.size(0));
}

at::Tensor linear_int(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& zeros,
                      const at::Tensor& scales, int64_t bits, int64_t group, int64_t columns) {
  return product_rows(x, int_rows(codes, zeros, scales, bits, group, columns), codes.size(0));
}
