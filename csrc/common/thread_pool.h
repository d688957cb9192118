// A small persistent thread pool for the optimizer kernels.
//
// Why our own pool and not OpenMP: torch ships its own libgomp and torchrun sets
// OMP_NUM_THREADS=1, so an OpenMP kernel would either fight torch's runtime or run
// on one thread. Workers are started once; between jobs they spin briefly, then sleep
// on a condition variable; the calling thread always takes part, so N threads means
// N-1 workers.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace tierstate {

class ThreadPool {
 public:
  // The process-wide pool. Recreated lazily in a child after fork(), whose copy of
  // the parent's pool has no worker threads behind it.
  static ThreadPool& instance();

  // Total threads used by parallel_for, the caller included (>= 1).
  void set_num_threads(int num_threads);
  int num_threads() const;

  // Runs task(ctx, i) for every i in [0, n_tasks), spread over the pool; returns when
  // all have finished. Calls from several threads at once are serialised.
  using TaskFn = void (*)(void* ctx, int64_t task);
  void parallel_for(int64_t n_tasks, TaskFn fn, void* ctx);

  template <class F>
  void parallel_for(int64_t n_tasks, F& body) {
    parallel_for(
        n_tasks, [](void* c, int64_t i) { (*static_cast<F*>(c))(i); }, &body);
  }

  // Optional record of when each thread worked on a job, for traces (one lane per CPU
  // worker). Off by default; a span is two clock reads and one short locked append per
  // thread per job. Times are CLOCK_MONOTONIC nanoseconds, the clock of Python's
  // time.perf_counter() on Linux, so they line up with the Python-side phases.
  struct WorkerSpan {
    int worker;  // 0 is the calling thread, 1.. the pool's workers
    int64_t start_ns, end_ns;
  };
  void set_span_recording(bool on);
  std::vector<WorkerSpan> drain_spans();

  ~ThreadPool();

 private:
  explicit ThreadPool(int num_threads);
  void start_workers(int n_workers);
  void stop_workers();
  // `seen`: the last job generation this worker need not run (the current one at start).
  void worker_loop(int worker, uint64_t seen);
  void run_tasks();
  void run_tasks_as(int worker);

  std::mutex submit_mutex_;  // one job at a time
  std::mutex mutex_;         // guards the fields below
  std::condition_variable wake_;
  std::condition_variable done_;
  std::vector<std::thread> workers_;
  // Written under mutex_ (so the condition variables stay correct), also read without
  // it by the short spin that precedes each sleep.
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stopping_{false};
  std::atomic<int> workers_busy_{0};
  int num_threads_ = 1;

  TaskFn fn_ = nullptr;
  void* ctx_ = nullptr;
  int64_t n_tasks_ = 0;
  std::atomic<int64_t> next_task_{0};

  std::atomic<bool> record_spans_{false};
  std::mutex spans_mutex_;
  std::vector<WorkerSpan> spans_;  // bounded by kMaxSpans; drained by the caller

  long owner_pid_ = 0;
  friend ThreadPool& pool_for_this_process();
};

}  // namespace tierstate
