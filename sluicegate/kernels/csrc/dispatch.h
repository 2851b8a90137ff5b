// Run-time choices between compiled code: a count picking the template compiled for it, and
// a kernel's AVX-512 path (compiled by attribute) taken only where the CPU has it.
#pragma once

#include <atomic>
#include <cstdint>
#include <type_traits>

namespace sg {

// f(std::integral_constant<int, N>{}) for N = n, 1 <= n <= Max (n below 1 runs as 1).
template <int Max, typename F>
void with_count(int64_t n, F&& f) {
  if constexpr (Max > 1) {
    if (n < Max) return with_count<Max - 1>(n, f);
  }
  f(std::integral_constant<int, Max>{});
}

// A kernel's AVX-512 path: on where the CPU has AVX-512F, unless turned off (tests and benches
// do, through each kernel's *_allow_avx512, to run its AVX2 path).
class Avx512Path {
 public:
  bool on() const { return cpu_has() && allowed_.load(std::memory_order_relaxed); }
  // Returns the previous setting.
  bool allow(bool allowed) { return allowed_.exchange(allowed); }

 private:
  static bool cpu_has() {
    static const bool has = __builtin_cpu_supports("avx512f");
    return has;
  }
  std::atomic<bool> allowed_{true};
};

}  // namespace sg
