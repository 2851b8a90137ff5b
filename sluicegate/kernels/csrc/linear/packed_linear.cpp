// y = x @ W^T (+ bias) on the CPU, x float32, W packed once into 16-column panels of its
// own dtype (float32, bfloat16 or float16: csrc/linear/packed_tiles.h widens 16-bit panels in
// registers), float32 accumulators and output.
//
// Decode steps multiply a few tens of rows by every weight of the model, so each step streams
// all weights from memory once: the product is as fast as that stream when the arithmetic
// hides behind it. The packed layout makes the stream sequential ([panel][k][16 columns], 64
// bytes per k, which the hardware prefetcher runs ahead of), and a 6x16 register tile reads
// each panel line once per six rows. Summation runs over k in order with fused multiply-adds,
// one float32 accumulator per output: plain float32 maths, as torch.nn.functional.linear.
//
// pack:    w [N, K] -> packed [ceil(N/16), K, 16] of w's dtype (columns past N are zero),
//          kept in 2 MiB-aligned memory with transparent huge pages asked for: a step touches
//          every page of every weight, and 4 KiB pages would cost a TLB miss per page.
// linear:  x [M, K] float32 (rows contiguous), packed, N, bias [N] float32 or None
//          -> [M, N] float32
//
// Gated ("gated" true): w is a gated MLP's fused gate and up projections, [2I, K] (gate rows
// first), and the product is silu(x W_gate^T + b_gate) * (x W_up^T + b_up), [M, I]: gate
// panel j and up panel j are packed side by side, and each tile's two results are combined
// as they leave the registers, so the [M, 2I] product never goes to memory.
//
// Where the CPU has AVX-512 (checked at run time; the build stays AVX2) a panel is one
// register and a tile takes 12 rows, and a block's first tile keeps its 16-bit panels'
// widened rows for the block's other tiles (kept_panels). Each output is still the same
// sequence of fused multiply-adds over k, so every path gives the same bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "convert.h"
#include "parallel_items.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <type_traits>

// Built only where the compiler targets AVX2 with FMA (sluicegate/kernels/cpu_build.py passes
// the flags this CPU has); elsewhere packed_linear_supported() says no and the engine keeps
// oneDNN.
#ifdef SG_VECTOR
#include "packed_tiles.h"

bool packed_linear_supported() { return true; }

namespace {

using namespace sg::packed;

constexpr int64_t kBlockBytes = 192 << 10;  // rows of x per block: this much of x, in L2
constexpr int64_t kGroupBytes = 1 << 20;  // panels per group: this much weight, in L3
constexpr int64_t kRunPanels = 8;  // panels per work item when all rows are one block
constexpr size_t kHugePage = size_t(2) << 20;

sg::Avx512Path wide_path;

// Rows per tile on this CPU: AVX-512's 12 where it has it (and tests have not turned it off).
int64_t tile_height() { return wide_path.on() ? kWideRows : kRows; }

template <typename P>
void any_tile_rows(int64_t height, const float* A, int64_t lda, int64_t rows, const P* panel,
                   int64_t K, float* C, int64_t ldc, const float* bias, int64_t cols,
                   float* kept = nullptr) {
  if (height == kWideRows) {
    wide_tile_rows(A, lda, rows, panel, K, C, ldc, bias, cols, kept);
  } else {
    tile_rows(A, lda, rows, panel, K, C, ldc, bias, cols);
  }
}

// f(m, rows) for tiles of at most ``height`` rows covering rows [0, M), as even as they
// divide (13 rows: 7 and 6, not 12 and 1: a short tile does few multiply-adds per load).
template <typename F>
void even_tiles(int64_t M, int64_t height, F&& f) {
  const int64_t tiles = (M + height - 1) / height, base = M / tiles, longer = M % tiles;
  for (int64_t t = 0, m = 0; t < tiles; ++t) {
    const int64_t rows = base + (t < longer ? 1 : 0);
    f(m, rows);
    m += rows;
  }
}

// Two panels' rows widened to float32 ([2][K][16], 64-byte aligned), one buffer a thread.
class KeptPanels {
 public:
  ~KeptPanels() { std::free(data_); }
  float* reserve(int64_t K) {
    if (K > K_) {
      std::free(data_);
      data_ = static_cast<float*>(std::aligned_alloc(64, size_t(2 * K * kCols) * sizeof(float)));
      TORCH_CHECK(data_ != nullptr, "out of memory keeping widened weight panels");
      K_ = K;
    }
    return data_;
  }

 private:
  float* data_ = nullptr;
  int64_t K_ = 0;
};

// Where a block's AVX-512 tiles keep the first tile's widened 16-bit panel rows for the
// others (nullptr: they do not). A 16-bit row costs two operations to widen in registers, on
// the ports that the tile's 24 multiply-adds use; the first tile stores each widened row (a
// port they do not use), and the block's other tiles load float32 rows instead, from the
// cache. bench/cpu_linear.py --dtype bfloat16 on a 2-vCPU Xeon with avx512_bf16 and no AMX,
// against oneDNN in the same run: 1.16-1.21x -> 1.38x at 32 rows, 1.13-1.27x -> 1.31x at
// 256, 1.08x -> 1.04-1.11x at 2,048. Its cost: 128 x K bytes a thread. A block of one tile
// (a decode step of at most 12 rows) keeps nothing.
template <typename P>
float* kept_panels(int64_t height, int64_t M, int64_t K) {
  if (std::is_same_v<P, float> || height != kWideRows || M <= kWideRows) return nullptr;
  thread_local KeptPanels kept;
  return kept.reserve(K);
}

// Rows [0, rows) of A times one panel, or two side by side (``p1`` given: AVX-512 tiles
// only), in one tile; ``kept0`` given: the panels' widened rows are stored there and at
// ``kept0 + K * kCols`` too.
template <typename P>
void one_tile(int64_t height, const float* A, int64_t lda, int64_t rows, const P* p0,
              const P* p1, int64_t K, float* C0, float* C1, int64_t ldc, const float* b0,
              const float* b1, int64_t cols0, int64_t cols1, float* kept0) {
  float* kept1 = kept0 == nullptr ? nullptr : kept0 + K * kCols;
  if (p1 != nullptr) {
    wide_pair_rows(A, lda, rows, p0, p1, K, C0, C1, ldc, b0, b1, cols0, cols1, kept0, kept1);
  } else {
    any_tile_rows(height, A, lda, rows, p0, K, C0, ldc, b0, cols0, kept0);
  }
}

// Rows [0, M) of A times one panel, or two side by side (``p1`` given: AVX-512 tiles only),
// in tiles of at most ``height`` rows.
template <typename P>
void panel_rows(int64_t height, const float* A, int64_t lda, int64_t M, const P* p0,
                const P* p1, int64_t K, float* C0, float* C1, int64_t ldc,
                const float* b0, const float* b1, int64_t cols0, int64_t cols1) {
  float* kept = kept_panels<P>(height, M, K);
  even_tiles(M, height, [&](int64_t m, int64_t rows) {
    const float* a = A + m * lda;
    if (kept != nullptr && m > 0) {
      one_tile<float>(height, a, lda, rows, kept, p1 == nullptr ? nullptr : kept + K * kCols,
                      K, C0 + m * ldc, C1 + m * ldc, ldc, b0, b1, cols0, cols1, nullptr);
    } else {
      one_tile(height, a, lda, rows, p0, p1, K, C0 + m * ldc, C1 + m * ldc, ldc, b0, b1,
               cols0, cols1, kept);
    }
  });
}

// Rows [0, M) of A times a gate panel and its up panel: silu(gate) * up into C.
template <typename P>
void gated_panel_rows(int64_t height, const float* A, int64_t lda, int64_t M, const P* gate,
                      const P* up, int64_t K, float* C, int64_t ldc,
                      const float* gate_bias, const float* up_bias, int64_t cols) {
  alignas(64) float g[kWideRows * kCols], u[kWideRows * kCols];
  float* kept = kept_panels<P>(height, M, K);
  even_tiles(M, height, [&](int64_t m, int64_t rows) {
    const float* a = A + m * lda;
    if (kept != nullptr && m > 0) {
      wide_pair_rows(a, lda, rows, static_cast<const float*>(kept), kept + K * kCols, K, g, u,
                     kCols, gate_bias, up_bias, cols, cols);
    } else if (height == kWideRows) {
      wide_pair_rows(a, lda, rows, gate, up, K, g, u, kCols, gate_bias, up_bias, cols, cols,
                     kept, kept == nullptr ? nullptr : kept + K * kCols);
    } else {
      any_tile_rows(height, a, lda, rows, gate, K, g, kCols, gate_bias, cols);
      any_tile_rows(height, a, lda, rows, up, K, u, kCols, up_bias, cols);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float* gr = g + r * kCols;
      const float* ur = u + r * kCols;
      float* c = C + (m + r) * ldc;
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) c[j] = gr[j] / (1.0f + std::exp(-gr[j])) * ur[j];
    }
  });
}

}  // namespace

std::string packed_linear_isa() { return tile_height() == kWideRows ? "avx512" : "avx2"; }

bool packed_linear_allow_avx512(bool allow) { return wide_path.allow(allow); }

at::Tensor pack_linear_weight(const at::Tensor& weight, bool gated) {
  TORCH_CHECK(weight.device().is_cpu() && sg::is_element(weight.scalar_type()) &&
                  weight.dim() == 2,
              "pack_linear_weight takes a 2-D float32, bfloat16 or float16 CPU weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(!gated || N % 2 == 0, "a gated weight has as many up rows as gate rows");
  const int64_t half = N / 2, half_panels = (half + kCols - 1) / kCols;
  const int64_t panels = gated ? 2 * half_panels : (N + kCols - 1) / kCols;
  const size_t bytes = std::max<size_t>(1, size_t(panels) * K * kCols * weight.element_size());
  const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  void* memory = std::aligned_alloc(kHugePage, rounded);
  TORCH_CHECK(memory != nullptr, "out of memory packing a ", N, "x", K, " weight");
  madvise(memory, rounded, MADV_HUGEPAGE);  // a hint: without it the pages are just smaller
  auto packed = at::from_blob(
      memory, {panels, K, kCols}, [](void* p) { std::free(p); }, weight.options());
  const auto source = weight.contiguous();
  sg::with_element(weight.scalar_type(), "the weight", [&](auto element) {
    using P = decltype(element);
    const P* w = static_cast<const P*>(source.data_ptr());
    P* out = static_cast<P*>(packed.data_ptr());
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        P* dst = out + p * K * kCols;
        // Gated: panel 2j is gate columns 16j.., panel 2j + 1 the same up columns.
        const int64_t first = gated ? (p % 2) * half + (p / 2) * kCols : p * kCols;
        const int64_t cols = gated ? std::min(kCols, half - (p / 2) * kCols)
                                   : std::min(kCols, N - p * kCols);
        std::fill(dst, dst + K * kCols, P(0.0f));
        for (int64_t j = 0; j < cols; ++j) {
          const P* row = w + (first + j) * K;
          for (int64_t k = 0; k < K; ++k) dst[k * kCols + j] = row[k];
        }
      }
    });
  });
  return packed;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const c10::optional<at::Tensor>& bias, bool gated) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "packed_linear runs on the CPU");
  TORCH_CHECK(x.dtype() == at::kFloat, "packed_linear takes float32 inputs");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "packed_linear takes rows with unit stride");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kCols && packed.is_contiguous(),
              "packed_linear takes a weight from pack_linear_weight");
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "x has ", K, " columns, the weight ", packed.size(1));
  // N: the weight's rows (gated: 2I, the output I wide). A unit is a panel, or (gated) a
  // gate panel and its up panel.
  const int64_t width = gated ? N / 2 : N;
  const int64_t units = gated ? panels / 2 : panels;
  TORCH_CHECK(!gated || (N % 2 == 0 && panels % 2 == 0), "N disagrees with the gated weight");
  TORCH_CHECK(width > (units - 1) * kCols && width <= units * kCols,
              "N disagrees with the weight");
  const float* bias_data = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dtype() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be a contiguous float32 vector of N values");
    bias_data = bias->data_ptr<float>();
  }
  auto out = at::empty({M, width}, x.options());
  if (M == 0) return out;
  const float* A = x.data_ptr<float>();
  const int64_t lda = x.stride(0);
  float* C = out.data_ptr<float>();
  // Blocked as a GEMM library blocks: rows in blocks whose slice of x stays in L2, panels in
  // groups that stay in the last-level cache. Work items are (group, block), group-major: a
  // group's panels come from memory once and serve every block of rows from the cache
  // (rather than all the weights streaming past once per block). With one block of rows (a
  // decode step) an item is a short run of panels instead, so that threads claiming items as
  // they go (parallel_items) stay balanced. Within an item the panels go by in order, which
  // the hardware prefetcher follows (software prefetching measured no better, and its branch
  // slowed large products).
  const int64_t height = tile_height();
  const int64_t row_bytes = K * int64_t(sizeof(float));
  const int64_t block_rows = std::max<int64_t>(height, kBlockBytes / row_bytes / height * height);
  const int64_t blocks = (M + block_rows - 1) / block_rows;
  const int64_t unit_bytes = K * packed.element_size() * kCols * (gated ? 2 : 1);
  const int64_t most_units = std::max<int64_t>(
      1, blocks == 1 ? kRunPanels / (gated ? 2 : 1) : kGroupBytes / unit_bytes);
  const int64_t groups = (units + most_units - 1) / most_units;
  const int64_t group_units = (units + groups - 1) / groups;
  sg::with_element(packed.scalar_type(), "the packed weight", [&](auto element) {
    using P = decltype(element);
    const P* B = static_cast<const P*>(packed.data_ptr());
    parallel_items(groups * blocks, [&](int64_t item) {
      const int64_t group = item / blocks, block = item % blocks;
      const int64_t m0 = block * block_rows, rows = std::min(block_rows, M - m0);
      const int64_t first = group * group_units, last = std::min(units, first + group_units);
      for (int64_t j = first; j < last;) {
        const int64_t cols = std::min(kCols, width - j * kCols);
        float* c = C + m0 * width + j * kCols;
        if (gated) {
          const P* gate = B + 2 * j * K * kCols;
          gated_panel_rows(height, A + m0 * lda, lda, rows, gate, gate + K * kCols, K, c, width,
                           bias_data == nullptr ? nullptr : bias_data + j * kCols,
                           bias_data == nullptr ? nullptr : bias_data + width + j * kCols, cols);
          ++j;
          continue;
        }
        // AVX-512 tiles take this item's panels two at a time.
        const bool pair = height == kWideRows && j + 1 < last;
        const int64_t cols1 = pair ? std::min(kCols, width - (j + 1) * kCols) : 0;
        const float* bias0 = bias_data == nullptr ? nullptr : bias_data + j * kCols;
        panel_rows(height, A + m0 * lda, lda, rows, B + j * K * kCols,
                   pair ? B + (j + 1) * K * kCols : nullptr, K, c, c + kCols, width, bias0,
                   bias0 == nullptr || !pair ? nullptr : bias0 + kCols, cols, cols1);
        j += pair ? 2 : 1;
      }
    });
  });
  return out;
}

#else

bool packed_linear_supported() { return false; }

std::string packed_linear_isa() { return "none"; }

bool packed_linear_allow_avx512(bool) { return false; }

at::Tensor pack_linear_weight(const at::Tensor&, bool) {
  TORCH_CHECK(false, "packed_linear needs AVX2 and FMA");
}

at::Tensor packed_linear(const at::Tensor&, const at::Tensor&, int64_t,
                         const c10::optional<at::Tensor>&, bool) {
  TORCH_CHECK(false, "packed_linear needs AVX2 and FMA");
}

#endif
