// Python bindings of nebula_ckpt._C. The only file that includes pybind11 /
// torch/extension.h; everything else is plain C++ on ATen.
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <pthread.h>

#include <chrono>
#include <thread>

#include "buffer_pool.h"
#include "checksum.h"
#include "copy_engine.h"
#include "file_io.h"
#include "plan_guard.h"
#include "restore_copy.h"
#ifdef NEBULA_WITH_CUDA
#include "cuda/copy_cuda.h"
#endif

// The package version, from nebula_ckpt/_version.py (setup.py passes it; there is no other copy).
#ifndef NEBULA_VERSION
#error "NEBULA_VERSION is not defined: build the extension through setup.py"
#endif

namespace py = pybind11;
using namespace nebula;

namespace nebula {

// plan_guard.cpp reaches torch's Python tensors through these two.
bool py_is_tensor(PyObject* obj) { return THPVariable_Check(obj); }
const at::Tensor& py_unpack_tensor(PyObject* obj) { return THPVariable_Unpack(obj); }

}  // namespace nebula

namespace {

#ifdef NEBULA_WITH_CUDA
constexpr bool kWithCuda = true;
#else
constexpr bool kWithCuda = false;
#endif

// ---------------------------------------------------------------------------
// Interpreter shutdown.
//
// A daemon thread (a stager or a tier writer) may be inside one of our
// blocking calls when the main thread returns and Python starts finalizing.
// When the call ends, pybind11's gil_scoped_release re-takes the GIL in a
// noexcept destructor; CPython answers a non-main thread that asks for the
// GIL during finalization with pthread_exit, whose forced unwind cannot pass
// a noexcept frame, so the process died in std::terminate ("terminate called
// without an active exception", exit 134). GilRelease parks such a thread
// instead, as CPython 3.14 does itself: the process is exiting and nothing
// waits for the thread. Its destructor is noexcept(false) so that a thread
// losing the race (finalization starts between the check and the
// re-acquire) unwinds out through pybind11 like a pure-Python thread would.

// threading.main_thread().ident: set at import; in a forked child, the
// forking thread (which Python makes the child's main thread).
unsigned long g_main_thread = 0;

void reset_main_thread_after_fork() { g_main_thread = PyThread_get_thread_ident(); }

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// Release the GIL for a blocking call (py::call_guard<GilRelease>, or a local).
class GilRelease {
 public:
  GilRelease() : state_(PyEval_SaveThread()) {}
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;
  ~GilRelease() noexcept(false) {
    // The finalizing thread is the main thread (it may run our calls from
    // finalizers, e.g. an engine or a job being freed): it takes the GIL back.
    if (interpreter_finalizing() && PyThread_get_thread_ident() != g_main_thread) {
      for (;;) std::this_thread::sleep_for(std::chrono::hours(24));
    }
    PyEval_RestoreThread(state_);
  }

 private:
  PyThreadState* state_;
};

// Destroying an engine joins its threads after draining queued copies; never
// block on them while holding the GIL.
struct EngineDeleter {
  void operator()(CopyEngine* e) const {
    if (PyGILState_Check()) {
      GilRelease no_gil;
      delete e;
    } else {
      delete e;
    }
  }
};

// Destroying a job waits for its copies still running, without the GIL, and
// then drops its tensor references with the GIL held: they may be the last
// ones of tensors whose Python objects died meanwhile.
struct JobDeleter {
  void operator()(CopyJob* j) const {
    if (!j->done() && PyGILState_Check()) {
      GilRelease no_gil;
      j->drain();
    }
    delete j;
  }
};

// IoError -> OSError(errno, reason, path); Python picks the subclass
// (FileNotFoundError, PermissionError, ...) from errno.
void translate_io_error(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const IoError& e) {
    py::object path = py::reinterpret_steal<py::object>(
        PyUnicode_DecodeFSDefaultAndSize(e.path().data(), static_cast<Py_ssize_t>(e.path().size())));
    if (!path) throw py::error_already_set();
    py::object exc = py::reinterpret_borrow<py::object>(PyExc_OSError)(e.err(), e.reason(), path);
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  }
}

// RAII wrapper of a contiguous read-only Py_buffer.
struct BufferView {
  Py_buffer view{};
  explicit BufferView(py::handle obj) {
    if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_SIMPLE) != 0) throw py::error_already_set();
  }
  ~BufferView() { PyBuffer_Release(&view); }
  BufferView(const BufferView&) = delete;
  BufferView& operator=(const BufferView&) = delete;
};

int64_t crc32c_bytes(py::handle data, int64_t value) {
  TORCH_CHECK(value >= 0 && value <= 0xFFFFFFFFLL,
              "crc32c_bytes: value must be in [0, 2**32), got ", value);
  BufferView buf(data);  // needs the GIL
  const void* p = buf.view.buf;
  const size_t n = static_cast<size_t>(buf.view.len);
  uint32_t crc;
  {
    // The exporter cannot release the memory while we hold the view.
    GilRelease no_gil;
    crc = crc32c_update(static_cast<uint32_t>(value), p, n);
  }
  return static_cast<int64_t>(crc);
}

std::shared_ptr<CopyJob> make_job(std::unique_ptr<CopyJob> job) {
  return std::shared_ptr<CopyJob>(job.release(), JobDeleter{});
}

// PlanGuard.check: None on a miss, else (SourceSet, [(leaf index, value), ...]).
py::object guard_check(PlanGuard& g, py::handle root) {
  std::unique_ptr<SourceSet> sources;
  std::vector<DirtyLeaf> dirty;
  bool hit;
  try {
    hit = g.check(root.ptr(), &sources, &dirty);
  } catch (const PlanGuard::py_error_pending&) {
    throw py::error_already_set();
  }
  if (!hit) return py::none();
  py::list changed(dirty.size());
  for (size_t i = 0; i < dirty.size(); ++i) {
    changed[i] = py::make_tuple(dirty[i].first, py::reinterpret_steal<py::object>(dirty[i].second));
    dirty[i].second = nullptr;
  }
  return py::make_tuple(py::cast(std::shared_ptr<SourceSet>(std::move(sources))), changed);
}

void guard_commit(PlanGuard& g, py::list leaves) {
  std::vector<std::pair<int64_t, PyObject*>> v;
  v.reserve(leaves.size());
  for (py::handle item : leaves) {
    auto pair = item.cast<py::tuple>();
    TORCH_CHECK(pair.size() == 2, "PlanGuard.commit: (index, value) pairs expected");
    v.emplace_back(pair[0].cast<int64_t>(), pair[1].ptr());
  }
  g.commit(v);  // borrowed: `leaves` holds them through the call
}

size_t set_index(const SourceSet& s, int64_t i) {
  TORCH_CHECK(i >= 0 && static_cast<size_t>(i) < s.size(), "SourceSet: index ", i, " out of range (",
              s.size(), ")");
  return static_cast<size_t>(i);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Native helpers of nebula_ckpt: host buffers, copy engine, CRC32C, parallel file I/O.";
  g_main_thread = py::module_::import("threading")
                      .attr("main_thread")()
                      .attr("ident")
                      .cast<unsigned long>();
  pthread_atfork(nullptr, nullptr, &reset_main_thread_after_fork);
  py::register_exception_translator(&translate_io_error);

  m.def(
      "build_info",
      [] {
        py::dict d;
        d["version"] = NEBULA_VERSION;
        d["cuda"] = kWithCuda;
        d["crc32c_hw"] = crc32c_hw_available();
        d["o_direct"] = o_direct_supported();
        return d;
      },
      "Build/runtime capabilities of the extension.");

  m.def(
      "cuda_warm_up",
      [](int64_t device) {
#ifdef NEBULA_WITH_CUDA
        cuda::warm_up(static_cast<c10::DeviceIndex>(device));
#else
        TORCH_CHECK(false, "cuda_warm_up: nebula_ckpt._C was built without CUDA support");
#endif
      },
      py::arg("device"), py::call_guard<GilRelease>(),
      "Set up the device-to-host copy path on `device` once (side stream, events, host function, "
      "a page-locked copy), so that the first snapshot of the process does not.");

  m.def("alloc_host_buffer", &alloc_host_buffer, py::arg("nbytes"), py::arg("pinned") = false,
        py::arg("prefault_threads") = 1, py::arg("huge_pages") = false, py::call_guard<GilRelease>(),
        "Page-aligned, pre-faulted 1-D uint8 CPU tensor of nbytes (optionally pinned; huge_pages: "
        "advise transparent huge pages).");

  py::class_<CopyJob, std::shared_ptr<CopyJob>>(m, "CopyJob",
                                                "Handle of one asynchronous CopyEngine.enqueue.")
      .def("wait", &CopyJob::wait, py::call_guard<GilRelease>(),
           "Block until all copies finished; re-raise the first copy error.")
      .def("done", &CopyJob::done, "True when all copies finished.")
      .def("modified", &CopyJob::modified,
           "Indices of sources written while being copied: version counter bumped, or bytes "
           "changed under the copy (after wait()).")
      .def("checksums", &CopyJob::checksums, py::call_guard<GilRelease>(),
           "CRC32C of the bytes staged for each source (waits); empty when device sources were "
           "copied.")
      .def("seconds", &CopyJob::seconds, "Wall time from enqueue to the last copy finished.");

  py::class_<SourceSet, std::shared_ptr<SourceSet>>(
      m, "SourceSet", "The tensors one save copies, in layout order, with their shard offsets.")
      .def(py::init([](const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets) {
             return std::make_shared<SourceSet>(
                 tensors, std::make_shared<const std::vector<int64_t>>(offsets));
           }),
           py::arg("tensors"), py::arg("offsets"))
      .def("__len__", &SourceSet::size)
      .def("__getitem__", [](const SourceSet& s, int64_t i) { return s.get(set_index(s, i)); })
      .def("__setitem__",
           [](SourceSet& s, int64_t i, const at::Tensor& t) { s.set(set_index(s, i), t); },
           "Replace tensor i (recording its version counter now).")
      .def("any_cuda", &SourceSet::any_cuda, "Whether any tensor is on a CUDA device.")
      .def("changed", &SourceSet::changed,
           "Indices whose version counter differs from the one recorded.")
      .def("clear", &SourceSet::clear, "Drop every tensor reference.")
      .def("tensors", &SourceSet::tensors, "The tensors, as a list.")
      .def("offsets", &SourceSet::offsets, "The shard offset of each tensor's bytes.");

  py::class_<PlanGuard>(m, "PlanGuard",
                        "A save plan's structure, compiled: checks a later state against it.")
      .def(py::init([](py::tuple program, py::tuple slot_layout, py::tuple alias_of, py::tuple offsets,
                       py::dict stock, py::object ndarray_type, py::object ndarray_copy) {
             return std::make_unique<PlanGuard>(program.ptr(), slot_layout.ptr(), alias_of.ptr(),
                                                offsets.ptr(), stock.ptr(), ndarray_type.ptr(),
                                                ndarray_copy.ptr());
           }),
           py::arg("program"), py::arg("slot_layout"), py::arg("alias_of"), py::arg("offsets"),
           py::arg("stock"), py::arg("ndarray_type"), py::arg("ndarray_copy"))
      .def("check", &guard_check, py::arg("state"),
           "None when the state's structure differs; else (SourceSet, [(leaf, new value), ...]).")
      .def("commit", &guard_commit, py::arg("leaves"),
           "Compare later states with these (leaf, value) pairs.")
      .def_property_readonly("miss_reason", &PlanGuard::miss_reason)
      .def_property_readonly("num_slots", &PlanGuard::num_slots)
      .def_property_readonly("num_leaves", &PlanGuard::num_leaves);

  py::class_<CopyEngine, std::unique_ptr<CopyEngine, EngineDeleter>>(
      m, "CopyEngine", "Persistent thread pool copying tensors into host staging buffers.")
      .def(py::init<int64_t>(), py::arg("num_threads"))
      .def(
          "enqueue",
          [](CopyEngine& e, const std::vector<at::Tensor>& srcs, const at::Tensor& dst,
             const std::vector<int64_t>& offsets, bool checksum) {
            return std::shared_ptr<CopyJob>(e.enqueue(srcs, dst, offsets, checksum).release(),
                                            JobDeleter{});
          },
          py::arg("srcs"), py::arg("dst"), py::arg("offsets"), py::arg("checksum") = true,
          py::call_guard<GilRelease>(),
          "Copy each srcs[i]'s contiguous bytes to dst[offsets[i]:...] asynchronously "
          "(checksum=False: plain copies, checksums() empty).")
      .def(
          "enqueue_set",
          [](CopyEngine& e, const SourceSet& s, const at::Tensor& dst, bool checksum) {
            return make_job(s.enqueue(e, dst, checksum));
          },
          py::arg("sources"), py::arg("dst"), py::arg("checksum") = true, py::call_guard<GilRelease>(),
          "enqueue() of a SourceSet's tensors at its offsets.")
      .def("close", &CopyEngine::close, py::call_guard<GilRelease>(),
           "Finish queued copies and join the threads now (idempotent); enqueue fails after.")
      .def_property_readonly("num_threads", &CopyEngine::num_threads);

  m.def("crc32c", &crc32c_ranges, py::arg("buf"), py::arg("offsets"), py::arg("lengths"),
        py::arg("num_threads"), py::call_guard<GilRelease>(),
        "CRC32C of each byte range of a 1-D uint8 CPU tensor.");

  m.def("copy_into", &copy_into, py::arg("src"), py::arg("offsets"), py::arg("dsts"),
        py::arg("num_threads"), py::call_guard<GilRelease>(),
        "Copy src[offsets[i]:...] into the memory of each contiguous CPU tensor dsts[i] on native "
        "threads (its version counter bumped).");

  m.def("crc32c_bytes", &crc32c_bytes, py::arg("data"), py::arg("value") = 0,
        "CRC32C of a bytes-like object, continuing from value.");

  m.def("write_file", &write_file, py::arg("path"), py::arg("buf"), py::arg("offset"),
        py::arg("nbytes"), py::arg("direct"), py::arg("num_threads"), py::arg("chunk_bytes"),
        py::arg("do_fsync"), py::call_guard<GilRelease>(),
        "Write buf[offset:offset+nbytes] to a new file with parallel pwrite; True if O_DIRECT "
        "was used.");

  m.def("read_file", &read_file, py::arg("path"), py::arg("buf"), py::arg("offset"),
        py::arg("nbytes"), py::arg("num_threads"), py::call_guard<GilRelease>(),
        "Read the first nbytes of a file into buf[offset:offset+nbytes] with parallel pread.");
}
