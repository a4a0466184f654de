#include "copy_engine.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include <ATen/Functions.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <c10/util/ParallelGuard.h>

// Declarations only (no CUDA toolkit headers); the definitions exist only in
// the CUDA build and are only referenced under NEBULA_WITH_CUDA.
#include "cuda/copy_cuda.h"
#include "checksum.h"

namespace nebula {

using Clock = std::chrono::steady_clock;

namespace {

// Contiguous sources are cut into pieces of at most this many bytes so one
// large tensor is spread over all threads; small tensors are packed together
// into tasks of about this size so the per-task overhead stays negligible.
constexpr size_t kMaxChunk = size_t{4} << 20;
constexpr size_t kMinChunk = size_t{256} << 10;

// A source can be memcpy'd when its memory already is its contiguous byte
// image. Conjugate/negative views are lazily evaluated bits on a tensor whose
// memory holds the *unconjugated* values, so they take the copy_ path, which
// materialises them.
bool is_plain_contiguous(const at::Tensor& t) {
  return t.is_contiguous() && !t.is_conj() && !t.is_neg();
}

struct Piece {
  uint32_t src;        // index into srcs
  bool strided;        // false: memcpy(to, from, len); true: copy_ of srcs[src]
  const uint8_t* from;
  uint8_t* to;
  size_t len;
  uint32_t id;         // index into JobState::piece_crc (pieces of a source are consecutive)
};

// Pieces at least this long are written with streaming stores: the staging
// buffer is not read again by this thread, and streaming stores skip the
// read-for-ownership of every destination line.
constexpr size_t kStreamMin = size_t{256} << 10;
// A piece is copied in blocks of this size; each block is hashed once from
// the source (which pulls it into L2) and then copied from L2 by
// crc32c_copy, whose checksum is that of the bytes stored.
constexpr size_t kFuseBlock = size_t{64} << 10;

// Copy `len` bytes and return the CRC32C of the bytes staged. Sets `*torn`
// when the source changed while it was copied: a writer that bypasses the
// version counter (`t.data.fill_()`, a numpy view, another process) made the
// hash of a block before its copy differ from the hash of what was copied.
// The returned checksum is always that of `to` (crc32c_copy hashes the same
// registers it stores), so a torn copy can be refused but never recorded
// with a checksum that its bytes do not match.
uint32_t copy_crc(uint8_t* to, const uint8_t* from, size_t len, bool* torn) {
  const bool stream = len >= kStreamMin;
  uint32_t crc = 0;
  for (size_t pos = 0; pos < len; pos += kFuseBlock) {
    const size_t n = std::min(kFuseBlock, len - pos);
    const uint32_t before = crc32c_update(crc, from + pos, n);
    crc = crc32c_copy(crc, to + pos, from + pos, n, stream);
    if (crc != before) *torn = true;
  }
  return crc;
}

}  // namespace

bool storage_covers(const at::Tensor& t) {
  if (t.numel() == 0) return true;
  if (!t.has_storage()) return false;
  int64_t last = t.storage_offset();
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  for (size_t d = 0; d < sizes.size(); ++d) last += (sizes[d] - 1) * strides[d];
  const auto need = static_cast<uint64_t>(last + 1) * t.itemsize();
  return last >= 0 && t.unsafeGetTensorImpl()->unsafe_storage().nbytes() >= need;
}

int64_t version_of(const at::Tensor& t) {
  if (t.is_inference()) return -1;
  return static_cast<int64_t>(t.unsafeGetTensorImpl()->version_counter().current_version());
}

Source read_source(const at::Tensor& s) {
  Source r;
  r.nbytes = s.nbytes();
  r.from = r.nbytes > 0 ? static_cast<const uint8_t*>(s.const_data_ptr()) : nullptr;
  r.version = version_of(s);
  r.plain = is_plain_contiguous(s);
  r.cuda = s.device().is_cuda();
  return r;
}

Source checked_source(const at::Tensor& s, size_t i) {
  TORCH_CHECK(s.defined(), "enqueue: srcs[", i, "] is undefined");
  // Checked first: the other queries below would dispatch back into Python.
  TORCH_CHECK(!s.unsafeGetTensorImpl()->is_python_dispatch(), "enqueue: srcs[", i,
              "] is a tensor subclass with __torch_dispatch__ (e.g. DTensor); pass its local "
              "tensor instead");
  const c10::Device dev = s.device();
  TORCH_CHECK(dev.is_cpu() || dev.is_cuda(), "enqueue: srcs[", i, "] is on ", dev,
              "; only CPU/CUDA tensors can be snapshotted");
#ifndef NEBULA_WITH_CUDA
  TORCH_CHECK(!dev.is_cuda(), "enqueue: srcs[", i, "] is on ", dev,
              " but nebula_ckpt._C was built without CUDA support");
#endif
  TORCH_CHECK(s.layout() == at::kStrided && !s.is_nested(), "enqueue: srcs[", i,
              "] has layout ", s.layout(), "; only dense strided tensors can be snapshotted");
  TORCH_CHECK(!s.is_quantized() || is_plain_contiguous(s), "enqueue: srcs[", i,
              "] is a non-contiguous quantized tensor; call .contiguous() first");
  TORCH_CHECK(s.numel() == 0 || s.has_storage(), "enqueue: srcs[", i, "] has no storage");
  TORCH_CHECK(storage_covers(s), "enqueue: srcs[", i, "] reaches past the end of its storage (",
              s.storage().nbytes(), " bytes; resized under it?): save a tensor that holds its data");
  return read_source(s);
}

struct JobState {
  // Held so sources and destination outlive the copies. Only the CopyJob
  // (a Python object) releases them, after every task finished: a pool
  // thread must never drop the last reference of a tensor, which may own its
  // PyObject and so need the GIL (unavailable once the interpreter shuts down).
  std::shared_ptr<const std::vector<at::Tensor>> srcs;
  at::Tensor dst;
  std::vector<int64_t> versions;                        // -1: not tracked
  std::unique_ptr<std::atomic<int64_t>[]> pieces_left;  // per source
  std::unique_ptr<std::atomic<bool>[]> torn;            // per source: bytes changed under the copy
  std::vector<uint32_t> piece_crc;                      // CRC32C of each piece's bytes
  std::vector<uint64_t> piece_len;
  std::vector<int64_t> first_piece;                     // per source; -1: nothing copied on CPU
  std::vector<int64_t> n_pieces;                        // per source
  Clock::time_point start;
  bool checksum = true;  // false: plain memcpy, the caller hashes the staged bytes

  // The tasks of the job (pieces each), claimed in order by whoever comes first: a pool thread,
  // or the thread waiting for the job (CopyJob::wait), which copies instead of sleeping.
  std::vector<std::vector<Piece>> tasks;
  std::atomic<size_t> next_task{0};

  std::mutex mu;
  std::condition_variable cv;
  size_t pending = 0;  // tasks not finished yet
  Clock::time_point end;
  bool failed = false;
  std::string error;
  std::vector<int64_t> modified;

  void record_error(const std::string& msg) {
    std::lock_guard<std::mutex> lk(mu);
    if (!failed) {
      failed = true;
      error = msg;
    }
  }

  // Called after every piece; the last piece of a source compares its
  // version counter with the one recorded at enqueue: a change means the
  // tensor was written in place while we were copying it, so the bytes may
  // be torn. So does a block whose bytes changed under its copy.
  //
  // A source copied as one piece is done when that piece is: there is no count to share between
  // threads. (A locked decrement after each small memcpy waits until the copy's stores have
  // drained: in a tight loop it was a third of the time of copying 1,000 tensors of 1 KB.)
  void piece_done(uint32_t i) {
    if (n_pieces[i] > 1 && pieces_left[i].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    if (torn[i].load(std::memory_order_relaxed) ||
        (versions[i] >= 0 && version_of((*srcs)[i]) != versions[i])) {
      std::lock_guard<std::mutex> lk(mu);
      modified.push_back(static_cast<int64_t>(i));
    }
  }

  void task_done() {
    std::lock_guard<std::mutex> lk(mu);
    TORCH_INTERNAL_ASSERT(pending > 0);
    if (--pending == 0) {
      end = Clock::now();
      cv.notify_all();
    }
  }

  // Run the next unclaimed task; false when every task was claimed.
  bool run_next() {
    const size_t i = next_task.fetch_add(1, std::memory_order_relaxed);
    if (i >= tasks.size()) return false;
    run(tasks[i]);
    return true;
  }

  void run(const std::vector<Piece>& pieces) {
    bool skip;
    {
      std::lock_guard<std::mutex> lk(mu);
      skip = failed;  // no point copying after the job has failed
    }
    if (!skip) {
      try {
        for (const Piece& p : pieces) {
          if (!p.strided && !checksum) {
            std::memcpy(p.to, p.from, p.len);
          } else if (!p.strided) {
            bool changed = false;
            piece_crc[p.id] = copy_crc(p.to, p.from, p.len, &changed);
            if (changed) torn[p.src].store(true, std::memory_order_relaxed);
          } else {
            const at::Tensor& src = (*srcs)[p.src];
            // No autograd graph for a snapshot; and run copy_ serially on
            // this pool thread instead of fanning out into ATen's intra-op
            // pool, which the training thread is using.
            at::NoGradGuard no_grad;
            c10::ParallelGuard serial(true);
            // ATen has no copy kernel for the sub-byte shell dtypes (int1..7, uint1..7): a
            // 1-byte source is copied as its bytes (a same-size view, whatever its strides),
            // which is the same image for every 1-byte dtype. A neg view cannot be viewed so.
            const bool as_bytes = src.element_size() == 1 && !src.is_neg() && !src.is_conj();
            const at::Tensor from = as_bytes ? src.view(at::kByte) : src;
            at::Tensor out = at::from_blob(
                p.to, src.sizes(), at::TensorOptions().dtype(from.scalar_type()).device(at::kCPU));
            out.copy_(from);
            // Hash the staged bytes, so the checksum matches them whatever
            // happened to the source meanwhile (a torn strided copy is only
            // caught by the version counter).
            if (checksum) piece_crc[p.id] = crc32c_update(0, p.to, p.len);
          }
          piece_done(p.src);
        }
      } catch (const c10::Error& e) {
        record_error(e.what_without_backtrace());
      } catch (const std::exception& e) {
        record_error(e.what());
      } catch (...) {
        record_error("unknown error");
      }
    }
    task_done();
  }
};

// ---------------------------------------------------------------------------

CopyJob::CopyJob(std::shared_ptr<JobState> state, std::unique_ptr<cuda::CudaCopyBatch> cuda)
    : state_(std::move(state)), cuda_(std::move(cuda)) {}

CopyJob::~CopyJob() {
  // The tasks reference the tensors (and write into dst) until they finish;
  // then only this thread holds them, and releases them here.
  drain();
  cuda_.reset();  // waits for in-flight device copies
  state_->srcs.reset();
  state_->dst = at::Tensor();
}

void CopyJob::wait_tasks() {
  // The waiting thread copies the tasks no pool thread took yet: a small job is done by it alone
  // (no hand-over, no wake-up), a large one with the pool's threads.
  while (state_->run_next()) {
  }
  std::unique_lock<std::mutex> lk(state_->mu);
  state_->cv.wait(lk, [&] { return state_->pending == 0; });
}

void CopyJob::drain() noexcept {
  wait_tasks();
  if (cuda_) {
    try {
      cuda_->synchronize();
    } catch (...) {
      // The error was (or will be) reported by wait(); here we only wait.
    }
  }
}

void CopyJob::wait() {
  wait_tasks();
  if (cuda_) cuda_->synchronize();
  std::lock_guard<std::mutex> lk(state_->mu);
  TORCH_CHECK(!state_->failed, "CopyEngine: copy failed: ", state_->error);
}

bool CopyJob::done() {
  {
    std::lock_guard<std::mutex> lk(state_->mu);
    if (state_->pending != 0) return false;
  }
  return !cuda_ || cuda_->query();
}

std::vector<int64_t> CopyJob::modified() {
  std::vector<int64_t> out;
  {
    std::lock_guard<std::mutex> lk(state_->mu);
    out = state_->modified;
  }
  if (cuda_ && cuda_->query()) {
    for (size_t i : cuda_->modified()) out.push_back(static_cast<int64_t>(i));
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<int64_t> CopyJob::checksums() {
  wait();
  std::vector<int64_t> out;
  // Device copies, and copies without checksums, are not hashed here: the caller hashes the buffer.
  if (cuda_ || !state_->checksum) return out;
  out.reserve(state_->first_piece.size());
  for (size_t i = 0; i < state_->first_piece.size(); ++i) {
    uint32_t crc = 0;
    const int64_t first = state_->first_piece[i];
    for (int64_t j = first; first >= 0 && j < first + state_->n_pieces[i]; ++j) {
      crc = crc32c_combine(crc, state_->piece_crc[j], state_->piece_len[j]);
    }
    out.push_back(static_cast<int64_t>(crc));
  }
  return out;
}

double CopyJob::seconds() {
  if (!done()) {
    return std::chrono::duration<double>(Clock::now() - state_->start).count();
  }
  Clock::time_point end;
  {
    std::lock_guard<std::mutex> lk(state_->mu);
    end = state_->end;
  }
  if (cuda_) end = std::max(end, cuda_->finish_time());
  return std::chrono::duration<double>(end - state_->start).count();
}

// ---------------------------------------------------------------------------

CopyEngine::CopyEngine(int64_t num_threads) {
  TORCH_CHECK(num_threads >= 1, "CopyEngine: num_threads must be >= 1, got ", num_threads);
  pool_ = std::make_unique<ThreadPool>(clamp_threads(num_threads));
}

CopyEngine::~CopyEngine() = default;

void CopyEngine::close() {
  std::lock_guard<std::mutex> lk(mu_);
  pool_.reset();  // drains queued tasks, joins the threads
}

std::unique_ptr<CopyJob> CopyEngine::enqueue(const std::vector<at::Tensor>& srcs,
                                             const at::Tensor& dst,
                                             const std::vector<int64_t>& offsets, bool checksum) {
  TORCH_CHECK(srcs.size() == offsets.size(), "enqueue: got ", srcs.size(), " srcs but ",
              offsets.size(), " offsets");
  std::vector<Source> meta;
  meta.reserve(srcs.size());
  for (size_t i = 0; i < srcs.size(); ++i) meta.push_back(checked_source(srcs[i], i));
  return enqueue_read(std::make_shared<const std::vector<at::Tensor>>(srcs), meta, dst, offsets,
                      checksum);
}

std::unique_ptr<CopyJob> CopyEngine::enqueue_read(
    std::shared_ptr<const std::vector<at::Tensor>> srcs_ptr, const std::vector<Source>& meta,
    const at::Tensor& dst, const std::vector<int64_t>& offsets, bool checksum) {
  // ---- validate everything before anything is queued ----
  TORCH_CHECK(srcs_ptr, "enqueue: no sources");
  const std::vector<at::Tensor>& srcs = *srcs_ptr;
  TORCH_CHECK(srcs.size() == offsets.size() && meta.size() == srcs.size(), "enqueue: got ",
              srcs.size(), " srcs but ", offsets.size(), " offsets");
  TORCH_CHECK(srcs.size() < (size_t{1} << 31), "enqueue: too many srcs (", srcs.size(), ")");
  TORCH_CHECK(dst.defined(), "enqueue: dst is undefined");
  TORCH_CHECK(dst.device().is_cpu(), "enqueue: dst must be a CPU tensor, got ", dst.device());
  TORCH_CHECK(dst.scalar_type() == at::kByte, "enqueue: dst must be uint8, got ",
              dst.scalar_type());
  TORCH_CHECK(dst.dim() == 1 && dst.is_contiguous(),
              "enqueue: dst must be a 1-D contiguous tensor, got shape ", dst.sizes());
  const int64_t dst_n = dst.numel();

  bool any_cuda = false;
  size_t cpu_bytes = 0;
  for (size_t i = 0; i < srcs.size(); ++i) {
    const auto nb = static_cast<int64_t>(meta[i].nbytes);
    const int64_t off = offsets[i];
    TORCH_CHECK(off >= 0 && off <= dst_n && nb <= dst_n - off, "enqueue: srcs[", i,
                "] needs dst bytes [", off, ", ", off, " + ", nb, ") but dst has ", dst_n,
                " bytes");
    any_cuda = any_cuda || meta[i].cuda;
    if (!meta[i].cuda) cpu_bytes += meta[i].nbytes;
  }

  // ---- build the job ----
  auto st = std::make_shared<JobState>();
  st->start = Clock::now();
  st->checksum = checksum;
  st->srcs = std::move(srcs_ptr);
  st->dst = dst;
  st->versions.resize(srcs.size(), -1);
  st->pieces_left.reset(new std::atomic<int64_t>[srcs.size()]);
  st->torn.reset(new std::atomic<bool>[srcs.size()]);
  st->first_piece.assign(srcs.size(), -1);
  st->n_pieces.assign(srcs.size(), 0);
  auto* dst_base = static_cast<uint8_t*>(dst.data_ptr());

  std::unique_ptr<cuda::CudaCopyBatch> cuda_batch;
#ifdef NEBULA_WITH_CUDA
  if (any_cuda) cuda_batch = cuda::make_copy_batch();
#else
  (void)any_cuda;
#endif

  for (size_t i = 0; i < srcs.size(); ++i) {
    st->versions[i] = meta[i].version;
    st->pieces_left[i].store(0, std::memory_order_relaxed);
    st->torn[i].store(false, std::memory_order_relaxed);
  }
  std::lock_guard<std::mutex> engine_lock(mu_);
  TORCH_CHECK(pool_, "enqueue: this CopyEngine was closed");
  const int threads = pool_->size();
  // Enough chunks that every thread gets several, but not tiny ones.
  const size_t chunk =
      std::clamp<size_t>(cpu_bytes / (static_cast<size_t>(threads) * 4), kMinChunk, kMaxChunk);

  std::vector<std::vector<Piece>> tasks;
  std::vector<Piece> current;
  size_t current_bytes = 0;
  auto add_piece = [&](Piece p) {
    p.id = static_cast<uint32_t>(st->piece_len.size());
    if (st->first_piece[p.src] < 0) st->first_piece[p.src] = p.id;
    st->n_pieces[p.src] += 1;
    st->piece_len.push_back(p.len);
    current.push_back(p);
  };
  auto flush = [&] {
    if (!current.empty()) {
      tasks.push_back(std::move(current));
      current.clear();
      current_bytes = 0;
    }
  };

  for (size_t i = 0; i < srcs.size(); ++i) {
    const Source& m = meta[i];
    const size_t nb = m.nbytes;
    if (nb == 0) continue;  // nothing to copy, nothing to tear
    uint8_t* to = dst_base + offsets[i];
    const auto idx = static_cast<uint32_t>(i);
    if (m.cuda) {
#ifdef NEBULA_WITH_CUDA
      cuda_batch->add(i, srcs[i], to, st->versions[i]);
#endif
      continue;
    }
    if (m.plain) {
      const uint8_t* from = m.from;
      size_t n_pieces = 0;
      for (size_t pos = 0; pos < nb; pos += chunk) ++n_pieces;
      st->pieces_left[i].store(static_cast<int64_t>(n_pieces), std::memory_order_relaxed);
      for (size_t pos = 0; pos < nb; pos += chunk) {
        const size_t len = std::min(chunk, nb - pos);
        add_piece({idx, false, from + pos, to + pos, len, 0});
        current_bytes += len;
        if (current_bytes >= chunk) flush();
      }
    } else {
      // Strided: one task per source (ATen's copy_ handles every layout of
      // strides; a 1-byte dtype is copied as bytes, see JobState::run).
      st->pieces_left[i].store(1, std::memory_order_relaxed);
      flush();
      add_piece({idx, true, nullptr, to, nb, 0});
      flush();
    }
  }
  flush();
  st->piece_crc.assign(st->piece_len.size(), 0);

#ifdef NEBULA_WITH_CUDA
  // Device copies first: if launching fails we throw before any CPU task
  // runs (the batch destructor waits for whatever was already launched).
  if (cuda_batch) cuda_batch->launch();
#endif

  st->pending = tasks.size();
  if (tasks.empty()) st->end = Clock::now();
  st->tasks = std::move(tasks);
  // A small host copy (one task, a few hundred KiB) is done here, on the calling thread (which
  // has released the GIL): handing it to a pool thread and waiting for it would cost more.
  if (st->tasks.size() == 1 && !cuda_batch && cpu_bytes <= kMinChunk) {
    auto job = std::make_unique<CopyJob>(st, std::move(cuda_batch));
    st->run_next();
    return job;
  }

  // One pool task per job task, each running whichever task is next unclaimed (the waiting
  // thread may have claimed it: then the pool task finds none and returns).
  std::vector<std::function<void()>> fns;
  fns.reserve(st->tasks.size());
  for (size_t i = 0; i < st->tasks.size(); ++i) {
    fns.emplace_back([st]() { st->run_next(); });
  }
  // Created before the tasks are queued: from here on the job owns the
  // tensors, and its destructor waits for the tasks.
  auto job = std::make_unique<CopyJob>(st, std::move(cuda_batch));
  try {
    pool_->submit_bulk(std::move(fns));
  } catch (...) {
    st->next_task.store(st->tasks.size());  // nothing was queued, and nothing is to run
    std::lock_guard<std::mutex> lk(st->mu);
    st->pending = 0;  // let the job's destructor return
    throw;
  }
  return job;
}

}  // namespace nebula
