// A gated MLP on two threads in one parallel region, with oneDNN's products.
//
// split_mlp(x [T, H], gate_up [w0, w1], down [w0, w1], intermediate I, by_columns) -> [T, H]
//   gate_up[t]: oneDNN-packed rows [gate slice t; up slice t] of the gate/up weight, slice t
//               being intermediate columns [t I/2, (t + 1) I/2)
//   down[t]:    oneDNN-packed output rows [t H/2, (t + 1) H/2) of the down weight
//
// by_columns (a decode step's few rows): thread t runs its gate/up slice, SiLU x mul into its
// half of h [T, I], waits for the other half, then its half of the down product's columns.
// Otherwise (a prefill's rows, where the products are long enough to keep both threads busy
// on any split): each thread runs both halves for half of the rows, with no wait. Every output
// value is one oneDNN product over the whole of its inputs, as in the unsplit MLP.
//
// Why: a decode step's products stream their weights from memory, at about one core's
// bandwidth on one thread. Two threads double it, but where idle OpenMP threads sleep
// (OMP_WAIT_POLICY=PASSIVE) each parallel region pays for waking the other thread, about as
// long as a small product takes; unsplit, the MLP is two or three regions (gate/up, SiLU x mul,
// down), here one. The wait between the halves is a spin on an atomic counter: both threads
// are working, and the wait lasts only as long as the two gate/up halves differ.
//
// Inside the region oneDNN and the SiLU kernel see an OpenMP region already open and run on the
// calling thread. With one thread, or nested in another region, the halves run in turn.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <omp.h>

#include <atomic>
#include <exception>
#include <string>
#include <vector>

at::Tensor silu_and_mul(const at::Tensor& x);

namespace {

inline void spin_pause() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_ia32_pause();
#endif
}

// torch's mkldnn::_linear_pointwise (what Inductor calls for a packed oneDNN weight): x
// [T, K] dense, weight packed by mkldnn::_reorder_linear_weight, no bias, no post-op.
at::Tensor packed_product(const at::Tensor& x, const at::Tensor& weight) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, weight, c10::IValue(), std::string("none"),
                                 c10::List<std::optional<at::Scalar>>(), c10::IValue()};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// Both halves on the calling thread: silu(gate) * up of each into h, then each half of down.
at::Tensor whole_mlp(const at::Tensor& x, const std::vector<at::Tensor>& gate_up,
                     const std::vector<at::Tensor>& down) {
  const at::Tensor h = at::cat({silu_and_mul(packed_product(x, gate_up[0])),
                                silu_and_mul(packed_product(x, gate_up[1]))},
                               1);
  return at::cat({packed_product(h, down[0]), packed_product(h, down[1])}, 1);
}

// run(t) for t = 0 and 1 on two OpenMP threads at once, each with the caller's inference
// mode (thread-local); an exception in either is raised here, after both have ended.
template <typename F>
void on_two_threads(const F& run) {
  std::exception_ptr failures[2];
  const bool inference = c10::InferenceMode::is_enabled();
#pragma omp parallel num_threads(2)
  {
    c10::InferenceMode guard(inference);
    for (int t = omp_get_thread_num(); t < 2; t += omp_get_num_threads()) {
      try {
        run(t, omp_get_num_threads() == 2);
      } catch (...) {
        failures[t] = std::current_exception();
      }
    }
  }
  for (const auto& failure : failures) {
    if (failure) std::rethrow_exception(failure);
  }
}

}  // namespace

at::Tensor split_mlp(const at::Tensor& x, const std::vector<at::Tensor>& gate_up,
                     const std::vector<at::Tensor>& down, int64_t intermediate, bool by_columns) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous rows");
  TORCH_CHECK(gate_up.size() == 2 && down.size() == 2, "two halves of each weight");
  TORCH_CHECK(intermediate % 2 == 0, "the intermediate size must be even");
  const int64_t T = x.size(0), half = intermediate / 2;
  if (omp_in_parallel() || omp_get_max_threads() < 2) return whole_mlp(x, gate_up, down);
  if (!by_columns) {
    if (T < 2) return whole_mlp(x, gate_up, down);
    // A prefill's rows: each thread the whole MLP for half of them (no wait between phases).
    std::vector<at::Tensor> outs(2);
    const int64_t first_rows = T / 2;
    on_two_threads([&](int t, bool) {
      const at::Tensor rows =
          t == 0 ? x.narrow(0, 0, first_rows) : x.narrow(0, first_rows, T - first_rows);
      outs[t] = whole_mlp(rows, gate_up, down);
    });
    return at::cat({outs[0], outs[1]}, 0);
  }
  auto h = at::empty({T, intermediate}, x.options());
  std::vector<at::Tensor> outs(2);
  std::atomic<int> halves_done{0};
  std::atomic<bool> failed{false};
  on_two_threads([&](int t, bool concurrent) {
    try {
      h.narrow(1, t * half, half).copy_(silu_and_mul(packed_product(x, gate_up[t])));
    } catch (...) {
      failed = true;
      halves_done.fetch_add(1, std::memory_order_release);
      throw;
    }
    halves_done.fetch_add(1, std::memory_order_release);
    if (!concurrent) return;  // one thread: both halves of h first, then down below
    while (halves_done.load(std::memory_order_acquire) < 2) spin_pause();
    if (!failed) outs[t] = packed_product(h, down[t]);
  });
  for (int t = 0; t < 2; ++t) {
    if (!outs[t].defined()) outs[t] = packed_product(h, down[t]);
  }
  return at::cat({outs[0], outs[1]}, 1);
}
