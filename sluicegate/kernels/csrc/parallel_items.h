// Work items handed out one at a time to whichever of torch's threads asks next.
//
// at::parallel_for splits a range into one fixed share per thread, so a step waits for the
// slowest share: on a small machine a thread that is not scheduled for a while (another
// process on its core, a sleeping OpenMP worker waking up) stalls the whole operation.
// Claimed item by item, the running threads take over the work of one that is late.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>

template <typename F>
void parallel_items(int64_t items, const F& run) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t item = 0; item < items; ++item) run(item);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t item = next.fetch_add(1); item < items; item = next.fetch_add(1)) run(item);
  });
}
