// Stress test of csrc/common/thread_pool: many short jobs while the thread count
// changes between them, the pattern of a test suite (or a user) that calls
// set_num_threads between kernel calls.
//
// Each job's body and its bookkeeping live on the caller's stack, as the kernels'
// lambdas do. The test fails when a task runs twice or not at all, or when a task of a
// job is still running (or starts) after parallel_for returned: with the kernels that
// is a use of a dead stack frame. Built and run by tests/kernels/test_thread_pool_stress.py
// (natively, and for AArch64 under qemu when that toolchain is present).
//
// Usage: thread_pool_stress [jobs]   (default 20000). Exit status 0 when clean.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common/thread_pool.h"

namespace {

// The job whose tasks may run now; a task that sees another job's id ran late.
std::atomic<int64_t> g_open_job{-1};
std::atomic<int64_t> g_late_tasks{0};

struct Job {
  int64_t id;
  std::vector<std::atomic<int>> runs;
  explicit Job(int64_t job_id, int64_t n_tasks) : id(job_id), runs(static_cast<size_t>(n_tasks)) {}
};

}  // namespace

int main(int argc, char** argv) {
  const int64_t jobs = argc > 1 ? std::atoll(argv[1]) : 20000;
  tierstate::ThreadPool& pool = tierstate::ThreadPool::instance();
  int64_t wrong_counts = 0;
  for (int64_t id = 0; id < jobs; ++id) {
    // Change the thread count every few jobs (1 -> 2 -> 3 -> ...), sometimes twice in a
    // row, so that freshly started workers meet a pool that has already run jobs.
    if (id % 3 == 0) pool.set_num_threads(1 + static_cast<int>((id / 3) % 3));
    if (id % 7 == 0) pool.set_num_threads(2);
    const int64_t n_tasks = 1 + id % 5;
    Job job(id, n_tasks);
    g_open_job.store(id, std::memory_order_release);
    auto body = [&job](int64_t task) {
      if (g_open_job.load(std::memory_order_acquire) != job.id) g_late_tasks.fetch_add(1);
      job.runs[static_cast<size_t>(task)].fetch_add(1, std::memory_order_relaxed);
      // A little work, so that a task can still be running when the caller finishes.
      volatile int spin = 0;
      for (int i = 0; i < 200; ++i) spin = spin + i;
    };
    pool.parallel_for(n_tasks, body);
    g_open_job.store(-1, std::memory_order_release);
    for (int64_t t = 0; t < n_tasks; ++t)
      if (job.runs[static_cast<size_t>(t)].load() != 1) ++wrong_counts;
    // Overwrite the finished job's bookkeeping as a dead stack frame would be reused.
    for (auto& r : job.runs) r.store(-1000);
  }
  const int64_t late = g_late_tasks.load();
  if (wrong_counts != 0 || late != 0) {
    std::fprintf(stderr,
                 "thread_pool_stress: %lld tasks ran a wrong number of times, %lld ran outside their "
                 "parallel_for call (%lld jobs)\n",
                 static_cast<long long>(wrong_counts), static_cast<long long>(late), static_cast<long long>(jobs));
    return 1;
  }
  std::printf("thread_pool_stress: %lld jobs clean\n", static_cast<long long>(jobs));
  return 0;
}
