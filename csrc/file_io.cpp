#include "file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <system_error>
#include <utility>

#include <c10/util/Exception.h>

#include "thread_pool.h"

namespace nebula {

namespace {

constexpr size_t kAlign = 4096;  // O_DIRECT alignment we require (covers 512/4K sectors)
constexpr int64_t kDefaultChunk = int64_t{16} << 20;

inline size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

// strerror() is not thread-safe; the system_category message is.
std::string errstr(int err) { return std::system_category().message(err); }

[[noreturn]] void io_fail(const char* what, const std::string& path, int err, const char* op) {
  throw IoError(err, path, errstr(err) + " (" + op + " while " + what + ")");
}

// Owns a file descriptor; closes it on every (including error) path.
struct Fd {
  int fd = -1;
  Fd() = default;
  explicit Fd(int f) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  // Close and report the error: on NFS-like filesystems, write errors may
  // only surface here.
  int release_close() {
    const int f = fd;
    fd = -1;
    return f >= 0 ? ::close(f) : 0;
  }
};

void check_buf(const char* fn, const at::Tensor& buf, int64_t offset, int64_t nbytes) {
  TORCH_CHECK(buf.defined(), fn, ": buf is undefined");
  TORCH_CHECK(buf.device().is_cpu(), fn, ": buf must be a CPU tensor, got ", buf.device());
  TORCH_CHECK(buf.scalar_type() == at::kByte, fn, ": buf must be uint8, got ", buf.scalar_type());
  TORCH_CHECK(buf.dim() == 1 && buf.is_contiguous(), fn,
              ": buf must be a 1-D contiguous tensor, got shape ", buf.sizes());
  const int64_t n = buf.numel();
  TORCH_CHECK(offset >= 0 && nbytes >= 0 && offset <= n && nbytes <= n - offset, fn,
              ": range [", offset, ", ", offset, " + ", nbytes, ") is outside buf of ", n,
              " bytes");
}

enum class WriteResult { kDone, kDirectRejected };

// pwrite all of [p, p+len) at file offset `off`, retrying short writes and
// EINTR. For the O_DIRECT fd, EINVAL (filesystem refuses direct I/O at write
// time, or a short write left us unaligned) is reported back so the caller can
// finish the range through the buffered fd; `done` tells how far we got.
WriteResult pwrite_all(int fd, const uint8_t* p, size_t len, uint64_t off, bool is_direct,
                       const std::string& path, size_t* done) {
  *done = 0;
  while (len > 0) {
    if (is_direct && ((reinterpret_cast<uintptr_t>(p) | off | len) & (kAlign - 1))) {
      return WriteResult::kDirectRejected;
    }
    // Linux transfers at most ~2 GiB per call; larger requests come back short.
    const ssize_t n = ::pwrite(fd, p, len, static_cast<off_t>(off));
    if (n < 0) {
      if (errno == EINTR) continue;
      if (is_direct && errno == EINVAL) return WriteResult::kDirectRejected;
      io_fail("writing", path, errno, "pwrite");
    }
    if (n == 0) io_fail("writing", path, EIO, "pwrite wrote 0 bytes");
    p += n;
    off += static_cast<uint64_t>(n);
    len -= static_cast<size_t>(n);
    *done += static_cast<size_t>(n);
  }
  return WriteResult::kDone;
}

}  // namespace

IoError::IoError(int err, std::string path, std::string reason)
    : std::runtime_error("nebula_ckpt: '" + path + "': " + reason),
      err_(err),
      path_(std::move(path)),
      reason_(std::move(reason)) {}

bool o_direct_supported() {
#ifdef O_DIRECT
  return true;
#else
  return false;
#endif
}

namespace {

// write_file after open(): everything that may leave a partial file behind.
bool write_open_file(const std::string& path, Fd& fd, const uint8_t* src, size_t total,
                     size_t chunk, bool direct, int64_t num_threads, bool do_fsync) {
  // O_DIRECT bypasses the page cache (no double buffering of multi-GB
  // checkpoints, no dirty-page writeback storms), but needs the buffer
  // address, file offset and length aligned. We send the aligned prefix
  // through a second, O_DIRECT fd and the (< 4096 byte) tail through the
  // buffered one.
  Fd dfd;
  size_t direct_len = 0;
#ifdef O_DIRECT
  if (direct && total >= kAlign && (reinterpret_cast<uintptr_t>(src) & (kAlign - 1)) == 0) {
    dfd.fd = ::open(path.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC);
    // EINVAL: filesystem without O_DIRECT (tmpfs, some FUSE). Any other
    // failure also just means "no direct I/O"; buffered writes still work.
    if (dfd.fd >= 0) direct_len = total & ~(kAlign - 1);
  }
#else
  (void)direct;
#endif

#ifdef __linux__
  if (total > 0) {
    // Reserve the blocks up front: fails fast on ENOSPC before any data is
    // written and avoids fragmenting a file written out of order. Filesystems
    // without fallocate (EOPNOTSUPP) are fine.
    int rc;
    do {
      rc = ::fallocate(fd.fd, 0, 0, static_cast<off_t>(total));
    } while (rc != 0 && errno == EINTR);
    if (rc != 0 && (errno == ENOSPC || errno == EDQUOT || errno == EFBIG)) {
      io_fail("writing", path, errno, "fallocate");
    }
  }
#endif

  std::atomic<bool> direct_rejected{false};
  const size_t n_chunks = (total + chunk - 1) / chunk;
  parallel_run(clamp_threads(num_threads), n_chunks, [&](size_t i) {
    const size_t begin = i * chunk;
    const size_t end = std::min(total, begin + chunk);
    size_t pos = begin;
    // Part of this chunk inside the aligned prefix: O_DIRECT.
    if (dfd.fd >= 0 && pos < direct_len && !direct_rejected.load(std::memory_order_relaxed)) {
      const size_t dend = std::min(end, direct_len);
      size_t done = 0;
      if (pwrite_all(dfd.fd, src + pos, dend - pos, pos, /*is_direct=*/true, path, &done) ==
          WriteResult::kDirectRejected) {
        direct_rejected.store(true, std::memory_order_relaxed);
      }
      pos += done;
    }
    // Rest (the unaligned tail, or everything after a fallback): buffered.
    if (pos < end) {
      size_t done = 0;
      pwrite_all(fd.fd, src + pos, end - pos, pos, /*is_direct=*/false, path, &done);
    }
  });

  if (do_fsync) {
    // One fsync on the inode covers data written through both descriptors,
    // plus the size/metadata that O_DIRECT alone does not make durable.
    int rc;
    do {
      rc = ::fsync(fd.fd);
    } while (rc != 0 && errno == EINTR);
    if (rc != 0) io_fail("writing", path, errno, "fsync");
  }
  if (dfd.release_close() != 0) io_fail("writing", path, errno, "close");
  if (fd.release_close() != 0) io_fail("writing", path, errno, "close");
  return direct_len > 0 && !direct_rejected.load();
}

}  // namespace

bool write_file(const std::string& path, const at::Tensor& buf, int64_t offset, int64_t nbytes,
                bool direct, int64_t num_threads, int64_t chunk_bytes, bool do_fsync) {
  check_buf("write_file", buf, offset, nbytes);
  const auto* src = static_cast<const uint8_t*>(buf.const_data_ptr()) + offset;
  const size_t total = static_cast<size_t>(nbytes);
  // Chunks are multiples of 4096 so every chunk boundary is O_DIRECT-aligned.
  const size_t chunk =
      round_up(static_cast<size_t>(chunk_bytes > 0 ? chunk_bytes : kDefaultChunk), kAlign);

  Fd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.fd < 0) io_fail("writing", path, errno, "open");
  try {
    return write_open_file(path, fd, src, total, chunk, direct, num_threads, do_fsync);
  } catch (...) {
    // The old contents are gone (O_TRUNC) and a torn file would only hold
    // space (on a full disk, all of it): remove it.
    ::unlink(path.c_str());
    throw;
  }
}

void read_file(const std::string& path, const at::Tensor& buf, int64_t offset, int64_t nbytes,
               int64_t num_threads) {
  check_buf("read_file", buf, offset, nbytes);
  auto* dst = static_cast<uint8_t*>(buf.data_ptr()) + offset;
  const size_t total = static_cast<size_t>(nbytes);

  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.fd < 0) io_fail("reading", path, errno, "open");
  struct stat st;
  if (::fstat(fd.fd, &st) != 0) io_fail("reading", path, errno, "fstat");
  TORCH_CHECK(static_cast<uint64_t>(st.st_size) >= total, "nebula_ckpt: read from '", path,
              "' failed: file has ", static_cast<int64_t>(st.st_size),
              " bytes, expected at least ", nbytes);

  const int threads = clamp_threads(num_threads);
  // Enough chunks for every thread, but big enough to keep syscalls cheap.
  size_t chunk = round_up((total + threads - 1) / std::max(threads, 1), kAlign);
  chunk = std::min(std::max(chunk, size_t{1} << 20), size_t{16} << 20);
  const size_t n_chunks = (total + chunk - 1) / chunk;
  parallel_run(threads, n_chunks, [&](size_t i) {
    size_t pos = i * chunk;
    const size_t end = std::min(total, pos + chunk);
    while (pos < end) {
      const ssize_t n = ::pread(fd.fd, dst + pos, end - pos, static_cast<off_t>(pos));
      if (n < 0) {
        if (errno == EINTR) continue;
        io_fail("reading", path, errno, "pread");
      }
      TORCH_CHECK(n > 0, "nebula_ckpt: read from '", path,
                  "' failed: unexpected end of file at byte ", pos, " (file shrank?)");
      pos += static_cast<size_t>(n);
    }
  });
}

}  // namespace nebula
