// Parallel positional file I/O between host buffers and local files.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include <ATen/core/Tensor.h>

namespace nebula {

// A failed system call on a file: carries errno and the path, and reaches
// Python as OSError(errno, reason, path) (the bindings translate it), so
// callers can tell ENOSPC from EACCES from EIO.
class IoError : public std::runtime_error {
 public:
  // reason: strerror(err) plus the operation, e.g. "No space left on device (fallocate)".
  IoError(int err, std::string path, std::string reason);
  int err() const noexcept { return err_; }
  const std::string& path() const noexcept { return path_; }
  const std::string& reason() const noexcept { return reason_; }

 private:
  int err_;
  std::string path_;
  std::string reason_;
};

// True when this build knows O_DIRECT (Linux).
bool o_direct_supported();

// Write buf[offset, offset + nbytes) to a new (or truncated) file `path` with
// parallel pwrite. With `direct`, the 4096-aligned prefix goes through
// O_DIRECT when the filesystem and buffer alignment allow it (silent buffered
// fallback otherwise). Returns true if O_DIRECT was used. Throws IoError
// (errno, path) when a system call fails, after removing the file (its old
// contents were truncated anyway); c10::Error for bad arguments.
// Blocking; call without the GIL.
bool write_file(const std::string& path, const at::Tensor& buf, int64_t offset, int64_t nbytes,
                bool direct, int64_t num_threads, int64_t chunk_bytes, bool do_fsync);

// Read the first nbytes of `path` into buf[offset, offset + nbytes) with
// parallel pread. Throws IoError when a system call fails, c10::Error when the
// file is shorter than nbytes. Blocking; call without the GIL.
void read_file(const std::string& path, const at::Tensor& buf, int64_t offset, int64_t nbytes,
               int64_t num_threads);

}  // namespace nebula
