// Copies of a restore's checked bytes into the tensors it refills (the direction opposite to a
// snapshot: one source buffer, many destinations).
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace nebula {

// Copy src[offsets[i], offsets[i] + the byte size of dsts[i]) into the memory of dsts[i], on up
// to num_threads native threads (ranges above a few MiB split into pieces, so one large tensor
// is spread over every thread; no OpenMP region, so no idle intra-op thread spins after it).
// `src` is a 1-D contiguous uint8 CPU tensor (a shard's bytes, possibly a file mapping: the
// threads take its page faults in parallel); each dsts[i] a contiguous CPU tensor of any dtype,
// written as its byte image, its version counter bumped as an in-place write would (inference
// tensors have none). Every argument is checked before any byte is written (c10::Error naming
// the index). Blocking; call without the GIL.
void copy_into(const at::Tensor& src, const std::vector<int64_t>& offsets,
               const std::vector<at::Tensor>& dsts, int64_t num_threads);

}  // namespace nebula
