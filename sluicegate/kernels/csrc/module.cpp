// The CPU kernels' Python module: one extension, so a machine compiles them once together.
#include <torch/extension.h>

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, double scale);
bool paged_decode_allow_avx512(bool allow);
bool paged_prefill_allow_avx512(bool allow);
bool paged_prefill_allow_bf16_dots(bool allow);
bool paged_prefill_supported(int64_t head_dim, int64_t block_size);
void paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens,
                   const at::Tensor& cu_seqlens_q, const at::Tensor& requests, double scale,
                   at::Tensor& out);
bool packed_linear_supported();
std::string packed_linear_isa();
bool packed_linear_allow_avx512(bool allow);
at::Tensor pack_linear_weight(const at::Tensor& weight, bool gated);
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const c10::optional<at::Tensor>& bias, bool gated);
bool pair_linear_supported();
at::Tensor pack_pair_weight(const at::Tensor& weight);
at::Tensor pair_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N);

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& x);
bool layer_ops_allow_avx512(bool allow);
at::Tensor split_mlp(const at::Tensor& x, const std::vector<at::Tensor>& gate_up,
                     const std::vector<at::Tensor>& down, int64_t intermediate, bool by_columns);
at::Tensor split_layer_tail(const at::Tensor& attn, at::Tensor& residual,
                            const std::vector<at::Tensor>& o, const at::Tensor& norm_weight,
                            double eps, const std::vector<at::Tensor>& gate_up,
                            const std::vector<at::Tensor>& down, int64_t intermediate,
                            bool by_columns);
void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
void store_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
              at::Tensor& v_cache, const at::Tensor& slots);

at::Tensor dequantize_fp8(const at::Tensor& weight, const at::Tensor& scales, int64_t group);
at::Tensor dequantize_int(const at::Tensor& codes, const at::Tensor& zeros,
                          const at::Tensor& scales, int64_t bits, int64_t group,
                          int64_t columns);
at::Tensor linear_fp8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                      int64_t group);
at::Tensor linear_int(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& zeros,
                      const at::Tensor& scales, int64_t bits, int64_t group, int64_t columns);

// The kernels touch no Python object, so each lets go of the GIL while it runs: the worker's
// event loop (Redis I/O, replies) goes on beside a step, as it does beside torch's own ops.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_decode", &paged_decode, nogil, "Decode attention read through block tables (CPU)");
  m.def("paged_decode_allow_avx512", &paged_decode_allow_avx512,
        "Let paged_decode use AVX-512 where the CPU has it (tests and benches turn it off); "
        "returns the previous setting");
  m.def("paged_prefill_allow_avx512", &paged_prefill_allow_avx512,
        "Let paged_prefill use AVX-512 where the CPU has it (tests and benches turn it off); "
        "returns the previous setting");
  m.def("paged_prefill_allow_bf16_dots", &paged_prefill_allow_bf16_dots,
        "Let paged_prefill take bfloat16 queries' scores on AVX512_BF16's dot products where "
        "the CPU has them (tests and benches turn it off); returns the previous setting");
  m.def("paged_prefill_supported", &paged_prefill_supported,
        "Whether paged_prefill runs this head_dim and block_size here");
  m.def("paged_prefill", &paged_prefill, nogil,
        "Causal attention of several queries per request, through block tables (CPU)");
  m.def("packed_linear_supported", &packed_linear_supported,
        "Whether packed_linear was built (AVX2 and FMA)");
  m.def("packed_linear_isa", &packed_linear_isa,
        "The vector instructions packed_linear uses here: avx512, avx2 or none");
  m.def("packed_linear_allow_avx512", &packed_linear_allow_avx512,
        "Let packed_linear use AVX-512 where the CPU has it (tests and benches turn it off); "
        "returns the previous setting");
  m.def("pack_linear_weight", &pack_linear_weight, nogil, "A linear weight in 16-column panels");
  m.def("packed_linear", &packed_linear, nogil, "x @ W^T (+ bias) with W from pack_linear_weight");
  m.def("pair_linear_supported", &pair_linear_supported,
        "Whether this CPU has the bfloat16 dot products pair_linear needs (AVX512_BF16)");
  m.def("pack_pair_weight", &pack_pair_weight, nogil, "A bfloat16 weight in panels of k pairs");
  m.def("pair_linear", &pair_linear, nogil,
        "x @ W^T in bfloat16 with W from pack_pair_weight (bfloat16 dot products)");
  m.def("rms_norm", &rms_norm, nogil, "RMSNorm of each row");
  m.def("add_rms_norm_", &add_rms_norm_, nogil, "residual += x; x = RMSNorm(residual), in place");
  m.def("silu_and_mul", &silu_and_mul, nogil, "silu(first half) * second half, per row");
  m.def("layer_ops_allow_avx512", &layer_ops_allow_avx512,
        "Let RMSNorm and SiLU x mul use AVX-512 on 16-bit rows where the CPU has it (tests and "
        "benches turn it off); returns the previous setting");
  m.def("split_mlp", &split_mlp, nogil,
        "A gated MLP on two threads in one region, oneDNN's packed products split by columns");
  m.def("split_layer_tail", &split_layer_tail, nogil,
        "A decoder layer after its attention on two threads in one region: output projection, "
        "residual add and RMSNorm, gated MLP");
  m.def("rotary_", &rotary_, nogil, "neox-style rotary embedding, in place");
  m.def("store_kv", &store_kv, nogil, "each token's K/V rows into its cache slot");
  m.def("dequantize_fp8", &dequantize_fp8, nogil, "e4m3 weight rows times their scales");
  m.def("dequantize_int", &dequantize_int, nogil,
        "(code - zero) * scale of 4- or 8-bit weight rows, per group");
  m.def("linear_fp8", &linear_fp8, nogil, "x @ the dequantized fp8 weight^T, row by row");
  m.def("linear_int", &linear_int, nogil, "x @ the dequantized int weight^T, row by row");
}
