// CUDA side of the copy engine and of pinned host buffers.
//
// Only compiled (and only included) when NEBULA_WITH_CUDA is defined. This
// header deliberately includes no CUDA headers, so the .cpp files that use it
// are still built by the host compiler.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

namespace nebula {
namespace cuda {

// cudaHostRegister / cudaHostUnregister (page-lock an existing allocation).
void host_register(void* ptr, size_t nbytes);
void host_unregister(void* ptr) noexcept;

// Device-to-host copies of one CopyJob. Usage: add() every CUDA source,
// launch() once, then query()/synchronize(). The batch keeps every source
// tensor alive, and its destructor waits for outstanding copies, so the
// device memory being read and the host memory being written stay valid.
class CudaCopyBatch {
 public:
  virtual ~CudaCopyBatch() = default;

  // `index` is the position in the caller's srcs list; `dst` has room for
  // src.numel() * src.element_size() bytes; `version` is src._version() at
  // enqueue, or -1 when the tensor has no version counter (inference tensors).
  virtual void add(size_t index, const at::Tensor& src, uint8_t* dst, int64_t version) = 0;

  // Enqueue all copies: per device, an event on the current stream orders
  // the copies after all work already queued there; the copies run on a side
  // stream so the compute stream is not blocked.
  virtual void launch() = 0;

  // True when every copy has finished (non-blocking).
  virtual bool query() = 0;

  // Block until every copy has finished. Call without the GIL.
  virtual void synchronize() = 0;

  // After synchronize(): indices whose version changed before their copy
  // finished, and the time the last copy finished.
  virtual std::vector<size_t> modified() const = 0;
  virtual std::chrono::steady_clock::time_point finish_time() const = 0;
};

std::unique_ptr<CudaCopyBatch> make_copy_batch();

// Do once, now, what the first device-to-host snapshot copy of a process on
// `device` would otherwise do inside a save: take the side stream (and
// PyTorch's stream pool with it), create and record events, run a host
// function and an asynchronous copy into page-locked memory on it. Nothing is
// ordered after the compute stream, and only the side stream is waited for:
// work queued on the GPU does not have to drain, unless the driver's own
// first-use setup synchronizes the device (then it does so here, once,
// instead of in the first save). Idempotent; a later call returns at once.
void warm_up(c10::DeviceIndex device);

}  // namespace cuda
}  // namespace nebula
