// Parallel positional file I/O between host buffers and local files.
#pragma once

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

namespace nebula {

// True when this build knows O_DIRECT (Linux).
bool o_direct_supported();

// Write buf[offset, offset + nbytes) to a new (or truncated) file `path` with
// parallel pwrite. With `direct`, the 4096-aligned prefix goes through
// O_DIRECT when the filesystem and buffer alignment allow it (silent buffered
// fallback otherwise). Returns true if O_DIRECT was used. Throws c10::Error
// naming the path and strerror on failure. Blocking; call without the GIL.
bool write_file(const std::string& path, const at::Tensor& buf, int64_t offset, int64_t nbytes,
                bool direct, int64_t num_threads, int64_t chunk_bytes, bool do_fsync);

// Read the first nbytes of `path` into buf[offset, offset + nbytes) with
// parallel pread. Blocking; call without the GIL.
void read_file(const std::string& path, const at::Tensor& buf, int64_t offset, int64_t nbytes,
               int64_t num_threads);

}  // namespace nebula
