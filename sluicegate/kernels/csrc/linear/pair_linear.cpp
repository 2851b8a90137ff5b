// y = x @ W^T on the CPU for bfloat16 x and W with the CPU's bfloat16 dot products
// (AVX512_BF16's vdpbf16ps: two products of bfloat16 pairs added to a float32 accumulator per
// lane, one instruction doing the work of two float32 multiply-adds), float32 sums, the output
// rounded to bfloat16 as torch's bfloat16 linear rounds it.
//
// pack:    w [N, K] bfloat16 -> [P, ceil(K / 2), 16, 2] (P = ceil(N / 16) panels of 16
//          columns; panel p, pair k holds w[16 p + j][2 k] and w[16 p + j][2 k + 1] side by
//          side for each of its 16 columns j; columns past N and the odd K's last second
//          element are zero)
// linear:  x [M, K] bfloat16 (rows of unit stride), packed, N -> [M, N] bfloat16
//
// A unit is four panels (64 columns; the last may have fewer) and a register tile is six rows
// by a unit (24 accumulators): per pair of k, four panel loads and one 32-bit broadcast of
// each row's pair of x. Six rows by four panels ran ~8 % faster than twelve by two on a
// 2-core AVX-512 EPYC (1,008 rows, SmolLM2's shapes, 213-217 -> 220-232 GFLOP/s a thread).
// Rows go in blocks that stay in L2, units in runs, so that threads claiming items as they
// go (parallel_items) stay balanced; inside an open parallel region (a decoder layer's
// two-thread tail, csrc/linear/split_mlp.cpp) the calling thread runs it all. Compiled for
// AVX512_BF16 by attribute, run only where the CPU has it (pair_linear_supported()).
//
// Summation runs over pairs of k in order, each vdpbf16ps adding its two products to the
// accumulator: not float32's one multiply-add per k, so results may differ from
// torch.nn.functional.linear in float32's last bits before the bfloat16 rounding, as
// oneDNN's bfloat16 GEMM (the same instruction, its own blocking) does.
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "dispatch.h"
#include "parallel_items.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define SG_PAIRS 1
#endif

#ifdef SG_PAIRS

namespace {

constexpr int64_t kCols = 16;
constexpr int64_t kUnit = 4;         // panels a tile spans
constexpr int64_t kBlockRows = 240;  // 240 rows of K = 1,536: 720 KiB of x, inside L2
constexpr int64_t kRunUnits = 2;     // units per work item when rows are one block
constexpr int64_t kItemsPerThread = 8;

#define SG_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// Rows of a tile by Q panels: 24 accumulators where Q allows.
constexpr int tile_rows(int Q) { return Q >= 4 ? 6 : Q == 3 ? 8 : 12; }

// Rows [0, R) of x times Q panels from ``p`` (``panel`` elements apart) into C, ``cols`` of
// the panels' columns real.
template <int R, int Q>
SG_TARGET void tile(const uint16_t* x, int64_t ldx, const uint16_t* p, int64_t panel,
                    int64_t pairs, bool odd, uint16_t* C, int64_t ldc, int64_t cols) {
  __m512 acc[R][Q];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int q = 0; q < Q; ++q) acc[r][q] = _mm512_setzero_ps();
  const int64_t full = odd ? pairs - 1 : pairs;
  for (int64_t k = 0; k < full; ++k) {
    __m512bh b[Q];
#pragma GCC unroll 4
    for (int q = 0; q < Q; ++q) b[q] = (__m512bh)_mm512_loadu_si512(p + q * panel + k * 2 * kCols);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * k, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int q = 0; q < Q; ++q) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], a, b[q]);
    }
  }
  if (odd) {  // x's last value alone: its pair's second half is zero
    const int64_t k = pairs - 1;
    __m512bh b[Q];
#pragma GCC unroll 4
    for (int q = 0; q < Q; ++q) b[q] = (__m512bh)_mm512_loadu_si512(p + q * panel + k * 2 * kCols);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(x[r * ldx + 2 * k]);
#pragma GCC unroll 4
      for (int q = 0; q < Q; ++q) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], a, b[q]);
    }
  }
  __mmask16 masks[Q];
#pragma GCC unroll 4
  for (int q = 0; q < Q; ++q) {
    const int64_t real = std::clamp<int64_t>(cols - q * kCols, 0, kCols);
    masks[q] = real == kCols ? __mmask16(0xFFFF) : __mmask16((1u << real) - 1);
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int q = 0; q < Q; ++q)
      _mm256_mask_storeu_epi16(C + r * ldc + q * kCols, masks[q],
                               (__m256i)_mm512_cvtneps_pbh(acc[r][q]));
}

// Rows [0, M) of x times a unit of Q panels, in tiles as even as they divide.
template <int Q>
SG_TARGET void unit_rows(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* p,
                         int64_t panel, int64_t pairs, bool odd, uint16_t* C, int64_t ldc,
                         int64_t cols) {
  constexpr int kRows = tile_rows(Q);
  const int64_t tiles = (M + kRows - 1) / kRows;
  for (int64_t t = 0, m = 0; t < tiles; ++t) {
    const int64_t rows = (M - m) / (tiles - t);
    sg::with_count<kRows>(rows, [&](auto r) {
      tile<decltype(r)::value, Q>(x + m * ldx, ldx, p, panel, pairs, odd, C + m * ldc, ldc,
                                  cols);
    });
    m += rows;
  }
}

}  // namespace

bool pair_linear_supported() { return sg::Bf16Dots::has(); }

at::Tensor pack_pair_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 &&
                  weight.dim() == 2,
              "pack_pair_weight takes a 2-D bfloat16 CPU weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t panels = (N + kCols - 1) / kCols, pairs = (K + 1) / 2;
  auto packed = at::zeros({panels, pairs, kCols, 2}, weight.options());
  const auto source = weight.contiguous();
  const uint16_t* w = reinterpret_cast<const uint16_t*>(source.data_ptr());
  uint16_t* out = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::clamp<int64_t>(N - p * kCols, 0, kCols);
      uint16_t* dst = out + p * pairs * kCols * 2;
      for (int64_t j = 0; j < cols; ++j) {
        const uint16_t* row = w + (p * kCols + j) * K;
        for (int64_t k = 0; k < K; ++k) dst[((k / 2) * kCols + j) * 2 + k % 2] = row[k];
      }
    }
  });
  return packed;
}

at::Tensor pair_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(sg::Bf16Dots::has(), "pair_linear needs a CPU with AVX512_BF16");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  x.stride(1) == 1,
              "pair_linear takes 2-D bfloat16 CPU rows of unit stride");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                  packed.size(2) == kCols && packed.size(3) == 2 && packed.is_contiguous(),
              "pair_linear takes a weight from pack_pair_weight");
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0), pairs = packed.size(1);
  TORCH_CHECK(pairs == (K + 1) / 2, "x has ", K, " columns, the weight ", 2 * pairs);
  TORCH_CHECK(N > (panels - 1) * kCols && N <= panels * kCols, "N disagrees with the weight");
  auto out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const uint16_t* A = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* B = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  uint16_t* C = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t lda = x.stride(0), panel = pairs * kCols * 2;
  const int64_t units = (panels + kUnit - 1) / kUnit;
  const int64_t blocks = (M + kBlockRows - 1) / kBlockRows;
  // Items: (block of rows, run of units). One block (a decode step): short runs. Several:
  // longer runs, as many as keep every thread's share even (a block's x stays in L2 while
  // its run of the weight streams past).
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const int64_t runs_per_block =
      blocks == 1 ? (units + kRunUnits - 1) / kRunUnits
                  : std::min(units, (kItemsPerThread * threads + blocks - 1) / blocks);
  const int64_t run = (units + runs_per_block - 1) / runs_per_block;
  const int64_t runs = (units + run - 1) / run;
  const bool odd = K % 2 == 1;
  parallel_items(blocks * runs, [&](int64_t item) {
    const int64_t block = item / runs, first = (item % runs) * run;
    const int64_t m0 = block * kBlockRows, rows = std::min(kBlockRows, M - m0);
    for (int64_t u = first; u < std::min(units, first + run); ++u) {
      const uint16_t* p = B + u * kUnit * panel;
      const int64_t cols = std::min(kUnit * kCols, N - u * kUnit * kCols);
      const int64_t count = std::min(kUnit, panels - u * kUnit);
      sg::with_count<kUnit>(count, [&](auto q) {
        unit_rows<decltype(q)::value>(A + m0 * lda, lda, rows, p, panel, pairs, odd,
                                      C + m0 * N + u * kUnit * kCols, N, cols);
      });
    }
  });
  return out;
}

#else

bool pair_linear_supported() { return false; }

at::Tensor pack_pair_weight(const at::Tensor&) {
  TORCH_CHECK(false, "pack_pair_weight needs an x86-64 build");
}

at::Tensor pair_linear(const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "pair_linear needs an x86-64 build");
}

#endif
