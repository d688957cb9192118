#include "common/thread_pool.h"

#include <unistd.h>

#include <time.h>

#include <algorithm>

namespace tierstate {

namespace {

// An optimizer step issues one or two kernel calls per parameter back to back (148 tensors
// for GPT-2 small). Sleeping on the condition variable between them costs a futex wake-up
// per call on each side, tens of microseconds on a VM: 8 ms of a 52 ms step measured.
// Spinning this many pause iterations (~50-100 us) first catches the next call awake.
constexpr int kSpinIterations = 4000;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// A trace drained every step holds a few spans per kernel call; this bounds a trace
// nobody drains (1 MiB of spans) instead of letting it grow.
constexpr size_t kMaxSpans = 1 << 16;

int64_t monotonic_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

template <class Ready>
void spin_until(Ready ready) {
  for (int i = 0; i < kSpinIterations && !ready(); ++i) cpu_relax();
}

}  // namespace

ThreadPool& pool_for_this_process() {
  static std::mutex create_mutex;
  static ThreadPool* pool = nullptr;
  std::lock_guard<std::mutex> lock(create_mutex);
  const long pid = static_cast<long>(getpid());
  if (pool == nullptr || pool->owner_pid_ != pid) {
    // After fork() the old pool's workers do not exist in this process: leak it (its
    // std::thread handles must not be joined or destroyed here) and start afresh.
    const int threads = pool == nullptr ? 1 : pool->num_threads_;
    pool = new ThreadPool(threads);
    pool->owner_pid_ = pid;
  }
  return *pool;
}

ThreadPool& ThreadPool::instance() { return pool_for_this_process(); }

ThreadPool::ThreadPool(int num_threads) { set_num_threads(num_threads); }

ThreadPool::~ThreadPool() { stop_workers(); }

void ThreadPool::set_num_threads(int num_threads) {
  std::lock_guard<std::mutex> submit(submit_mutex_);
  num_threads = std::max(1, num_threads);
  if (num_threads == num_threads_ && static_cast<int>(workers_.size()) == num_threads - 1) return;
  stop_workers();
  num_threads_ = num_threads;
  start_workers(num_threads - 1);
}

int ThreadPool::num_threads() const { return num_threads_; }

void ThreadPool::start_workers(int n_workers) {
  uint64_t current_generation;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_.store(false);
    current_generation = generation_.load();
  }
  // A new worker has seen every job so far: starting it at generation 0 instead made it
  // run the last finished job again and count itself done twice, so that a later
  // parallel_for returned while a task still ran on its stack frame, or waited forever
  // for workers_busy_ to climb back from -1 (a hang within seconds under qemu-aarch64,
  // where thread start-up is slow; tests/kernels/native_isa/thread_pool_stress.cpp).
  workers_.reserve(n_workers);
  for (int i = 0; i < n_workers; ++i)
    workers_.emplace_back([this, i, current_generation] { worker_loop(i + 1, current_generation); });
}

void ThreadPool::stop_workers() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_.store(true);
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
}

void ThreadPool::run_tasks() {
  for (;;) {
    const int64_t i = next_task_.fetch_add(1, std::memory_order_relaxed);
    if (i >= n_tasks_) return;
    fn_(ctx_, i);
  }
}

void ThreadPool::run_tasks_as(int worker) {
  if (!record_spans_.load(std::memory_order_relaxed)) {
    run_tasks();
    return;
  }
  const int64_t start = monotonic_ns();
  run_tasks();
  const int64_t end = monotonic_ns();
  std::lock_guard<std::mutex> lock(spans_mutex_);
  if (spans_.size() < kMaxSpans) spans_.push_back({worker, start, end});
}

void ThreadPool::set_span_recording(bool on) {
  record_spans_.store(on, std::memory_order_relaxed);
  if (!on) drain_spans();
}

std::vector<ThreadPool::WorkerSpan> ThreadPool::drain_spans() {
  std::lock_guard<std::mutex> lock(spans_mutex_);
  std::vector<WorkerSpan> out;
  out.swap(spans_);
  return out;
}

void ThreadPool::worker_loop(int worker, uint64_t seen) {
  for (;;) {
    spin_until([&] { return stopping_.load(std::memory_order_acquire) ||
                            generation_.load(std::memory_order_acquire) != seen; });
    std::unique_lock<std::mutex> lock(mutex_);
    wake_.wait(lock, [&] { return stopping_.load() || generation_.load() != seen; });
    if (stopping_.load()) return;
    seen = generation_.load();
    lock.unlock();
    run_tasks_as(worker);
    lock.lock();
    if (workers_busy_.fetch_sub(1, std::memory_order_acq_rel) == 1) done_.notify_one();
  }
}

void ThreadPool::parallel_for(int64_t n_tasks, TaskFn fn, void* ctx) {
  if (n_tasks <= 0) return;
  std::lock_guard<std::mutex> submit(submit_mutex_);
  if (workers_.empty() || n_tasks == 1) {
    fn_ = fn;
    ctx_ = ctx;
    n_tasks_ = n_tasks;
    next_task_.store(0, std::memory_order_relaxed);
    run_tasks_as(0);  // no worker is woken: the caller runs every task
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    fn_ = fn;
    ctx_ = ctx;
    n_tasks_ = n_tasks;
    next_task_.store(0, std::memory_order_relaxed);
    workers_busy_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  run_tasks_as(0);
  spin_until([&] { return workers_busy_.load(std::memory_order_acquire) == 0; });
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [&] { return workers_busy_.load(std::memory_order_acquire) == 0; });
}

}  // namespace tierstate
