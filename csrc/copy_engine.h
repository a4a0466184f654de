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

class CopyJob {
 public:
  CopyJob(std::shared_ptr<JobState> state, std::unique_ptr<cuda::CudaCopyBatch> cuda);
  ~CopyJob();
  CopyJob(const CopyJob&) = delete;
  CopyJob& operator=(const CopyJob&) = delete;

  // Block until every copy finished; rethrows the first copy error.
  // Call without the GIL.
  void wait();
  bool done();
  // Indices of sources whose version counter changed between enqueue and the
  // end of their copy (sorted). Complete once wait() returned.
  std::vector<int64_t> modified();
  // CRC32C of every source's bytes as copied (waits for the copy), taken while
  // copying so the staging buffer is not read again; empty when the job has
  // device (CUDA) sources, whose bytes the caller hashes from the buffer.
  std::vector<int64_t> checksums();
  // Seconds from enqueue until the last copy finished (or until now).
  double seconds();

 private:
  std::shared_ptr<JobState> state_;
  std::unique_ptr<cuda::CudaCopyBatch> cuda_;
};

class CopyEngine {
 public:
  explicit CopyEngine(int64_t num_threads);
  ~CopyEngine();  // drains queued work, joins threads: call without the GIL

  // Validate everything, then queue the copies and return at once.
  // srcs[i]'s contiguous byte image goes to dst[offsets[i], offsets[i] + nbytes_i).
  std::shared_ptr<CopyJob> enqueue(const std::vector<at::Tensor>& srcs, const at::Tensor& dst,
                                   const std::vector<int64_t>& offsets);

  int num_threads() const { return pool_->size(); }

 private:
  std::unique_ptr<ThreadPool> pool_;
};

}  // namespace nebula
