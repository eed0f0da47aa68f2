// A team of threads held for one whole decoder forward, and the parallel loop every kernel
// runs through (`parallel_for` below).
//
// A batch-1 step of a 4-bit model runs ~150 parallel loops (four GEMVs and an attention per
// layer) of 5-70 us each. Through at::parallel_for each one is an OpenMP region: torch's
// wrapper and libgomp's team start took ~1 us before either thread began its share, and the
// join as long again (4-bit SmolLM2-135M, two AVX2 threads, Zen 5: 0.28 ms of a 3.9 ms step,
// timed with rdtsc). Here the decoder opens one OpenMP region per forward: thread 0 runs the
// forward's code as before, and the others wait, spinning, for the loops it posts; a loop
// then costs one cache line each way.
//
// `parallel_for` splits a range exactly as at::parallel_for does (so every kernel computes the
// same values either way) and falls back to it outside a team. Inside a team, torch's own
// parallel ops run on thread 0 alone (OpenMP does not nest): the decoder uses a team only
// where its steps call nothing but these kernels (see CpuDecoder::forward).
#pragma once

#include <ATen/Parallel.h>
#include <omp.h>

#if defined(__linux__)
#include <sched.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <thread>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace team {

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Spins until done() holds; after a few thousand spins (tens of microseconds) it yields the
// core at each try, so threads sharing one core (more threads than CPUs, a CPU quota) still
// let the one they wait for run.
template <typename Done>
inline void wait_until(const Done& done) {
  for (int spins = 0; !done(); ++spins) {
    if (spins < 4096) {
      relax();
    } else {
      std::this_thread::yield();
    }
  }
}

class Team {
 public:
  // Runs f(begin, end) over the chunks of [begin, end) that at::parallel_for would make, one
  // per thread, thread 0 (the caller) taking the first; returns once every chunk is done, or
  // rethrows the first exception a chunk threw.
  template <typename F>
  void run(int64_t begin, int64_t end, int64_t grain, const F& f) {
    if (begin >= end) return;
    const int64_t n = end - begin;
    const int64_t g = std::max<int64_t>(grain, 1);
    const int64_t tasks = std::min<int64_t>(size_, (n + g - 1) / g);
    if (tasks <= 1) {
      f(begin, end);
      return;
    }
    job_ = &f;
    call_ = [](const void* fn, int64_t b, int64_t e) { (*static_cast<const F*>(fn))(b, e); };
    begin_ = begin;
    end_ = end;
    chunk_ = (n + tasks - 1) / tasks;
    // Every other thread checks in, with a chunk or without: none may still be reading this
    // loop's fields when the next one is posted.
    pending_.store(size_ - 1, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
    std::exception_ptr own;  // the others still run `f` until they check in
    try {
      f(begin, std::min(end, begin + chunk_));
    } catch (...) {
      own = std::current_exception();
    }
    wait_until([&] { return pending_.load(std::memory_order_acquire) == 0; });
    if (failed_.exchange(false, std::memory_order_relaxed) && !own) own = std::exchange(error_, nullptr);
    if (own) std::rethrow_exception(own);
  }

  // Thread `tid` (not 0) of the region: runs its chunk of every posted loop until `stop`.
  void serve(int tid) {
    uint64_t seen = 0;  // the team is new: no loop has been posted before this
    while (true) {
      uint64_t now = seen;
      wait_until([&] { return (now = generation_.load(std::memory_order_acquire)) != seen; });
      seen = now;
      if (stopping_) return;
      const int64_t b = begin_ + tid * chunk_;
      if (b < end_) {
        try {
          call_(job_, b, std::min(end_, b + chunk_));
        } catch (...) {
          if (!failed_.exchange(true)) error_ = std::current_exception();
        }
      }
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  void stop() {
    stopping_ = true;
    generation_.fetch_add(1, std::memory_order_release);
  }

  // Threads in the region, thread 0 included; set by thread 0 before it posts any loop.
  void set_size(int size) { size_ = size; }

 private:
  int size_ = 1;
  alignas(64) std::atomic<uint64_t> generation_{0};
  alignas(64) std::atomic<int64_t> pending_{0};
  const void* job_ = nullptr;
  void (*call_)(const void*, int64_t, int64_t) = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 0;
  bool stopping_ = false;
  std::atomic<bool> failed_{false};
  std::exception_ptr error_;  // the first exception a chunk threw
};

// The team the calling thread leads, if any. Thread-local rather than an argument: the loops
// sit deep in kernels that Python also calls directly (paged_attention, the norms).
inline thread_local Team* t_current = nullptr;

// CPUs this process may run on. A team spins while it waits: with more threads than CPUs
// (taskset, a narrow affinity) its threads would wait out each other's time slices (a 4-bit
// batch-1 step: 40 ms against 5 ms on one thread), where libgomp throttles its spinning.
inline int usable_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
#endif
  return static_cast<int>(std::thread::hardware_concurrency());
}

// body() on thread 0 of one OpenMP region of `threads` threads, the others serving its loops;
// body's exception, if any, is rethrown after the region (none may cross it).
template <typename Body>
void with_team(int threads, const Body& body) {
  Team crew;
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    if (omp_get_thread_num() == 0) {
      crew.set_size(omp_get_num_threads());
      t_current = &crew;
      try {
        body();
      } catch (...) {
        error = std::current_exception();
      }
      t_current = nullptr;
      crew.stop();
    } else {
      crew.serve(omp_get_thread_num());
    }
  }
  if (error) std::rethrow_exception(error);
}

// at::parallel_for(begin, end, grain, f), through the calling thread's team where it leads one.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (t_current != nullptr) {
    t_current->run(begin, end, grain, f);
  } else {
    at::parallel_for(begin, end, grain, f);
  }
}

}  // namespace team
