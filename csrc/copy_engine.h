// Asynchronous snapshot copies of tensors into a host staging buffer.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "thread_pool.h"

namespace nebula {

namespace cuda {
class CudaCopyBatch;
}

// Shared between a CopyJob and the pool tasks working on it, so that a job
// dropped by Python before it finishes does not pull memory from under them.
struct JobState;

// Owns the tensors of one enqueue. Destroying it waits for the copies still
// running (they read and write those tensors), then releases the tensors on
// the destroying thread: hold the GIL there, but do not block on it (the
// bindings release it while waiting).
class CopyJob {
 public:
  CopyJob(std::shared_ptr<JobState> state, std::unique_ptr<cuda::CudaCopyBatch> cuda);
  ~CopyJob();
  CopyJob(const CopyJob&) = delete;
  CopyJob& operator=(const CopyJob&) = delete;

  // Block until every copy finished; rethrows the first copy error.
  // Call without the GIL.
  void wait();
  // Block until every copy finished, ignoring errors. Call without the GIL.
  void drain() noexcept;
  bool done();
  // Indices of sources written while being copied (sorted): their version
  // counter changed between enqueue and the end of their copy, or (contiguous
  // CPU sources) the bytes of a block changed between the hash taken before
  // its copy and the copy itself. Complete once wait() returned.
  std::vector<int64_t> modified();
  // CRC32C of the bytes staged for every source (waits for the copy), taken
  // while copying so the staging buffer is not read again: always those of
  // the staged bytes, even when a source changed under the copy. Empty when
  // the job has device (CUDA) sources or was enqueued with checksum=false:
  // the caller hashes the bytes from the buffer.
  std::vector<int64_t> checksums();
  // Seconds from enqueue until the last copy finished (or until now).
  double seconds();

 private:
  void wait_tasks();

  std::shared_ptr<JobState> state_;
  std::unique_ptr<cuda::CudaCopyBatch> cuda_;
};

// Whether t's storage holds every byte its sizes, strides and offset reach
// (a storage resized under a tensor, e.g. to 0 by FSDP, does not).
bool storage_covers(const at::Tensor& t);

class CopyEngine {
 public:
  explicit CopyEngine(int64_t num_threads);
  ~CopyEngine();  // drains queued work, joins threads: call without the GIL

  // Drain queued work and join the threads now (idempotent); enqueue fails
  // afterwards. Call without the GIL.
  void close();

  // Validate everything, then queue the copies and return at once (a host copy of one task of
  // at most 256 KiB is done on the calling thread before returning: cheaper than a hand-off).
  // srcs[i]'s contiguous byte image goes to dst[offsets[i], offsets[i] + nbytes_i).
  // checksum=false: plain copies at memcpy speed, no CRC32C and no check of the
  // bytes of a block against a hash taken before its copy (version counters
  // are still compared); checksums() is then empty and the caller hashes the
  // staged bytes itself, off the critical path.
  std::unique_ptr<CopyJob> enqueue(const std::vector<at::Tensor>& srcs, const at::Tensor& dst,
                                   const std::vector<int64_t>& offsets, bool checksum = true);

  // Worker threads; 0 once closed.
  int num_threads() {
    std::lock_guard<std::mutex> lk(mu_);
    return pool_ ? pool_->size() : 0;
  }

 private:
  std::mutex mu_;  // guards pool_ (enqueue vs close)
  std::unique_ptr<ThreadPool> pool_;
};

}  // namespace nebula
