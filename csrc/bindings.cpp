// Python bindings of nebula_ckpt._C. The only file that includes pybind11 /
// torch/extension.h; everything else is plain C++ on ATen.
#include <torch/extension.h>

#include "buffer_pool.h"
#include "checksum.h"
#include "copy_engine.h"
#include "file_io.h"

namespace py = pybind11;
using namespace nebula;

namespace {

#ifdef NEBULA_WITH_CUDA
constexpr bool kWithCuda = true;
#else
constexpr bool kWithCuda = false;
#endif

// Destroying an engine joins its threads after draining queued copies; those
// may need the GIL to drop their last tensor references, so never block on
// them while holding it.
struct EngineDeleter {
  void operator()(CopyEngine* e) const {
    if (PyGILState_Check()) {
      py::gil_scoped_release no_gil;
      delete e;
    } else {
      delete e;
    }
  }
};

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
    py::gil_scoped_release no_gil;
    crc = crc32c_update(static_cast<uint32_t>(value), p, n);
  }
  return static_cast<int64_t>(crc);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Native helpers of nebula_ckpt: host buffers, copy engine, CRC32C, parallel file I/O.";

  m.def(
      "build_info",
      [] {
        py::dict d;
        d["version"] = "0.1.0";
        d["cuda"] = kWithCuda;
        d["crc32c_hw"] = crc32c_hw_available();
        d["o_direct"] = o_direct_supported();
        return d;
      },
      "Build/runtime capabilities of the extension.");

  m.def("alloc_host_buffer", &alloc_host_buffer, py::arg("nbytes"), py::arg("pinned") = false,
        py::arg("prefault_threads") = 1, py::call_guard<py::gil_scoped_release>(),
        "Page-aligned, pre-faulted 1-D uint8 CPU tensor of nbytes (optionally pinned).");

  py::class_<CopyJob, std::shared_ptr<CopyJob>>(m, "CopyJob",
                                                "Handle of one asynchronous CopyEngine.enqueue.")
      .def("wait", &CopyJob::wait, py::call_guard<py::gil_scoped_release>(),
           "Block until all copies finished; re-raise the first copy error.")
      .def("done", &CopyJob::done, "True when all copies finished.")
      .def("modified", &CopyJob::modified,
           "Indices of sources modified in place while being copied (after wait()).")
      .def("checksums", &CopyJob::checksums, py::call_guard<py::gil_scoped_release>(),
           "CRC32C of each source as copied (waits); empty when device sources were copied.")
      .def("seconds", &CopyJob::seconds, "Wall time from enqueue to the last copy finished.");

  py::class_<CopyEngine, std::unique_ptr<CopyEngine, EngineDeleter>>(
      m, "CopyEngine", "Persistent thread pool copying tensors into host staging buffers.")
      .def(py::init<int64_t>(), py::arg("num_threads"))
      .def("enqueue", &CopyEngine::enqueue, py::arg("srcs"), py::arg("dst"), py::arg("offsets"),
           py::call_guard<py::gil_scoped_release>(),
           "Copy each srcs[i]'s contiguous bytes to dst[offsets[i]:...] asynchronously.")
      .def_property_readonly("num_threads", &CopyEngine::num_threads);

  m.def("crc32c", &crc32c_ranges, py::arg("buf"), py::arg("offsets"), py::arg("lengths"),
        py::arg("num_threads"), py::call_guard<py::gil_scoped_release>(),
        "CRC32C of each byte range of a 1-D uint8 CPU tensor.");

  m.def("crc32c_bytes", &crc32c_bytes, py::arg("data"), py::arg("value") = 0,
        "CRC32C of a bytes-like object, continuing from value.");

  m.def("write_file", &write_file, py::arg("path"), py::arg("buf"), py::arg("offset"),
        py::arg("nbytes"), py::arg("direct"), py::arg("num_threads"), py::arg("chunk_bytes"),
        py::arg("do_fsync"), py::call_guard<py::gil_scoped_release>(),
        "Write buf[offset:offset+nbytes] to a new file with parallel pwrite; True if O_DIRECT "
        "was used.");

  m.def("read_file", &read_file, py::arg("path"), py::arg("buf"), py::arg("offset"),
        py::arg("nbytes"), py::arg("num_threads"), py::call_guard<py::gil_scoped_release>(),
        "Read the first nbytes of a file into buf[offset:offset+nbytes] with parallel pread.");
}
