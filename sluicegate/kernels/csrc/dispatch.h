// Run-time choices between compiled code: a count picking the template compiled for it, and
// a kernel's AVX-512 (or AVX512_BF16) path, compiled by attribute, taken only where the CPU
// has it.
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

// Where the CPU has AVX-512F.
struct Avx512 {
  static bool has() {
    static const bool has = __builtin_cpu_supports("avx512f");
    return has;
  }
};

// Where the CPU has AVX512_BF16's dot products (vdpbf16ps), and the AVX-512 they extend.
struct Bf16Dots {
  static bool has() {
    static const bool has = __builtin_cpu_supports("avx512f") &&
                            __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vl") &&
                            __builtin_cpu_supports("avx512bf16");
    return has;
  }
};

// A kernel's path compiled by attribute for ``Cpu``'s instructions: on where the CPU has them,
// unless turned off (tests and benches do, through the kernel's *_allow_* switch, to run the
// path beneath it).
template <typename Cpu>
class KernelPath {
 public:
  bool on() const { return Cpu::has() && allowed_.load(std::memory_order_relaxed); }
  // Returns the previous setting.
  bool allow(bool allowed) { return allowed_.exchange(allowed); }

 private:
  std::atomic<bool> allowed_{true};
};

using Avx512Path = KernelPath<Avx512>;

}  // namespace sg
