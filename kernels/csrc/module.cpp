// The CPU kernels' Python module: one extension, so a machine compiles them once together.
#include <torch/extension.h>

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, double scale);
bool packed_linear_supported();
at::Tensor pack_linear_weight(const at::Tensor& weight);
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                            const c10::optional<at::Tensor>& bias);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Decode attention read through block tables (CPU)");
  m.def("packed_linear_supported", &packed_linear_supported,
        "Whether packed_linear was built (AVX2 and FMA)");
  m.def("pack_linear_weight", &pack_linear_weight, "A linear weight in 16-column panels");
  m.def("packed_linear", &packed_linear, "x @ W^T (+ bias) with W from pack_linear_weight");
}
