#include "buffer_pool.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <ATen/Functions.h>
#include <c10/util/Exception.h>

#include "thread_pool.h"

#ifdef NEBULA_WITH_CUDA
#include "cuda/copy_cuda.h"
#endif

namespace nebula {

namespace {

constexpr size_t kPage = 4096;
constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kPrefaultChunk = size_t{4} << 20;
constexpr size_t kFreshMapping = size_t{64} << 20;  // above glibc's largest mmap threshold
#ifdef MADV_POPULATE_WRITE
constexpr int kMadvPopulateWrite = MADV_POPULATE_WRITE;
#else
constexpr int kMadvPopulateWrite = 23;  // Linux 5.14; older kernels fail with EINVAL: memset then
#endif

inline size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

}  // namespace

at::Tensor alloc_host_buffer(int64_t nbytes, bool pinned, int64_t prefault_threads, bool huge_pages) {
  TORCH_CHECK(nbytes >= 0, "alloc_host_buffer: nbytes must be >= 0, got ", nbytes);
#ifndef NEBULA_WITH_CUDA
  // Fail before touching memory: a CPU-only build cannot page-lock.
  TORCH_CHECK(!pinned, "pinned host buffers need the CUDA build of nebula_ckpt._C");
#endif

  const size_t want = static_cast<size_t>(nbytes);
  const size_t alignment = want >= kHugePage ? kHugePage : kPage;
  // Always allocate at least one page so even a 0-byte buffer has a valid,
  // aligned data pointer.
  const size_t alloc_bytes = round_up(want == 0 ? 1 : want, kPage);

  void* ptr = nullptr;
  const int rc = posix_memalign(&ptr, alignment, alloc_bytes);
  TORCH_CHECK(rc == 0 && ptr != nullptr, "alloc_host_buffer: could not allocate ", alloc_bytes,
              " bytes: ", std::strerror(rc));

#ifdef MADV_HUGEPAGE
  if (huge_pages && alignment == kHugePage) {
    // Transparent huge pages cut TLB misses and page faults where the OS
    // hands them out cheaply. Only a hint: failure (THP disabled) is harmless.
    // Off by default (knob huge_pages): on VMs that give freed memory back to
    // the host, a fresh huge page costs far more than 512 small ones.
    (void)madvise(ptr, alloc_bytes, MADV_HUGEPAGE);
  }
#endif

  // Pre-fault: touching every page now moves the page-fault cost out of the
  // (latency critical) snapshot copy, and guarantees the buffer reads as zeros.
  // glibc serves blocks over its largest mmap threshold (32 MiB) with fresh
  // anonymous mappings, which the kernel hands out zeroed: those are populated
  // with MADV_POPULATE_WRITE, one call per 4 MiB chunk instead of a trap per
  // page (a kernel without it, < 5.14, gets the zeros written). Smaller blocks
  // may be recycled heap, so they are written with zeros either way.
  // prefault_threads == 0: no pass at all, for a buffer a parallel copy fills
  // at once (its threads take the faults, and the pages are written once).
  auto* base = static_cast<uint8_t*>(ptr);
  if (prefault_threads <= 0 && alloc_bytes < kFreshMapping) std::memset(base, 0, alloc_bytes);
  const bool fresh = alloc_bytes >= kFreshMapping;
  const size_t n_chunks =
      prefault_threads <= 0 ? 0 : (alloc_bytes + kPrefaultChunk - 1) / kPrefaultChunk;
  if (n_chunks > 0) {
    parallel_run(clamp_threads(prefault_threads), n_chunks, [&](size_t i) {
      const size_t begin = i * kPrefaultChunk;
      const size_t len = std::min(kPrefaultChunk, alloc_bytes - begin);
      if (!fresh || madvise(base + begin, len, kMadvPopulateWrite) != 0) std::memset(base + begin, 0, len);
    });
  }

  bool registered = false;
#ifdef NEBULA_WITH_CUDA
  if (pinned) {
    try {
      cuda::host_register(ptr, alloc_bytes);
    } catch (...) {
      std::free(ptr);
      throw;
    }
    registered = true;
  }
#endif

  auto deleter = [registered](void* p) {
#ifdef NEBULA_WITH_CUDA
    if (registered) cuda::host_unregister(p);
#else
    (void)registered;
#endif
    std::free(p);
  };
  // Once from_blob has wrapped the pointer, the deleter owns it (no manual
  // cleanup on error paths after this point, or we would double free).
  return at::from_blob(ptr, {nbytes}, deleter,
                       at::TensorOptions().dtype(at::kByte).device(at::kCPU));
}

}  // namespace nebula
