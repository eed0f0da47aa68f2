// The float32 multiply-add peak of this CPU with this flavour's vectors, for `pkv bench
// --roofline`: how close the GEMMs run to what the cores can do at all.
//
//   fma_peak_gflops(iters)   every thread runs `iters` rounds of twelve independent
//                            multiply-add chains on native vectors; GFLOP/s over the wall time
//
// Twelve chains cover an FMA's latency (4-5 cycles) times its ports (2) on current x86 and
// ARM cores, so the loop is bound by FMA throughput alone.
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdint>
#include <vector>

#include "vec_math.h"

namespace peak {

// Named accumulators, not an array: GCC kept an array of vectors in memory across the loop.
inline float fma_chains(int64_t iters, float seed) {
  // Each chain tends to c / (1 - b) = 1: no overflow, no denormals, however long it runs.
  const vfn b = vfn{} + 0.9999999f, c = vfn{} + 1e-7f;
  vfn a0 = vfn{} + seed, a1 = a0 + 1.f, a2 = a0 + 2.f, a3 = a0 + 3.f, a4 = a0 + 4.f,
      a5 = a0 + 5.f, a6 = a0 + 6.f, a7 = a0 + 7.f, a8 = a0 + 8.f, a9 = a0 + 9.f,
      a10 = a0 + 10.f, a11 = a0 + 11.f;
  for (int64_t i = 0; i < iters; ++i) {
    a0 = a0 * b + c; a1 = a1 * b + c; a2 = a2 * b + c; a3 = a3 * b + c;
    a4 = a4 * b + c; a5 = a5 * b + c; a6 = a6 * b + c; a7 = a7 * b + c;
    a8 = a8 * b + c; a9 = a9 * b + c; a10 = a10 * b + c; a11 = a11 * b + c;
  }
  const vfn sum = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)) + ((a8 + a9) + (a10 + a11));
  return sum[0];
}

}  // namespace peak

double fma_peak_gflops(int64_t iters) {
  TORCH_CHECK(iters > 0, "fma_peak_gflops: iters must be positive");
  const int64_t threads = at::get_num_threads();
  std::vector<float> sink(threads);
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) sink[t] = peak::fma_chains(iters, static_cast<float>(t));
  });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile float kept = 0.f;  // the chains' results are used: the loop cannot be dropped
  for (float s : sink) kept = kept + s;
  return static_cast<double>(threads) * iters * 12 * kLanes * 2 / seconds / 1e9;
}
