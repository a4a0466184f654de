// The plan cache's check: is a state the one a cached plan was made for?
//
// A save's plan (which tensors go where in the shard, the typed tree of the
// rest) depends only on the state's structure: its containers and keys, the
// dtype / shape / strides / device / Python type of every tensor, which
// tensors are the same view of the same memory, and the non-tensor leaves.
// PlanGuard is compiled once from the walk that made a plan (nebula_ckpt/
// save/plan_record.py) and then checks a later state against it in one pass,
// in C++, at a cost of a few pointer and integer comparisons per tensor. On a
// hit it returns the live tensors in layout order (a SourceSet, read from the
// live objects every time: a replaced parameter's new storage is what gets
// copied) and the non-tensor leaves whose value changed (re-encoded by the
// caller); anything else that differs is a miss and the caller plans again.
//
// Modules and optimizers whose state_dict() is PyTorch's own (no override,
// no state-dict hooks) are checked through their internals (_parameters,
// _buffers, _modules; param_groups, state), so a hit never calls
// state_dict(); other objects with state_dict() are called and their result
// checked. On CPython 3.11 a module's registries that are the very dicts a
// passed check found, unchanged since (same address and version tag), are
// not read again: only their tensors are (plan_guard.cpp, Stamp).
//
// This file uses the CPython API and ATen only; torch's Python tensor objects
// are reached through py_is_tensor / py_unpack_tensor, defined in
// bindings.cpp. Every function here needs the GIL unless it says otherwise.
#pragma once

#include <Python.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "copy_engine.h"

namespace nebula {

// isinstance(obj, torch.Tensor) and the at::Tensor of such an object
// (bindings.cpp: the one file that includes torch's Python headers).
bool py_is_tensor(PyObject* obj);
const at::Tensor& py_unpack_tensor(PyObject* obj);

// The tensors one save copies, in layout order, each with the byte offset of
// its image in the shard and its version counter when the set was made. A set
// made by PlanGuard also holds what the copy needs of each tensor (Source),
// read while the guard checked it: the copy engine reads no tensor again.
class SourceSet {
 public:
  SourceSet(std::vector<at::Tensor> tensors, std::shared_ptr<const std::vector<int64_t>> offsets);
  // Tensors checked already, each described by sources[i] (PlanGuard).
  SourceSet(std::vector<at::Tensor> tensors, std::vector<Source> sources,
            std::shared_ptr<const std::vector<int64_t>> offsets);
  size_t size() const { return tensors_->size(); }
  const at::Tensor& get(size_t i) const;
  // Replace tensor i (a copy taken on the training thread); records its version.
  void set(size_t i, const at::Tensor& t);
  bool any_cuda() const;
  // Indices whose version counter differs from the one recorded.
  std::vector<int64_t> changed() const;
  // Drop every tensor reference.
  void clear();
  const std::vector<at::Tensor>& tensors() const { return *tensors_; }
  const std::vector<int64_t>& offsets() const { return *offsets_; }
  // Queue the copies of every tensor into dst (CopyEngine::enqueue, without reading the tensors
  // again when the set holds their Sources).
  std::unique_ptr<CopyJob> enqueue(CopyEngine& engine, const at::Tensor& dst, bool checksum) const;

 private:
  std::shared_ptr<std::vector<at::Tensor>> tensors_;  // shared with the copy jobs it enqueued
  std::vector<int64_t> versions_;  // -1: no version counter (inference tensors)
  std::vector<Source> sources_;    // empty: not read yet (the copy engine checks and reads them)
  std::shared_ptr<const std::vector<int64_t>> offsets_;
};

namespace guard {
struct Node;
struct Ctx;
struct Names;
}  // namespace guard

// A leaf whose value changed: (leaf index, new reference to the value).
using DirtyLeaf = std::pair<int64_t, PyObject*>;

class PlanGuard {
 public:
  // program: the nested tuples plan_record.py builds (see its docstring).
  // slot_layout[s]: the layout position of tensor slot s, or -1 for a tied key;
  // alias_of[s]: the slot tied key s shares its bytes with, or -1.
  // offsets[i]: the shard offset of layout position i. stock: the functions a
  // module / optimizer must resolve to be read through its internals
  // (dict: module_state_dict, module_save_to_state_dict,
  // module_get_extra_state, optimizer_state_dict). ndarray_type / ndarray_copy:
  // numpy.ndarray and the callable that copies one into a tensor, returning
  // (code, tensor) or None (both None when NumPy is not loaded).
  PlanGuard(PyObject* program, PyObject* slot_layout, PyObject* alias_of, PyObject* offsets,
            PyObject* stock, PyObject* ndarray_type, PyObject* ndarray_copy);
  ~PlanGuard();
  PlanGuard(const PlanGuard&) = delete;
  PlanGuard& operator=(const PlanGuard&) = delete;

  // Check `root` against the compiled structure. On a hit, returns true and
  // fills *sources and *dirty (new references: the caller releases them).
  // On a miss returns false (miss_reason() says why). Throws
  // py_error_pending when a BaseException that is not an Exception
  // (KeyboardInterrupt, SystemExit) came out of a state_dict() call: the
  // Python error stays set for the caller to raise.
  bool check(PyObject* root, std::unique_ptr<SourceSet>* sources, std::vector<DirtyLeaf>* dirty);
  // The changed leaves were re-encoded: compare later saves with these values.
  void commit(const std::vector<std::pair<int64_t, PyObject*>>& leaves);
  const std::string& miss_reason() const { return reason_; }
  int64_t num_slots() const { return static_cast<int64_t>(slot_layout_.size()); }
  int64_t num_leaves() const { return static_cast<int64_t>(leaves_.size()); }

  // Thrown by check() when a Python error must propagate as it is.
  struct py_error_pending {};

 private:
  bool check_aliases(guard::Ctx& c) const;

  std::unique_ptr<guard::Node> root_;
  std::unique_ptr<guard::Names> names_;
  std::vector<guard::Node*> leaves_;       // by leaf index
  std::vector<guard::Node*> tensor_nodes_;  // by slot (the first node of a slot)
  std::vector<int64_t> slot_layout_;
  std::vector<int64_t> alias_of_;
  std::shared_ptr<const std::vector<int64_t>> offsets_;
  // data pointers of the stored slots when compiled, sorted, with their slots:
  // a slot now elsewhere is checked against them (ties between tensors)
  std::vector<std::pair<uintptr_t, int64_t>> recorded_ptrs_;
  std::string reason_;
};

}  // namespace nebula
