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

// The version counter of t, read directly from its TensorImpl (what t._version() returns, without
// the autograd hooks' dispatch); -1 for an inference tensor, which has none.
int64_t version_of(const at::Tensor& t);

// What a copy needs of one source, read from its tensor once (each further read of a TensorImpl
// is a cache miss per tensor at 100,000 tensors).
struct Source {
  const uint8_t* from = nullptr;  // data_ptr() (nullptr when empty): where a plain copy reads
  uint64_t nbytes = 0;
  int64_t version = -1;           // version counter when read; -1: not tracked (inference tensor)
  bool plain = false;             // contiguous without conj/neg bits: its memory is its byte image
  bool cuda = false;
};

// Validate srcs[i] as enqueue() does (each error names i and the fix), then read its Source.
Source checked_source(const at::Tensor& s, size_t i);
// Read a Source without validating: for a tensor already checked, e.g. by PlanGuard against the
// dtype, device, layout, shape, strides and storage extent of the tensor it recorded.
Source read_source(const at::Tensor& s);

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
  // enqueue() of sources validated and read already (srcs[i] is described by meta[i]): no
  // tensor is read again before the copies. The job shares `srcs` (kept alive until it ends).
  std::unique_ptr<CopyJob> enqueue_read(std::shared_ptr<const std::vector<at::Tensor>> srcs,
                                        const std::vector<Source>& meta, const at::Tensor& dst,
                                        const std::vector<int64_t>& offsets, bool checksum);

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
