// io_uring backend of the I/O engine, on raw syscalls and the kernel's own header: a fresh
// machine builds it with no liburing. Each worker thread owns one ring and keeps up to
// queue_depth tasks in flight; the runtime probe (probe_uring) decides whether it is used.
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "io/engine.h"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>

#if defined(__has_include)
#if __has_include(<linux/io_uring.h>) && defined(__NR_io_uring_setup) && defined(__NR_io_uring_enter) && \
    defined(__NR_io_uring_register)
#include <linux/io_uring.h>
#define TIERSTATE_HAVE_URING 1
#endif
#endif

namespace tierstate::io {

#ifdef TIERSTATE_HAVE_URING
namespace {

std::string errno_name(int e) {
  switch (e) {
    case EPERM: return "EPERM";
    case ENOSYS: return "ENOSYS";
    case EACCES: return "EACCES";
    case EINVAL: return "EINVAL";
    case ENOMEM: return "ENOMEM";
    case EMFILE: return "EMFILE";
    default: return "errno " + std::to_string(e);
  }
}

// kernel.io_uring_disabled: 0 allowed, 1 only for a privileged group, 2 off (Linux 6.6+).
std::string disabled_sysctl() {
  std::ifstream in("/proc/sys/kernel/io_uring_disabled");
  std::string v;
  if (in >> v) return v;
  return "";
}

template <class T>
T load_acquire(const T* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
template <class T>
void store_release(T* p, T v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

struct Ring {
  int fd = -1;
  unsigned sq_entries = 0;
  void* sq_map = MAP_FAILED;
  size_t sq_map_len = 0;
  void* cq_map = MAP_FAILED;
  size_t cq_map_len = 0;
  io_uring_sqe* sqes = static_cast<io_uring_sqe*>(MAP_FAILED);
  size_t sqes_len = 0;
  unsigned *sq_head = nullptr, *sq_tail = nullptr, *sq_mask = nullptr, *sq_array = nullptr;
  unsigned *cq_head = nullptr, *cq_tail = nullptr, *cq_mask = nullptr;
  io_uring_cqe* cqes = nullptr;
  unsigned sq_local_tail = 0;

  Ring() = default;
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;
  ~Ring() {
    if (sqes != MAP_FAILED) ::munmap(sqes, sqes_len);
    if (cq_map != MAP_FAILED && cq_map != sq_map) ::munmap(cq_map, cq_map_len);
    if (sq_map != MAP_FAILED) ::munmap(sq_map, sq_map_len);
    if (fd >= 0) ::close(fd);
  }

  // 0 on success, else errno with *why filled in.
  int open(unsigned entries, std::string* why) {
    io_uring_params p;
    std::memset(&p, 0, sizeof(p));
#ifdef IORING_SETUP_COOP_TASKRUN
    // Completions are reaped by this same thread right after io_uring_enter, so the
    // kernel need not interrupt it (IPI) to run completion work (Linux 5.19+).
    p.flags = IORING_SETUP_COOP_TASKRUN;
#endif
    fd = static_cast<int>(::syscall(__NR_io_uring_setup, entries, &p));
    if (fd < 0 && errno == EINVAL && p.flags != 0) {  // older kernel: plain flags
      std::memset(&p, 0, sizeof(p));
      fd = static_cast<int>(::syscall(__NR_io_uring_setup, entries, &p));
    }
    if (fd < 0) {
      int e = errno;
      *why = "io_uring_setup failed: " + std::string(strerror(e)) + " (" + errno_name(e) + ")";
      std::string sysctl = disabled_sysctl();
      if (!sysctl.empty() && sysctl != "0") *why += ", kernel.io_uring_disabled=" + sysctl;
      return e;
    }
    sq_entries = p.sq_entries;
    sq_map_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    cq_map_len = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    bool single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single) sq_map_len = cq_map_len = std::max(sq_map_len, cq_map_len);
    sq_map = ::mmap(nullptr, sq_map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                    IORING_OFF_SQ_RING);
    if (sq_map == MAP_FAILED) return fail_mmap(why);
    cq_map = single ? sq_map
                    : ::mmap(nullptr, cq_map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                             fd, IORING_OFF_CQ_RING);
    if (cq_map == MAP_FAILED) return fail_mmap(why);
    sqes_len = p.sq_entries * sizeof(io_uring_sqe);
    sqes = static_cast<io_uring_sqe*>(::mmap(nullptr, sqes_len, PROT_READ | PROT_WRITE,
                                             MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQES));
    if (sqes == MAP_FAILED) return fail_mmap(why);
    char* sq = static_cast<char*>(sq_map);
    char* cq = static_cast<char*>(cq_map);
    sq_head = reinterpret_cast<unsigned*>(sq + p.sq_off.head);
    sq_tail = reinterpret_cast<unsigned*>(sq + p.sq_off.tail);
    sq_mask = reinterpret_cast<unsigned*>(sq + p.sq_off.ring_mask);
    sq_array = reinterpret_cast<unsigned*>(sq + p.sq_off.array);
    cq_head = reinterpret_cast<unsigned*>(cq + p.cq_off.head);
    cq_tail = reinterpret_cast<unsigned*>(cq + p.cq_off.tail);
    cq_mask = reinterpret_cast<unsigned*>(cq + p.cq_off.ring_mask);
    cqes = reinterpret_cast<io_uring_cqe*>(cq + p.cq_off.cqes);
    sq_local_tail = *sq_tail;
    return 0;
  }

  int fail_mmap(std::string* why) {
    int e = errno;
    *why = "mmap of the io_uring rings failed: " + std::string(strerror(e));
    return e;
  }

  // Whether the kernel implements IORING_OP_READ and IORING_OP_WRITE (Linux 5.6+).
  bool supports_read_write(std::string* why) {
    constexpr unsigned kOps = 256;
    std::vector<char> mem(sizeof(io_uring_probe) + kOps * sizeof(io_uring_probe_op), 0);
    auto* probe = reinterpret_cast<io_uring_probe*>(mem.data());
    if (::syscall(__NR_io_uring_register, fd, IORING_REGISTER_PROBE, probe, kOps) < 0) {
      *why = "io_uring_register(PROBE) failed: " + std::string(strerror(errno)) + " (kernel older than 5.6?)";
      return false;
    }
    for (unsigned op : {unsigned(IORING_OP_READ), unsigned(IORING_OP_WRITE)}) {
      if (op > probe->last_op || !(probe->ops[op].flags & IO_URING_OP_SUPPORTED)) {
        *why = "io_uring lacks IORING_OP_READ/WRITE";
        return false;
      }
    }
    return true;
  }
};

class UringWorker final : public Worker {
 public:
  UringWorker(TaskQueue& queue, size_t block_size, unsigned depth)
      : queue_(queue), block_size_(block_size), depth_(depth) {
    std::string why;
    int e = ring_.open(depth, &why);
    if (e != 0) throw IoError(e, "", -1, why);
    slots_.resize(depth_);
    bounces_.assign(depth_, nullptr);
    thread_ = std::thread([this] { run(); });
  }
  ~UringWorker() override {
    join();
    for (char* b : bounces_) aligned_free(b);
  }
  void join() override {
    if (thread_.joinable()) thread_.join();
  }

 private:
  void push_sqe(unsigned id) {
    TaskRun& run = slots_[id];
    unsigned tail = ring_.sq_local_tail;
    unsigned idx = tail & *ring_.sq_mask;
    io_uring_sqe* sqe = &ring_.sqes[idx];
    std::memset(sqe, 0, sizeof(*sqe));
    sqe->opcode = run.task.req->is_write() ? IORING_OP_WRITE : IORING_OP_READ;
    sqe->fd = run.fd;
    sqe->addr = reinterpret_cast<uint64_t>(run.data + run.done);
    sqe->len = static_cast<uint32_t>(run.task.len - run.done);
    sqe->off = static_cast<uint64_t>(run.task.offset) + run.done;
    sqe->user_data = id;
    ring_.sq_array[idx] = idx;
    ring_.sq_local_tail = tail + 1;
    store_release(ring_.sq_tail, ring_.sq_local_tail);
    unsubmitted_.push_back(id);
  }

  void release(unsigned id) {
    slots_[id].finish();
    free_ids_.push_back(id);
    --occupied_;
  }

  // The kernel refused to take entries (io_uring_enter error other than a transient
  // one): withdraw them from the ring and do them here with blocking syscalls, so that
  // no task is lost and none is done twice.
  void run_unsubmitted_synchronously() {
    ring_.sq_local_tail = load_acquire(ring_.sq_head);
    store_release(ring_.sq_tail, ring_.sq_local_tail);
    for (unsigned id : unsubmitted_) {
      slots_[id].run_blocking();
      release(id);
    }
    unsubmitted_.clear();
  }

  void run() {
    for (unsigned i = 0; i < depth_; ++i) free_ids_.push_back(depth_ - 1 - i);
    std::vector<Task> got;
    std::vector<unsigned> ready;
    for (;;) {
      if (!free_ids_.empty()) {
        got.clear();
        bool open = queue_.pop(free_ids_.size(), occupied_ == 0 && ready.empty(), got);
        if (!open && occupied_ == 0) return;
        for (Task& t : got) {
          unsigned id = free_ids_.back();
          free_ids_.pop_back();
          ++occupied_;
          if (t.path == TaskPath::Bounce && !bounces_[id]) bounces_[id] = try_alloc_bounce(block_size_);
          slots_[id].start(std::move(t), bounces_[id]);
          if (slots_[id].skipped)
            release(id);
          else
            ready.push_back(id);
        }
      }
      for (unsigned id : ready) push_sqe(id);
      ready.clear();
      if (occupied_ == 0) continue;

      unsigned to_submit = ring_.sq_local_tail - load_acquire(ring_.sq_head);
      long r = ::syscall(__NR_io_uring_enter, ring_.fd, to_submit, 1, IORING_ENTER_GETEVENTS, nullptr, 0);
      if (r >= 0) {
        for (long i = 0; i < r && !unsubmitted_.empty(); ++i) unsubmitted_.pop_front();
      } else if (errno != EINTR && errno != EAGAIN && errno != EBUSY) {
        if (!unsubmitted_.empty()) run_unsubmitted_synchronously();
        else std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }

      unsigned head = *ring_.cq_head;
      unsigned tail = load_acquire(ring_.cq_tail);
      while (head != tail) {
        const io_uring_cqe& cqe = ring_.cqes[head & *ring_.cq_mask];
        unsigned id = static_cast<unsigned>(cqe.user_data);
        int res = cqe.res;
        ++head;
        if (slots_[id].advance(res))
          release(id);
        else
          ready.push_back(id);
      }
      store_release(ring_.cq_head, head);
    }
  }

  TaskQueue& queue_;
  size_t block_size_;
  unsigned depth_;
  Ring ring_;
  std::vector<TaskRun> slots_;
  std::vector<char*> bounces_;
  std::vector<unsigned> free_ids_;
  std::deque<unsigned> unsubmitted_;
  unsigned occupied_ = 0;
  std::thread thread_;
};

}  // namespace

UringProbe probe_uring(unsigned queue_depth) {
  Ring ring;
  std::string why;
  if (ring.open(queue_depth, &why) != 0) return {false, why};
  if (!ring.supports_read_write(&why)) return {false, why};
  return {true, ""};
}

std::unique_ptr<Worker> make_uring_worker(TaskQueue& queue, size_t block_size, unsigned queue_depth) {
  return std::make_unique<UringWorker>(queue, block_size, queue_depth);
}

#else  // built without <linux/io_uring.h> or the syscall numbers

UringProbe probe_uring(unsigned) {
  return {false, "built without <linux/io_uring.h> / io_uring syscall numbers"};
}

std::unique_ptr<Worker> make_uring_worker(TaskQueue&, size_t, unsigned) {
  throw IoError(ENOSYS, "", -1, "built without io_uring support");
}

#endif

}  // namespace tierstate::io
