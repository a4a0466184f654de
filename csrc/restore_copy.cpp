#include "restore_copy.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>

#include "copy_engine.h"
#include "thread_pool.h"

namespace nebula {

namespace {

// Ranges are cut into pieces of at most this many bytes (a large tensor spread over every
// thread), small ones packed into tasks of about this size (the hand-out amortised).
constexpr size_t kPieceBytes = size_t{4} << 20;
// Below this many bytes in all, one thread: starting threads would cost more than the copy.
constexpr size_t kMinParallelBytes = size_t{1} << 20;

struct Piece {
  const uint8_t* from;
  uint8_t* to;
  size_t len;
};

}  // namespace

void copy_into(const at::Tensor& src, const std::vector<int64_t>& offsets,
               const std::vector<at::Tensor>& dsts, int64_t num_threads) {
  TORCH_CHECK(src.defined() && src.device().is_cpu() && src.scalar_type() == at::kByte &&
                  src.dim() == 1 && src.is_contiguous(),
              "copy_into: src must be a 1-D contiguous uint8 CPU tensor");
  TORCH_CHECK(storage_covers(src), "copy_into: src's storage does not hold its bytes");
  TORCH_CHECK(offsets.size() == dsts.size(), "copy_into: ", offsets.size(), " offsets for ",
              dsts.size(), " destinations");
  const int64_t n = src.numel();
  const auto* base = static_cast<const uint8_t*>(src.const_data_ptr());
  std::vector<Piece> pieces;
  size_t total = 0;
  for (size_t i = 0; i < dsts.size(); ++i) {
    const at::Tensor& d = dsts[i];
    TORCH_CHECK(d.defined() && d.device().is_cpu() && d.is_contiguous() && !d.is_conj() &&
                    !d.is_neg(),
                "copy_into: destination ", i, " must be a contiguous CPU tensor");
    TORCH_CHECK(storage_covers(d), "copy_into: destination ", i,
                "'s storage does not hold its bytes (resized or freed)");
    const int64_t nbytes = d.numel() * static_cast<int64_t>(d.element_size());
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] <= n && nbytes <= n - offsets[i], "copy_into: range ",
                i, " [", offsets[i], ", ", offsets[i], " + ", nbytes, ") is outside src of ", n,
                " bytes");
    if (nbytes == 0) continue;
    auto* to = static_cast<uint8_t*>(d.data_ptr());
    const uint8_t* from = base + offsets[i];
    const auto lo = reinterpret_cast<uintptr_t>(to), at = reinterpret_cast<uintptr_t>(from);
    TORCH_CHECK(lo + nbytes <= at || at + nbytes <= lo, "copy_into: destination ", i,
                " overlaps its source bytes");
    for (size_t pos = 0; pos < static_cast<size_t>(nbytes); pos += kPieceBytes) {
      pieces.push_back(
          {from + pos, to + pos, std::min(kPieceBytes, static_cast<size_t>(nbytes) - pos)});
    }
    total += static_cast<size_t>(nbytes);
  }
  // Pieces of small tensors packed into tasks of about kPieceBytes each.
  std::vector<size_t> starts{0};
  size_t acc = 0;
  for (size_t k = 0; k < pieces.size(); ++k) {
    if (acc > 0 && acc + pieces[k].len > kPieceBytes) {
      starts.push_back(k);
      acc = 0;
    }
    acc += pieces[k].len;
  }
  starts.push_back(pieces.size());
  const int threads = total < kMinParallelBytes ? 1 : clamp_threads(num_threads);
  parallel_run(threads, starts.size() - 1, [&](size_t t) {
    for (size_t k = starts[t]; k < starts[t + 1]; ++k) {
      std::memcpy(pieces[k].to, pieces[k].from, pieces[k].len);
    }
  });
  for (const at::Tensor& d : dsts) {
    if (d.numel() > 0 && !d.is_inference()) d.unsafeGetTensorImpl()->bump_version();
  }
}

}  // namespace nebula
