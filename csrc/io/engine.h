// Direct-I/O engine: pread/pwrite of large byte ranges at (near) the disk's limit.
//
// A request (file, buffer, size, offset) is split into block-size tasks. The aligned body
// of a request goes through an O_DIRECT descriptor; only the unaligned head and tail (and
// whole files on filesystems that refuse O_DIRECT) go through a second, buffered
// descriptor of the same file. Tasks run on one of two backends:
//   - "uring":   one io_uring per worker thread, queue_depth tasks in flight per ring, set
//                up with raw syscalls (no liburing), chosen only when a runtime probe
//                succeeds (containers often forbid io_uring with EPERM/ENOSYS);
//   - "threads": worker threads doing blocking pread/pwrite, one task each at a time.
// Short transfers are resumed (EINTR/EAGAIN retried) until the task is complete, the
// file ends (reads) or an errno is hit, which the request keeps with its file offset.
//
// This layer knows files and bytes only: no tensors, no optimizer concepts.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace tierstate::io {

// An OS-level failure with the errno, the path and the file offset it concerns
// (offset -1 when none applies, e.g. open).
class IoError : public std::runtime_error {
 public:
  IoError(int err, std::string path, int64_t offset, const std::string& what);
  int err;
  std::string path;
  int64_t offset;
};

// One open file: an O_DIRECT descriptor when the filesystem allows it plus a buffered
// descriptor for unaligned pieces. Thread safe; close() waits for requests in flight.
class File {
 public:
  File(const std::string& path, int flags, unsigned perm, bool want_direct);
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  void close();
  bool closed() const { return closed_.load(); }
  int64_t size() const;
  void truncate(int64_t nbytes);
  void sync();

  const std::string& path() const { return path_; }
  bool direct() const { return direct_fd_ >= 0; }
  // Why direct I/O is off (empty when it is on).
  const std::string& direct_note() const { return direct_note_; }
  // Required alignment of buffer addresses and of file offsets/lengths for O_DIRECT.
  uint32_t mem_align() const { return mem_align_; }
  uint32_t offset_align() const { return offset_align_; }
  // "statx" when the kernel reported STATX_DIOALIGN, else "default".
  const std::string& alignment_source() const { return alignment_source_; }

  int direct_fd() const { return direct_fd_; }
  int buffered_fd() const { return buffered_fd_; }

  // Bytes moved per path, so that callers and tests can see where a request went.
  std::atomic<uint64_t> bytes_direct{0};
  std::atomic<uint64_t> bytes_bounced{0};   // O_DIRECT through an aligned bounce buffer
  std::atomic<uint64_t> bytes_buffered{0};

  // In-flight accounting used by Engine::submit and close().
  bool begin_request();
  void end_request();

 private:
  std::string path_;
  int direct_fd_ = -1;
  int buffered_fd_ = -1;
  uint32_t mem_align_ = 4096;
  uint32_t offset_align_ = 4096;
  std::string alignment_source_ = "default";
  std::string direct_note_;
  std::atomic<bool> closed_{false};
  std::mutex mu_;
  std::condition_variable idle_;
  int inflight_ = 0;
};

class ChecksumWorker;

// The completion state of one submitted request.
//
// [Note: checksums taken by the engine]
// A request submitted with checksum=true has the CRC-32C of its bytes taken task by task
// as each one finishes (a read's once its bytes are in the caller's buffer, a write's once
// the disk has them, from the same unchanged buffer), joined in file order by crc(). The
// NVMe tier checks every record it reads and notes the CRC of every record it writes.
// Taken on the thread that calls into the tier, those passes over DRAM held up the step:
// 55-70 ms of a 610-630 ms compressed-state step at 400M parameters with one kernel thread
// (Zen 4 VM), 36 ms of 265 at 300M with two. They run on the engine's checksum thread
// instead, not on its I/O workers: a worker busy with a 48 MiB record's CRC (~3 ms) stops
// reaping and submitting, and with the CRCs on the one io_uring worker the fp32-state NVMe
// step at 400M went from 1.11-1.20 s to 1.42-1.45 s, the disk idle meanwhile. The tier asks
// for it only where the kernels leave a core free (tierstate.io.checksums_beside_kernels):
// with both vCPUs in the kernels the thread only took a core from them (1.07-1.13 s against
// 1.05-1.08 s).
class Request {
 public:
  struct Result {
    uint64_t bytes;      // bytes moved (reads: up to end of file)
    int err;             // 0, or the first errno hit
    int64_t err_offset;  // file offset of the failing task, -1 when err == 0
  };
  // checksummer: where finished tasks go for their CRC (nullptr: no checksum)
  Request(std::shared_ptr<File> file, bool write, size_t ntasks, ChecksumWorker* checksummer = nullptr);
  bool done() const { return remaining_.load(std::memory_order_acquire) == 0; }
  Result wait();
  bool failed() const { return failed_.load(std::memory_order_relaxed); }
  // task: the task's index in file order; crc: the CRC-32C of the moved bytes (checksum only).
  void task_done(size_t task, uint64_t moved, int err, int64_t err_offset, uint32_t crc = 0);
  bool is_write() const { return write_; }
  ChecksumWorker* checksummer() const { return checksummer_; }
  // The CRC-32C of the bytes moved, the tasks' parts joined in file order (a request that
  // moved all its bytes: of the whole range). Throws std::logic_error unless the request
  // was submitted with checksum=true and is done.
  uint32_t crc() const;
  File& file() { return *file_; }

 private:
  std::shared_ptr<File> file_;
  bool write_;
  ChecksumWorker* checksummer_;
  std::vector<uint32_t> task_crc_;     // checksum only: each task's CRC-32C ...
  std::vector<uint64_t> task_bytes_;   // ... and the bytes it covers
  std::atomic<size_t> remaining_;
  std::atomic<uint64_t> bytes_{0};
  std::atomic<bool> failed_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  int err_ = 0;
  int64_t err_offset_ = -1;
};

enum class TaskPath : uint8_t { Direct, Bounce, Buffered };

struct Task {
  std::shared_ptr<Request> req;
  char* buf;
  size_t len;
  int64_t offset;
  TaskPath path;
  size_t index;  // in its request, in file order
};

// A multi-producer queue of tasks shared by the workers of one engine.
class TaskQueue {
 public:
  void push(std::vector<Task>&& tasks);
  // Moves up to max tasks into out; blocks for at least one when block is true.
  // Returns false once the queue is closed and empty.
  bool pop(size_t max, bool block, std::vector<Task>& out);
  void close();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> tasks_;
  bool closed_ = false;
};

// A finished task of a checksum=true request, waiting for its CRC before it completes.
struct ChecksumItem {
  std::shared_ptr<Request> req;
  size_t index;
  const char* buf;
  uint64_t moved;
  int err;
  int64_t err_offset;
};

// The engine's checksum thread (see [Note: checksums taken by the engine]): takes the
// CRC-32C of each finished task's bytes, in the order they finished, then completes it.
class ChecksumWorker {
 public:
  ChecksumWorker();
  ~ChecksumWorker();  // completes every task queued, then joins
  ChecksumWorker(const ChecksumWorker&) = delete;
  ChecksumWorker& operator=(const ChecksumWorker&) = delete;
  void push(ChecksumItem&& item);

 private:
  void run();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<ChecksumItem> items_;
  bool closed_ = false;
  std::thread thread_;
};

struct EngineConfig {
  int threads = 0;              // worker threads (uring: one ring each); 0: 1 ring, or
                                // min(queue_depth, 8) blocking workers
  int queue_depth = 32;         // tasks in flight per ring (threads: caps the automatic size)
  size_t block_size = 1 << 20;  // bytes per task; a multiple of 4096
  std::string backend = "auto"; // "auto" | "uring" | "threads"
};

// Whether io_uring can be used here; note says why not (errno name and the syscall).
struct UringProbe {
  bool ok;
  std::string note;
};
UringProbe probe_uring(unsigned queue_depth);

class Worker;  // one backend worker thread (defined in engine.cpp / uring.cpp)

class Engine {
 public:
  explicit Engine(const EngineConfig& config);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Splits [offset, offset + nbytes) into tasks and queues them; never blocks on I/O.
  // checksum: the engine's checksum thread takes the CRC-32C of the bytes moved, task by
  // task as each finishes (Request::crc()).
  std::shared_ptr<Request> submit(const std::shared_ptr<File>& file, bool write, void* buf,
                                  size_t nbytes, int64_t offset, bool checksum = false);
  // Finishes queued work, then stops the workers. Idempotent.
  void shutdown();

  const EngineConfig& config() const { return config_; }
  const std::string& backend() const { return backend_; }
  const std::string& backend_note() const { return backend_note_; }

 private:
  EngineConfig config_;
  std::string backend_;
  std::string backend_note_;
  TaskQueue queue_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::unique_ptr<ChecksumWorker> checksummer_;  // started by the first checksum=true request
  std::mutex shutdown_mu_;
  bool stopped_ = false;
};

// Aligned host memory for O_DIRECT buffers; free with aligned_free. Without huge_pages it
// comes from posix_memalign. With huge_pages (the caller passes a huge-page alignment) it is
// a fresh anonymous mapping of its own, madvise(MADV_HUGEPAGE)'d before any page exists, so
// that its pages fault in as huge ones (heap memory may already sit on 4 KiB pages): a direct
// request over 4 KiB pages is split by the block layer at max_segments pages (254 on
// virtio-blk, ~1 MiB), over 2 MiB pages it is not. The advice is best effort: a kernel
// without THP leaves ordinary pages.
void* aligned_alloc_bytes(size_t nbytes, size_t alignment, bool huge_pages = false);
void aligned_free(void* p);
// A page-aligned bounce buffer for a worker, or nullptr when memory is short (the tasks
// that need it then fail with ENOMEM instead of killing the worker thread).
char* try_alloc_bounce(size_t nbytes);

// ---- shared by the backends ------------------------------------------------

// Progress of one task; both backends drive it with the result of each syscall.
struct TaskRun {
  Task task;
  char* bounce = nullptr;  // worker-owned aligned buffer of block_size bytes
  size_t done = 0;
  int fd = -1;
  char* data = nullptr;    // where the syscall reads/writes: task.buf or bounce
  bool skipped = false;    // the request already failed: complete without I/O

  void start(Task&& t, char* bounce_buffer);
  // Feeds one syscall result (bytes, or -errno). Returns true when the task is finished
  // (completed, at end of file, or failed); false when the remainder must be issued.
  bool advance(long result);
  // Issues blocking pread/pwrite calls until advance() says the task is finished (the
  // thread-pool backend, and io_uring's fallback for entries it could not submit).
  void run_blocking();
  void finish();  // copies a bounced read out, accounts bytes, takes the checksum, completes the request
  int err = 0;
  bool zero_write_retried = false;
};

class Worker {
 public:
  virtual ~Worker() = default;
  virtual void join() = 0;
};

std::unique_ptr<Worker> make_thread_worker(TaskQueue& queue, size_t block_size);
// Throws IoError when the ring cannot be created.
std::unique_ptr<Worker> make_uring_worker(TaskQueue& queue, size_t block_size,
                                          unsigned queue_depth);

}  // namespace tierstate::io
