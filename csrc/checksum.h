// CRC32C (Castagnoli) checksums: SSE4.2 hardware path with a table-driven
// software fallback, plus a GF(2) combine so ranges can be hashed in
// parallel pieces.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace nebula {

// True when the running CPU has the SSE4.2 crc32 instruction and this build
// can use it.
bool crc32c_hw_available();

// Continue `crc` (a finished CRC32C value, 0 for a fresh checksum) over
// data[0, len). Same semantics as the PyPI crc32c package:
// crc32c_update(crc32c_update(0, a), b) == crc32c(a + b).
uint32_t crc32c_update(uint32_t crc, const void* data, size_t len);

// Copy src[0, len) to dst and continue `crc` over the bytes *stored*: each
// byte is read once, into a register that feeds both the hash and the store,
// so the result is the checksum of dst even while another thread writes src.
// With `stream`, the (16-byte aligned) bulk is written with non-temporal
// stores and fenced before returning. The buffers must not overlap.
uint32_t crc32c_copy(uint32_t crc, void* dst, const void* src, size_t len, bool stream);

// CRC32C of A+B given crc(A), crc(B) and len(B) (zlib's crc32_combine for the
// Castagnoli polynomial).
uint32_t crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2);

// CRC32C of each range [offsets[i], offsets[i] + lengths[i]) of the 1-D
// contiguous uint8 CPU tensor `buf`. Large ranges are split into pieces hashed
// on different threads and combined. Blocking; call without the GIL.
std::vector<int64_t> crc32c_ranges(const at::Tensor& buf, const std::vector<int64_t>& offsets,
                                   const std::vector<int64_t>& lengths, int64_t num_threads);

}  // namespace nebula
