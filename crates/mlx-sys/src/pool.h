// The persistent thread pool shared by mlx-sys's CPU kernels (quantized matmul in qmm.cc,
// attention in attn.cc). One process-wide instance (`Pool::get()`); `threads()` defaults to
// all cores and `spin_us()` to 5 ms; mlx-core's settings module overrides both through
// `set_threads` and `set_spin_us` (from `MLX_SPEC_QMM_THREADS` and `MLX_SPEC_POOL_SPIN_US`).
// Nothing here reads the environment.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "mlx-sys/src/simd.h"

namespace mlxsys {

// ---------------------------------------------------------------------------------------
// Thread pool. A job is a number of chunks; the calling thread and the workers claim chunks
// from a shared counter, so the caller never waits for a worker that has not started (on a
// busy machine a worker may be descheduled: the caller then does its chunks itself). Idle
// workers spin, then sleep on a condition variable. After a quantized matmul they spin for
// 5 ms (`spin_us()`): a quantized decode step issues a job every few tens of
// microseconds, and waking a sleeping worker (a futex round trip, slow under virtualization)
// cost more than the spinning (SmolLM2 4-bit, 2 cores: a step's evaluation 31 ms with 100 us
// of spinning, 23 ms with 5 ms). After other jobs (attention) they spin 100 us only: with
// f32 weights the products run on BLAS's own threads, which a spinning worker would starve
// (SmolLM2 f32: 158 ms per step against 83 ms).

class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: workers may outlive static destructors
    return *pool;
  }

  int threads() const { return threads_.load(std::memory_order_relaxed); }

  // The cores this process may use, read once: glibc's hardware_concurrency() opens and
  // reads /sys/devices/system/cpu/online on every call, and jobs asked for their thread
  // count on every product (~150 sysfs reads per SmolLM2 decode step, ~10% of the step).
  static int cores() {
    static const int n = [] {
      const int hw = static_cast<int>(std::thread::hardware_concurrency());
      return std::clamp(hw, 1, 64);
    }();
    return n;
  }

  // The threads a job asking for `wanted` gets: threads() for 0, else `wanted` clamped to
  // 1..=cores (a caller's kernel policy may ask for fewer or more than the pool default).
  static int effective(int wanted, int fallback) {
    if (wanted <= 0) return fallback;
    return std::clamp(wanted, 1, cores());
  }
  int threads(int wanted) const { return effective(wanted, threads()); }

  // Microseconds idle workers spin after a quantized matmul before they sleep.
  int spin_us() const { return spin_us_.load(std::memory_order_relaxed); }
  void set_spin_us(int us) { spin_us_.store(std::max(0, us), std::memory_order_relaxed); }

  void set_threads(int n) { threads_.store(std::clamp(n, 1, cores()), std::memory_order_relaxed); }

  // How long idle workers wait for the next job, spinning, before they sleep.
  enum class Linger {
    kLong,   // spin_us(): the caller's jobs come back to back (quantized matmuls)
    kShort,  // 100 us: other work (BLAS's own threads) needs the cores in between
  };

  // Runs fn(0..chunks-1), each exactly once, on the calling thread and up to threads(wanted)
  // - 1 workers; returns when all have finished. Jobs from two streams at once are serialized.
  void run(int chunks, const std::function<void(int)>& fn, Linger linger = Linger::kLong, int wanted = 0) {
    int helpers = std::min(threads(wanted), chunks) - 1;
    if (helpers <= 0) {
      for (int i = 0; i < chunks; ++i) fn(i);
      return;
    }
    std::lock_guard<std::mutex> one_job(job_mutex_);
    ensure_workers(helpers);
    fn_ = &fn;
    chunks_ = chunks;
    linger_us_.store(linger == Linger::kLong ? spin_us() : 100, std::memory_order_relaxed);
    next_.store(0, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    job_.store(true, std::memory_order_seq_cst);
    generation_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(wake_mutex_);
      wake_.notify_all();
    }
    work_chunks();
    // Only chunks a worker has claimed (and is running) remain.
    for (int spins = 0; done_.load(std::memory_order_acquire) < chunks; ++spins) pause_or_yield(spins);
    // Retire the job; wait for workers that are between "saw the job" and "found no chunk".
    job_.store(false, std::memory_order_seq_cst);
    for (int spins = 0; inside_.load(std::memory_order_seq_cst) > 0; ++spins) pause_or_yield(spins);
    fn_ = nullptr;
  }

 private:
  Pool() { set_threads(cores()); }

  static void pause_or_yield(int spins) {
    if (spins < 4096) {
#ifdef MLXSYS_X86
      _mm_pause();
#else
      std::this_thread::yield();
#endif
    } else {
      std::this_thread::yield();
    }
  }

  void work_chunks() {
    for (int i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < chunks_;) {
      (*fn_)(i);
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void ensure_workers(int n) {
    while (static_cast<int>(workers_.size()) < n) {
      uint64_t seen = generation_.load(std::memory_order_acquire);
      workers_.emplace_back([this, seen] { work(seen); });
      workers_.back().detach();
    }
  }

  void work(uint64_t seen) {
    for (;;) {
      // Spin up to the last job's linger time for the next job, then sleep.
      const int linger_us = linger_us_.load(std::memory_order_relaxed);
      auto start = std::chrono::steady_clock::now();
      int spins = 0;
      while (generation_.load(std::memory_order_acquire) == seen) {
        pause_or_yield(0);
        if (++spins % 256 == 0 && std::chrono::steady_clock::now() - start > std::chrono::microseconds(linger_us)) {
          std::unique_lock<std::mutex> lock(wake_mutex_);
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          wake_.wait(lock, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_relaxed);
          break;
        }
      }
      seen = generation_.load(std::memory_order_acquire);
      // Announce, then check the job is still live: run() retires it and then waits for
      // `inside_` to drop to 0, so fn_/chunks_ stay valid while we are inside.
      inside_.fetch_add(1, std::memory_order_seq_cst);
      if (job_.load(std::memory_order_seq_cst)) work_chunks();
      inside_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  std::atomic<int> threads_{1};
  std::atomic<int> spin_us_{5000};
  std::mutex job_mutex_;
  std::vector<std::thread> workers_;
  const std::function<void(int)>* fn_ = nullptr;
  int chunks_ = 0;
  std::atomic<int> next_{0};
  std::atomic<int> done_{0};
  std::atomic<bool> job_{false};
  std::atomic<int> inside_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int> linger_us_{100};
  std::mutex wake_mutex_;
  std::condition_variable wake_;
};

}  // namespace mlxsys
