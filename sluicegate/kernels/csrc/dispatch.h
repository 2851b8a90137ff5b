// A count known only at run time picking the template compiled for it.
#pragma once

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

}  // namespace sg
