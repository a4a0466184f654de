// Device-to-host snapshot copies and pinned host memory (CUDA build only).
//
// No kernels live here: the copies are cudaMemcpyAsync on a side stream, and
// non-contiguous sources are first made contiguous by ATen on that stream.
#include "copy_cuda.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <optional>

#include <cuda_runtime.h>

#include <ATen/Functions.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

namespace nebula {
namespace cuda {

using Clock = std::chrono::steady_clock;

void host_register(void* ptr, size_t nbytes) {
  const cudaError_t err = cudaHostRegister(ptr, nbytes, cudaHostRegisterDefault);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear the (non-sticky) error state
    TORCH_CHECK(false, "alloc_host_buffer: cudaHostRegister of ", nbytes,
                " bytes failed: ", cudaGetErrorString(err));
  }
}

void host_unregister(void* ptr) noexcept {
  // May fail at interpreter shutdown once the CUDA context is gone; the
  // memory is freed by the caller either way.
  if (cudaHostUnregister(ptr) != cudaSuccess) (void)cudaGetLastError();
}

namespace {

// One side stream per device, created once: snapshot copies are ordered
// among themselves and never wait behind (or block) the compute stream.
c10::cuda::CUDAStream side_stream(c10::DeviceIndex device) {
  static std::mutex mu;
  static std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
  std::lock_guard<std::mutex> lk(mu);
  auto it = streams.find(device);
  if (it == streams.end()) {
    it = streams.emplace(device, c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device))
             .first;
  }
  return it->second;
}

bool plain_contiguous(const at::Tensor& t) {
  return t.is_contiguous() && !t.is_conj() && !t.is_neg();
}

class CudaCopyBatchImpl;

struct Entry {
  size_t index;
  at::Tensor src;     // held until the copy finished
  at::Tensor staged;  // contiguous temporary on the side stream, if needed
  uint8_t* dst;
  int64_t version;
};

struct DeviceGroup {
  c10::DeviceIndex device = -1;
  std::vector<size_t> entries;  // positions in CudaCopyBatchImpl::entries_
  cudaEvent_t ready = nullptr;  // recorded on the compute stream
  cudaEvent_t done = nullptr;   // recorded on the side stream after the copies
  cudaStream_t stream = nullptr;
  bool issued = false;    // some work was queued on `stream`
  bool launched = false;  // `done` was recorded
  CudaCopyBatchImpl* owner = nullptr;
};

class CudaCopyBatchImpl final : public CudaCopyBatch {
 public:
  ~CudaCopyBatchImpl() override {
    // Never leave the device writing into host memory (or reading tensors)
    // we are about to release. Errors are ignored: destructors must not throw.
    for (auto& g : groups_) {
      c10::cuda::CUDAGuard guard(g->device);
      if (g->launched) {
        (void)cudaEventSynchronize(g->done);
      } else if (g->issued) {
        (void)cudaStreamSynchronize(g->stream);
      }
      if (g->ready) (void)cudaEventDestroy(g->ready);
      if (g->done) (void)cudaEventDestroy(g->done);
    }
    (void)cudaGetLastError();
  }

  void add(size_t index, const at::Tensor& src, uint8_t* dst, int64_t version) override {
    TORCH_INTERNAL_ASSERT(!launched_, "CudaCopyBatch::add after launch");
    entries_.push_back(Entry{index, src, at::Tensor(), dst, version});
  }

  void launch() override {
    TORCH_INTERNAL_ASSERT(!launched_, "CudaCopyBatch::launch twice");
    launched_ = true;
    std::map<c10::DeviceIndex, DeviceGroup*> by_device;
    for (size_t k = 0; k < entries_.size(); ++k) {
      const c10::DeviceIndex d = entries_[k].src.device().index();
      auto it = by_device.find(d);
      if (it == by_device.end()) {
        groups_.push_back(std::make_unique<DeviceGroup>());
        groups_.back()->device = d;
        groups_.back()->owner = this;
        it = by_device.emplace(d, groups_.back().get()).first;
      }
      it->second->entries.push_back(k);
    }
    for (auto& g : groups_) launch_group(*g);
  }

  bool query() override {
    for (auto& g : groups_) {
      if (!g->launched) continue;
      c10::cuda::CUDAGuard guard(g->device);
      const cudaError_t err = cudaEventQuery(g->done);
      if (err == cudaErrorNotReady) {
        (void)cudaGetLastError();
        return false;
      }
      C10_CUDA_CHECK(err);
    }
    return true;
  }

  void synchronize() override {
    for (auto& g : groups_) {
      if (!g->launched) continue;
      c10::cuda::CUDAGuard guard(g->device);
      C10_CUDA_CHECK(cudaEventSynchronize(g->done));
    }
  }

  std::vector<size_t> modified() const override {
    std::lock_guard<std::mutex> lk(mu_);
    return modified_;
  }

  Clock::time_point finish_time() const override {
    std::lock_guard<std::mutex> lk(mu_);
    return finish_;
  }

 private:
  void launch_group(DeviceGroup& g) {
    c10::cuda::CUDAGuard guard(g.device);
    const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(g.device);
    const c10::cuda::CUDAStream side = side_stream(g.device);
    g.stream = side.stream();
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&g.ready, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&g.done, cudaEventDisableTiming));
    // The copies must see every kernel already queued on the compute stream
    // (e.g. the optimizer step that produced these values).
    C10_CUDA_CHECK(cudaEventRecord(g.ready, compute.stream()));
    C10_CUDA_CHECK(cudaStreamWaitEvent(g.stream, g.ready, 0));
    g.issued = true;
    {
      // Temporaries (contiguous() of strided sources) are computed and
      // allocated on the side stream, so the caching allocator reuses their
      // memory only after our copies.
      c10::cuda::CUDAStreamGuard stream_guard(side);
      for (size_t k : g.entries) {
        Entry& e = entries_[k];
        const at::Tensor* from = &e.src;
        if (!plain_contiguous(e.src)) {
          // ATen has no copy kernel for the sub-byte shell dtypes (int1..7, uint1..7): a
          // 1-byte source is made contiguous as its bytes (the same image for every 1-byte
          // dtype), as the CPU engine does. A neg or conj view cannot be viewed so.
          const bool as_bytes = e.src.element_size() == 1 && !e.src.is_neg() && !e.src.is_conj();
          e.staged = as_bytes ? e.src.view(at::kByte).contiguous()
                              : e.src.resolve_conj().resolve_neg().contiguous();
          from = &e.staged;
        }
        // Asynchronous only when e.dst is page-locked (alloc_host_buffer with
        // pinned=True); pageable memory makes this call block until done.
        C10_CUDA_CHECK(cudaMemcpyAsync(e.dst, from->const_data_ptr(), e.src.nbytes(),
                                       cudaMemcpyDeviceToHost, g.stream));
      }
    }
    // Runs on a driver thread once the copies above finished: read the
    // version counters *then*, so an in-place update launched while we were
    // still copying is reported as a modification.
    C10_CUDA_CHECK(cudaLaunchHostFunc(g.stream, &CudaCopyBatchImpl::on_group_done, &g));
    C10_CUDA_CHECK(cudaEventRecord(g.done, g.stream));
    g.launched = true;
  }

  static void CUDART_CB on_group_done(void* data) {
    auto* g = static_cast<DeviceGroup*>(data);
    g->owner->group_done(*g);
  }

  // No CUDA calls allowed in here (host function rules).
  void group_done(const DeviceGroup& g) noexcept {
    const Clock::time_point now = Clock::now();
    std::vector<size_t> changed;
    try {
      for (size_t k : g.entries) {
        const Entry& e = entries_[k];
        if (e.version >= 0 && static_cast<int64_t>(e.src._version()) != e.version) {
          changed.push_back(e.index);
        }
      }
    } catch (...) {
      // Reading a version counter does not throw for tracked tensors; be
      // defensive anyway, exceptions must not escape into the driver.
    }
    std::lock_guard<std::mutex> lk(mu_);
    modified_.insert(modified_.end(), changed.begin(), changed.end());
    finish_ = std::max(finish_, now);
  }

  std::vector<Entry> entries_;
  std::vector<std::unique_ptr<DeviceGroup>> groups_;
  bool launched_ = false;
  mutable std::mutex mu_;
  std::vector<size_t> modified_;
  Clock::time_point finish_{};
};

}  // namespace

std::unique_ptr<CudaCopyBatch> make_copy_batch() {
  return std::make_unique<CudaCopyBatchImpl>();
}

namespace {
void CUDART_CB noop_host_fn(void*) {}
}  // namespace

void warm_up(c10::DeviceIndex device) {
  static std::mutex mu;
  // device -> its page-locked scratch, kept for the process (cudaFreeHost may synchronize)
  static std::map<c10::DeviceIndex, void*> done;
  std::lock_guard<std::mutex> lk(mu);
  if (done.count(device) != 0) return;
  c10::cuda::CUDAGuard guard(device);
  const c10::cuda::CUDAStream side = side_stream(device);
  const cudaStream_t s = side.stream();
  cudaEvent_t a = nullptr, b = nullptr;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&a, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&b, cudaEventDisableTiming));
  void* host = nullptr;
  at::Tensor dev;
  {
    // from PyTorch's caching allocator, on the side stream: nothing is freed to the driver
    // (cudaFree would synchronize the device)
    c10::cuda::CUDAStreamGuard stream_guard(side);
    dev = at::empty({64}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device));
  }
  cudaError_t err = cudaHostAlloc(&host, 64, cudaHostAllocDefault);
  if (err == cudaSuccess) err = cudaEventRecord(a, s);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(s, a, 0);
  if (err == cudaSuccess) err = cudaMemcpyAsync(host, dev.const_data_ptr(), 64, cudaMemcpyDeviceToHost, s);
  if (err == cudaSuccess) err = cudaLaunchHostFunc(s, &noop_host_fn, nullptr);
  if (err == cudaSuccess) err = cudaEventRecord(b, s);
  if (err == cudaSuccess) err = cudaEventSynchronize(b);  // the side stream only
  (void)cudaStreamSynchronize(s);
  dev = at::Tensor();
  (void)cudaEventDestroy(a);
  (void)cudaEventDestroy(b);
  C10_CUDA_CHECK(err);
  done[device] = host;
}

}  // namespace cuda
}  // namespace nebula
