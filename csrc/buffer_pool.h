// Page-aligned, pre-faulted host staging buffers.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace nebula {

// Returns a 1-D uint8 CPU tensor of `nbytes` elements over memory that is
//  * aligned to 2 MiB when nbytes >= 2 MiB (and advised MADV_HUGEPAGE when
//    `huge_pages`), else 4096,
//  * allocated in a multiple of 4096 bytes (so O_DIRECT-sized blocks fit),
//  * pre-faulted by writing zeros with `prefault_threads` threads, so the first
//    checkpoint copy does not pay page faults (0: not touched, for a buffer a
//    parallel copy fills right away; it still reads as zeros),
//  * page-locked with cudaHostRegister when `pinned` (CUDA build only).
// The memory is released (and unregistered) by the tensor's deleter.
// Blocking; call without the GIL.
at::Tensor alloc_host_buffer(int64_t nbytes, bool pinned, int64_t prefault_threads, bool huge_pages);

}  // namespace nebula
