#include "checksum.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include <c10/util/Exception.h>

#include "thread_pool.h"

#if defined(__x86_64__) || defined(_M_X64)
#define NEBULA_CRC_X86 1
#include <nmmintrin.h>
#include <smmintrin.h>
#endif

namespace nebula {

namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

// ---------------------------------------------------------------------------
// GF(2) matrix helpers (as in zlib's crc32_combine). A 32x32 bit matrix is
// stored as 32 column vectors; "applying n zero bytes" to a CRC register is a
// linear operator, which lets us shift and combine independently computed CRCs.

uint32_t gf2_matrix_times(const uint32_t* mat, uint32_t vec) {
  uint32_t sum = 0;
  while (vec) {
    if (vec & 1) sum ^= *mat;
    vec >>= 1;
    ++mat;
  }
  return sum;
}

void gf2_matrix_square(uint32_t* square, const uint32_t* mat) {
  for (int n = 0; n < 32; ++n) square[n] = gf2_matrix_times(mat, mat[n]);
}

// Operator for one zero *bit*.
void one_zero_bit_op(uint32_t* odd) {
  odd[0] = kPoly;
  uint32_t row = 1;
  for (int n = 1; n < 32; ++n) {
    odd[n] = row;
    row <<= 1;
  }
}

// Operator that appends `len` zero bytes (len a power of two) to a CRC register.
void zeros_op(uint32_t* even, size_t len) {
  uint32_t odd[32];
  one_zero_bit_op(odd);
  gf2_matrix_square(even, odd);  // 2 zero bits
  gf2_matrix_square(odd, even);  // 4 zero bits
  // The next square yields 1 zero byte in `even`, then 2 in `odd`, ...
  do {
    gf2_matrix_square(even, odd);
    len >>= 1;
    if (len == 0) return;
    gf2_matrix_square(odd, even);
    len >>= 1;
  } while (len);
  std::memcpy(even, odd, sizeof(odd));
}

// ---------------------------------------------------------------------------
// Tables, built once (thread-safe function-local static).

struct Tables {
  uint32_t sw[8][256];  // slicing-by-8 software tables
#ifdef NEBULA_CRC_X86
  // zeros tables used to shift the 3 interleaved hardware streams
  uint32_t long_shift[4][256];
  uint32_t short_shift[4][256];
#endif

  Tables() {
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      sw[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = sw[0][n];
      for (int k = 1; k < 8; ++k) {
        c = (c >> 8) ^ sw[0][c & 0xff];
        sw[k][n] = c;
      }
    }
#ifdef NEBULA_CRC_X86
    fill_shift(long_shift, kLong);
    fill_shift(short_shift, kShort);
#endif
  }

#ifdef NEBULA_CRC_X86
  static constexpr size_t kLong = 8192;
  static constexpr size_t kShort = 256;

  static void fill_shift(uint32_t zeros[4][256], size_t len) {
    uint32_t op[32];
    zeros_op(op, len);
    for (uint32_t n = 0; n < 256; ++n) {
      zeros[0][n] = gf2_matrix_times(op, n);
      zeros[1][n] = gf2_matrix_times(op, n << 8);
      zeros[2][n] = gf2_matrix_times(op, n << 16);
      zeros[3][n] = gf2_matrix_times(op, n << 24);
    }
  }
#endif
};

const Tables& tables() {
  static const Tables t;
  return t;
}

// Software: slicing-by-8 on the raw (non-inverted) register.
uint32_t crc_sw(uint32_t crc, const uint8_t* p, size_t len) {
  const Tables& t = tables();
  while (len && (reinterpret_cast<uintptr_t>(p) & 7)) {
    crc = (crc >> 8) ^ t.sw[0][(crc ^ *p++) & 0xff];
    --len;
  }
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  while (len >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= crc;
    crc = t.sw[7][w & 0xff] ^ t.sw[6][(w >> 8) & 0xff] ^ t.sw[5][(w >> 16) & 0xff] ^
          t.sw[4][(w >> 24) & 0xff] ^ t.sw[3][(w >> 32) & 0xff] ^ t.sw[2][(w >> 40) & 0xff] ^
          t.sw[1][(w >> 48) & 0xff] ^ t.sw[0][w >> 56];
    p += 8;
    len -= 8;
  }
#endif
  while (len--) crc = (crc >> 8) ^ t.sw[0][(crc ^ *p++) & 0xff];
  return crc;
}

#ifdef NEBULA_CRC_X86

inline uint32_t shift_crc(const uint32_t zeros[4][256], uint32_t crc) {
  return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^
         zeros[3][crc >> 24];
}

// Hardware: the crc32 instruction has a latency of 3 cycles but a throughput
// of 1, so hashing three independent streams at once and merging them with
// the zeros tables runs ~3x faster than a single dependency chain
// (Mark Adler's crc32c scheme). This hashes whole groups of three
// `block`-byte streams (a separate function: lambdas would not inherit the
// target attribute).
__attribute__((target("sse4.2"))) void crc_hw_interleaved(uint64_t& crc0, const uint8_t*& p,
                                                          size_t& len, size_t block,
                                                          const uint32_t zeros[4][256]) {
  while (len >= 3 * block) {
    uint64_t crc1 = 0, crc2 = 0;
    const uint8_t* end = p + block;
    do {
      uint64_t a, b, c;
      std::memcpy(&a, p, 8);
      std::memcpy(&b, p + block, 8);
      std::memcpy(&c, p + 2 * block, 8);
      crc0 = _mm_crc32_u64(crc0, a);
      crc1 = _mm_crc32_u64(crc1, b);
      crc2 = _mm_crc32_u64(crc2, c);
      p += 8;
    } while (p < end);
    crc0 = shift_crc(zeros, static_cast<uint32_t>(crc0)) ^ crc1;
    crc0 = shift_crc(zeros, static_cast<uint32_t>(crc0)) ^ crc2;
    p += 2 * block;
    len -= 3 * block;
  }
}

__attribute__((target("sse4.2"))) uint32_t crc_hw(uint32_t crc, const uint8_t* p, size_t len) {
  const Tables& t = tables();
  uint64_t crc0 = crc;
  while (len && (reinterpret_cast<uintptr_t>(p) & 7)) {
    crc0 = _mm_crc32_u8(static_cast<uint32_t>(crc0), *p++);
    --len;
  }
  crc_hw_interleaved(crc0, p, len, Tables::kLong, t.long_shift);
  crc_hw_interleaved(crc0, p, len, Tables::kShort, t.short_shift);
  while (len >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    crc0 = _mm_crc32_u64(crc0, w);
    p += 8;
    len -= 8;
  }
  while (len--) crc0 = _mm_crc32_u8(static_cast<uint32_t>(crc0), *p++);
  return static_cast<uint32_t>(crc0);
}

// Copy and hash in one pass, exactly: every 16 bytes are loaded once into a
// vector register, and that register feeds both the crc32 instructions and
// the store. Hashing the source and copying it in two reads would let a
// concurrent writer change the bytes in between, so the recorded checksum
// would not be that of the staged bytes.
//
// Three interleaved lanes of `lane` bytes (like crc_hw_interleaved) keep the
// crc32 unit busy. With `stream`, stores bypass the cache (`to` must be
// 16-byte aligned): the staging buffer is not read again by this thread.
__attribute__((target("sse4.2"))) void copy_hw_interleaved(uint64_t& crc0, uint8_t*& to,
                                                           const uint8_t*& from, size_t& len,
                                                           size_t lane, bool stream,
                                                           const uint32_t zeros[4][256]) {
  while (len >= 3 * lane) {
    uint64_t crc[3] = {crc0, 0, 0};
    for (size_t off = 0; off < lane; off += 64) {
      for (int k = 0; k < 3; ++k) {
        const uint8_t* s = from + k * lane + off;
        uint8_t* d = to + k * lane + off;
        __m128i v0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
        __m128i v1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
        __m128i v2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
        __m128i v3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
        // The compiler may not re-read memory for either use of a register
        // it believes this (empty) asm may have changed.
        asm("" : "+x"(v0), "+x"(v1), "+x"(v2), "+x"(v3));
        uint64_t c = crc[k];
        c = _mm_crc32_u64(c, static_cast<uint64_t>(_mm_cvtsi128_si64(v0)));
        c = _mm_crc32_u64(c, static_cast<uint64_t>(_mm_extract_epi64(v0, 1)));
        c = _mm_crc32_u64(c, static_cast<uint64_t>(_mm_cvtsi128_si64(v1)));
        c = _mm_crc32_u64(c, static_cast<uint64_t>(_mm_extract_epi64(v1, 1)));
        c = _mm_crc32_u64(c, static_cast<uint64_t>(_mm_cvtsi128_si64(v2)));
        c = _mm_crc32_u64(c, static_cast<uint64_t>(_mm_extract_epi64(v2, 1)));
        c = _mm_crc32_u64(c, static_cast<uint64_t>(_mm_cvtsi128_si64(v3)));
        c = _mm_crc32_u64(c, static_cast<uint64_t>(_mm_extract_epi64(v3, 1)));
        crc[k] = c;
        if (stream) {
          _mm_stream_si128(reinterpret_cast<__m128i*>(d), v0);
          _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), v1);
          _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), v2);
          _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), v3);
        } else {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(d), v0);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 16), v1);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 32), v2);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 48), v3);
        }
      }
    }
    crc0 = shift_crc(zeros, static_cast<uint32_t>(crc[0])) ^ crc[1];
    crc0 = shift_crc(zeros, static_cast<uint32_t>(crc0)) ^ crc[2];
    from += 3 * lane;
    to += 3 * lane;
    len -= 3 * lane;
  }
}

__attribute__((target("sse4.2"))) uint32_t copy_hw(uint32_t crc, uint8_t* to, const uint8_t* from,
                                                   size_t len, bool stream) {
  const Tables& t = tables();
  uint64_t crc0 = crc;
  // Byte by byte up to a 16-byte aligned destination (each byte through a register).
  while (len && (reinterpret_cast<uintptr_t>(to) & 15)) {
    uint8_t b = *from++;
    asm("" : "+r"(b));
    crc0 = _mm_crc32_u8(static_cast<uint32_t>(crc0), b);
    *to++ = b;
    --len;
  }
  copy_hw_interleaved(crc0, to, from, len, Tables::kLong, stream, t.long_shift);
  copy_hw_interleaved(crc0, to, from, len, Tables::kShort, stream, t.short_shift);
  while (len >= 8) {
    uint64_t w;
    std::memcpy(&w, from, 8);
    asm("" : "+r"(w));
    crc0 = _mm_crc32_u64(crc0, w);
    std::memcpy(to, &w, 8);
    from += 8;
    to += 8;
    len -= 8;
  }
  while (len--) {
    uint8_t b = *from++;
    asm("" : "+r"(b));
    crc0 = _mm_crc32_u8(static_cast<uint32_t>(crc0), b);
    *to++ = b;
  }
  // Streaming stores are weakly ordered: publish them before the caller
  // reports the copy as done.
  if (stream) _mm_sfence();
  return static_cast<uint32_t>(crc0);
}

bool detect_hw() {
  // NEBULA_CRC32C_FORCE_SW=1 forces the table-driven path (used by the tests
  // to cover the fallback on machines that have SSE4.2).
  const char* force_sw = std::getenv("NEBULA_CRC32C_FORCE_SW");
  if (force_sw != nullptr && force_sw[0] != '\0' && force_sw[0] != '0') return false;
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse4.2");
}

#endif  // NEBULA_CRC_X86

constexpr size_t kPieceBytes = size_t{8} << 20;   // split ranges above this
constexpr size_t kMinParallelBytes = size_t{1} << 20;  // below: single thread

}  // namespace

bool crc32c_hw_available() {
#ifdef NEBULA_CRC_X86
  static const bool hw = detect_hw();
  return hw;
#else
  return false;
#endif
}

uint32_t crc32c_update(uint32_t crc, const void* data, size_t len) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t reg = ~crc;
#ifdef NEBULA_CRC_X86
  if (crc32c_hw_available()) return ~crc_hw(reg, p, len);
#endif
  return ~crc_sw(reg, p, len);
}

uint32_t crc32c_copy(uint32_t crc, void* dst, const void* src, size_t len, bool stream) {
  auto* to = static_cast<uint8_t*>(dst);
  const auto* from = static_cast<const uint8_t*>(src);
#ifdef NEBULA_CRC_X86
  if (crc32c_hw_available()) return ~copy_hw(~crc, to, from, len, stream);
#endif
  (void)stream;
  // Software: copy a slice, then hash the copy (still in cache), so the
  // checksum is that of the destination bytes even if the source changes.
  constexpr size_t kSlice = size_t{16} << 10;
  uint32_t reg = ~crc;
  for (size_t pos = 0; pos < len; pos += kSlice) {
    const size_t n = std::min(kSlice, len - pos);
    std::memcpy(to + pos, from + pos, n);
    reg = crc_sw(reg, to + pos, n);
  }
  return ~reg;
}

uint32_t crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2) {
  if (len2 == 0) return crc1;
  uint32_t even[32], odd[32];
  one_zero_bit_op(odd);
  gf2_matrix_square(even, odd);  // 2 zero bits
  gf2_matrix_square(odd, even);  // 4 zero bits
  // Apply len2 zero bytes to crc1 by binary decomposition of len2.
  do {
    gf2_matrix_square(even, odd);
    if (len2 & 1) crc1 = gf2_matrix_times(even, crc1);
    len2 >>= 1;
    if (len2 == 0) break;
    gf2_matrix_square(odd, even);
    if (len2 & 1) crc1 = gf2_matrix_times(odd, crc1);
    len2 >>= 1;
  } while (len2 != 0);
  return crc1 ^ crc2;
}

std::vector<int64_t> crc32c_ranges(const at::Tensor& buf, const std::vector<int64_t>& offsets,
                                   const std::vector<int64_t>& lengths, int64_t num_threads) {
  TORCH_CHECK(buf.defined(), "crc32c: buf is undefined");
  TORCH_CHECK(buf.device().is_cpu(), "crc32c: buf must be a CPU tensor, got ", buf.device());
  TORCH_CHECK(buf.scalar_type() == at::kByte, "crc32c: buf must be uint8, got ", buf.scalar_type());
  TORCH_CHECK(buf.dim() == 1 && buf.is_contiguous(),
              "crc32c: buf must be a 1-D contiguous tensor, got shape ", buf.sizes());
  TORCH_CHECK(offsets.size() == lengths.size(), "crc32c: offsets has ", offsets.size(),
              " entries but lengths has ", lengths.size());
  const int64_t n = buf.numel();
  for (size_t i = 0; i < offsets.size(); ++i) {
    TORCH_CHECK(offsets[i] >= 0 && lengths[i] >= 0 && offsets[i] <= n &&
                    lengths[i] <= n - offsets[i],
                "crc32c: range ", i, " [", offsets[i], ", ", offsets[i], " + ", lengths[i],
                ") is outside buf of ", n, " bytes");
  }

  const auto* base = static_cast<const uint8_t*>(buf.const_data_ptr());
  std::vector<int64_t> out(offsets.size(), 0);

  struct Piece {
    size_t range;
    size_t offset;
    size_t len;
    uint32_t crc;
  };
  std::vector<Piece> pieces;
  pieces.reserve(offsets.size());
  uint64_t total = 0;
  for (size_t i = 0; i < offsets.size(); ++i) {
    size_t off = static_cast<size_t>(offsets[i]);
    size_t left = static_cast<size_t>(lengths[i]);
    total += left;
    if (left == 0) continue;  // crc of nothing is 0, already in `out`
    while (left > 0) {
      const size_t len = std::min(left, kPieceBytes);
      pieces.push_back({i, off, len, 0});
      off += len;
      left -= len;
    }
  }

  // Small inputs: thread start-up would cost more than hashing them.
  const int threads = total < kMinParallelBytes ? 1 : clamp_threads(num_threads);
  // Many small ranges are handed out in batches so each hand-out amortises.
  const size_t batch = std::max<size_t>(1, pieces.size() / (static_cast<size_t>(threads) * 8));
  const size_t n_batches = (pieces.size() + batch - 1) / batch;
  parallel_run(threads, n_batches, [&](size_t b) {
    const size_t end = std::min(pieces.size(), (b + 1) * batch);
    for (size_t k = b * batch; k < end; ++k) {
      Piece& pc = pieces[k];
      pc.crc = crc32c_update(0, base + pc.offset, pc.len);
    }
  });

  // Pieces of one range are consecutive and in order: fold them left to right.
  size_t k = 0;
  while (k < pieces.size()) {
    const size_t r = pieces[k].range;
    uint32_t crc = pieces[k].crc;
    ++k;
    while (k < pieces.size() && pieces[k].range == r) {
      crc = crc32c_combine(crc, pieces[k].crc, pieces[k].len);
      ++k;
    }
    out[r] = static_cast<int64_t>(crc);
  }
  return out;
}

}  // namespace nebula
