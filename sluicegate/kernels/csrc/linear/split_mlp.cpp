// A gated MLP on two threads in one parallel region, with oneDNN's products; or the whole of a
// decoder layer after its attention (output projection, residual add and RMSNorm, MLP).
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
// down), here one. The wait between the halves is a spin on an atomic counter (Phases): both
// threads are working, and the wait lasts only as long as the two gate/up halves differ.
//
// split_layer_tail(attn [T, A], residual [T, H], o [w0, w1], norm_weight [H], eps, gate_up,
//                  down, intermediate) -> the MLP's output [T, H], residual += the projection
//   o[t]: oneDNN-packed output rows [t H/2, (t + 1) H/2) of the output projection's weight
// by_columns (a decode step's rows, at most a few hundred): thread t runs its half of the output
// projection's columns, then (once both halves are in) the residual add and RMSNorm of half
// of the rows, then the MLP by columns as above. One wake-up where the unsplit layer pays one
// for the MLP and runs its output projection on one thread (too short to pay for a second).
// Otherwise the three run in turn, each with both threads (the MLP split by rows).
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

void silu_and_mul_into(const at::Tensor& x, at::Tensor& out);
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
at::Tensor pair_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N);

namespace {

inline void spin_pause() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_ia32_pause();
#endif
}

// x [T, K] dense times a weight packed by mkldnn::_reorder_linear_weight (through torch's
// mkldnn::_linear_pointwise, what Inductor calls for one; no bias, no post-op) or by
// pack_pair_weight (its 4-D panels of k pairs: pair_linear, N the panels' real columns).
at::Tensor packed_product(const at::Tensor& x, const at::Tensor& weight) {
  if (weight.dim() == 4) return pair_linear(x, weight, weight.size(0) * weight.size(2));
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, weight, c10::IValue(), std::string("none"),
                                 c10::List<std::optional<at::Scalar>>(), c10::IValue()};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// silu(gate) * up of x's gate/up half t, written into its column half of h.
void activate_half(const at::Tensor& x, const at::Tensor& gate_up, at::Tensor& h, int t) {
  const int64_t half = h.size(1) / 2;
  at::Tensor columns = h.narrow(1, t * half, half);
  silu_and_mul_into(packed_product(x, gate_up), columns);
}

// Both halves on the calling thread: silu(gate) * up of each into h, then each half of down.
at::Tensor whole_mlp(const at::Tensor& x, const std::vector<at::Tensor>& gate_up,
                     const std::vector<at::Tensor>& down, int64_t intermediate) {
  at::Tensor h = at::empty({x.size(0), intermediate}, x.options());
  activate_half(x, gate_up[0], h, 0);
  activate_half(x, gate_up[1], h, 1);
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

// Both threads' phases in turn: each phase waits for the other thread's part of the one
// before (a spin on a counter of finished parts). A failure in either thread ends both
// (the other stops at its next wait); the caller rethrows it.
class Phases {
 public:
  bool next(int phase) {
    done_.fetch_add(1, std::memory_order_acq_rel);
    while (done_.load(std::memory_order_acquire) < 2 * phase) {
      if (failed_.load(std::memory_order_acquire)) return false;
      spin_pause();
    }
    return !failed_.load(std::memory_order_acquire);
  }
  void fail() { failed_.store(true, std::memory_order_release); }

 private:
  std::atomic<int> done_{0};
  std::atomic<bool> failed_{false};
};

}  // namespace

at::Tensor split_mlp(const at::Tensor& x, const std::vector<at::Tensor>& gate_up,
                     const std::vector<at::Tensor>& down, int64_t intermediate, bool by_columns) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous rows");
  TORCH_CHECK(gate_up.size() == 2 && down.size() == 2, "two halves of each weight");
  TORCH_CHECK(intermediate % 2 == 0, "the intermediate size must be even");
  const int64_t T = x.size(0);
  if (omp_in_parallel() || omp_get_max_threads() < 2) {
    return whole_mlp(x, gate_up, down, intermediate);
  }
  if (!by_columns) {
    if (T < 2) return whole_mlp(x, gate_up, down, intermediate);
    // A prefill's rows: each thread the whole MLP for half of them (no wait between phases).
    std::vector<at::Tensor> outs(2);
    const int64_t first_rows = T / 2;
    on_two_threads([&](int t, bool) {
      const at::Tensor rows =
          t == 0 ? x.narrow(0, 0, first_rows) : x.narrow(0, first_rows, T - first_rows);
      outs[t] = whole_mlp(rows, gate_up, down, intermediate);
    });
    return at::cat({outs[0], outs[1]}, 0);
  }
  auto h = at::empty({T, intermediate}, x.options());
  std::vector<at::Tensor> outs(2);
  Phases phases;
  on_two_threads([&](int t, bool both) {
    if (!both) return;  // OpenMP gave one thread: it runs the MLP whole, after the region
    try {
      activate_half(x, gate_up[t], h, t);
      if (!phases.next(1)) return;
      outs[t] = packed_product(h, down[t]);
    } catch (...) {
      phases.fail();
      throw;
    }
  });
  if (!outs[0].defined()) return whole_mlp(x, gate_up, down, intermediate);
  return at::cat({outs[0], outs[1]}, 1);
}

at::Tensor split_layer_tail(const at::Tensor& attn, at::Tensor& residual,
                            const std::vector<at::Tensor>& o, const at::Tensor& norm_weight,
                            double eps, const std::vector<at::Tensor>& gate_up,
                            const std::vector<at::Tensor>& down, int64_t intermediate,
                            bool by_columns) {
  TORCH_CHECK(attn.dim() == 2 && attn.is_contiguous(), "attn must be contiguous rows");
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() && residual.size(0) == attn.size(0),
              "residual must be contiguous rows, one per attention row");
  TORCH_CHECK(o.size() == 2 && gate_up.size() == 2 && down.size() == 2,
              "two halves of each weight");
  TORCH_CHECK(intermediate % 2 == 0, "the intermediate size must be even");
  TORCH_CHECK(residual.size(1) % 2 == 0, "the hidden size must be even");
  const int64_t T = attn.size(0), H = residual.size(1);
  const bool concurrent = !omp_in_parallel() && omp_get_max_threads() >= 2;
  const auto in_turn = [&](bool split_rows) {
    at::Tensor x = at::cat({packed_product(attn, o[0]), packed_product(attn, o[1])}, 1);
    add_rms_norm_(x, residual, norm_weight, eps);
    return split_rows ? split_mlp(x, gate_up, down, intermediate, false)
                      : whole_mlp(x, gate_up, down, intermediate);
  };
  // A prefill's rows keep both threads busy in each part's own parallel regions.
  if (!concurrent || !by_columns) return in_turn(concurrent);
  auto x = at::empty({T, H}, attn.options());
  auto h = at::empty({T, intermediate}, attn.options());
  std::vector<at::Tensor> outs(2);
  Phases phases;
  const int64_t first_rows = T / 2;
  on_two_threads([&](int t, bool both) {
    if (!both) return;  // OpenMP gave one thread: it runs the layer in turn, after the region
    try {
      at::Tensor product = packed_product(attn, o[t]);
      TORCH_CHECK(product.size(1) == H / 2, "each output projection half gives half of H");
      x.narrow(1, t * (H / 2), H / 2).copy_(product);
      if (!phases.next(1)) return;
      const int64_t begin = t == 0 ? 0 : first_rows, rows = t == 0 ? first_rows : T - first_rows;
      if (rows > 0) {
        at::Tensor x_rows = x.narrow(0, begin, rows);
        at::Tensor residual_rows = residual.narrow(0, begin, rows);
        add_rms_norm_(x_rows, residual_rows, norm_weight, eps);
      }
      if (!phases.next(2)) return;
      activate_half(x, gate_up[t], h, t);
      if (!phases.next(3)) return;
      outs[t] = packed_product(h, down[t]);
    } catch (...) {
      phases.fail();
      throw;
    }
  });
  if (!outs[0].defined()) return in_turn(false);
  return at::cat({outs[0], outs[1]}, 1);
}
