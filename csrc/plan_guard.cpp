#include "plan_guard.h"

#include <algorithm>
#include <cstring>

#include <c10/util/Exception.h>

#include "copy_engine.h"

namespace nebula {

// ---------------------------------------------------------------------------
// SourceSet

SourceSet::SourceSet(std::vector<at::Tensor> tensors,
                     std::shared_ptr<const std::vector<int64_t>> offsets)
    : tensors_(std::make_shared<std::vector<at::Tensor>>(std::move(tensors))),
      offsets_(std::move(offsets)) {
  TORCH_CHECK(offsets_ && offsets_->size() == tensors_->size(), "SourceSet: ", tensors_->size(),
              " tensors but ", offsets_ ? offsets_->size() : 0, " offsets");
  versions_.resize(tensors_->size(), -1);
  for (size_t i = 0; i < tensors_->size(); ++i) {
    const at::Tensor& t = (*tensors_)[i];
    TORCH_CHECK(t.defined(), "SourceSet: tensor ", i, " is undefined");
    versions_[i] = version_of(t);
  }
}

SourceSet::SourceSet(std::vector<at::Tensor> tensors, std::vector<Source> sources,
                     std::shared_ptr<const std::vector<int64_t>> offsets)
    : tensors_(std::make_shared<std::vector<at::Tensor>>(std::move(tensors))),
      sources_(std::move(sources)),
      offsets_(std::move(offsets)) {
  TORCH_CHECK(offsets_ && offsets_->size() == tensors_->size() &&
                  sources_.size() == tensors_->size(),
              "SourceSet: ", tensors_->size(), " tensors but ", offsets_ ? offsets_->size() : 0,
              " offsets");
  versions_.reserve(sources_.size());
  for (const Source& s : sources_) versions_.push_back(s.version);
}

const at::Tensor& SourceSet::get(size_t i) const {
  TORCH_CHECK(i < tensors_->size(), "SourceSet: index ", i, " out of range (", tensors_->size(), ")");
  return (*tensors_)[i];
}

void SourceSet::set(size_t i, const at::Tensor& t) {
  TORCH_CHECK(i < tensors_->size(), "SourceSet: index ", i, " out of range (", tensors_->size(), ")");
  TORCH_CHECK(t.defined(), "SourceSet: the new tensor is undefined");
  if (!sources_.empty()) sources_[i] = checked_source(t, i);  // before anything changes
  if (tensors_.use_count() > 1) {  // a copy job enqueued before holds the old list
    tensors_ = std::make_shared<std::vector<at::Tensor>>(*tensors_);
  }
  (*tensors_)[i] = t;
  versions_[i] = version_of(t);
}

bool SourceSet::any_cuda() const {
  if (!sources_.empty()) {
    return std::any_of(sources_.begin(), sources_.end(), [](const Source& s) { return s.cuda; });
  }
  for (const at::Tensor& t : *tensors_) {
    if (t.is_cuda()) return true;
  }
  return false;
}

std::vector<int64_t> SourceSet::changed() const {
  std::vector<int64_t> out;
  for (size_t i = 0; i < tensors_->size(); ++i) {
    if (versions_[i] >= 0 && version_of((*tensors_)[i]) != versions_[i]) {
      out.push_back(static_cast<int64_t>(i));
    }
  }
  return out;
}

void SourceSet::clear() {
  tensors_ = std::make_shared<std::vector<at::Tensor>>();
  versions_.clear();
  sources_.clear();
  offsets_ = std::make_shared<const std::vector<int64_t>>();
}

std::unique_ptr<CopyJob> SourceSet::enqueue(CopyEngine& engine, const at::Tensor& dst,
                                            bool checksum) const {
  if (sources_.empty() && !tensors_->empty()) return engine.enqueue(*tensors_, dst, *offsets_, checksum);
  return engine.enqueue_read(tensors_, sources_, dst, *offsets_, checksum);
}

// ---------------------------------------------------------------------------
// The compiled structure

namespace guard {

// An owned Python reference.
class Ref {
 public:
  Ref() = default;
  static Ref borrow(PyObject* p) {
    Py_XINCREF(p);
    return Ref(p);
  }
  static Ref steal(PyObject* p) { return Ref(p); }
  ~Ref() { Py_XDECREF(p_); }
  Ref(Ref&& o) noexcept : p_(o.p_) { o.p_ = nullptr; }
  Ref& operator=(Ref&& o) noexcept {
    if (this != &o) {
      Py_XDECREF(p_);
      p_ = o.p_;
      o.p_ = nullptr;
    }
    return *this;
  }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  PyObject* get() const { return p_; }

 private:
  explicit Ref(PyObject* p) : p_(p) {}
  PyObject* p_ = nullptr;
};

struct Names {
  Ref getattribute, object_getattribute;
  Ref parameters, buffers, modules, non_persistent, sd_hooks, sd_pre_hooks, state_dict,
      save_to_state_dict, get_extra_state, param_groups, state, opt_pre_hooks, opt_post_hooks,
      items;
  Ref stock_module_sd, stock_module_save, stock_module_extra, stock_optimizer_sd;
  Ref ndarray_type, ndarray_copy;
};

struct Ctx {
  explicit Ctx(const Names& names, size_t n_slots) : n(names), slots(n_slots), sources(n_slots) {}
  ~Ctx() {
    for (auto& d : dirty) Py_DECREF(d.second);
  }
  Ctx(const Ctx&) = delete;
  Ctx& operator=(const Ctx&) = delete;

  bool fail(const char* what, int64_t index = -1) {
    reason = what;
    if (index >= 0) reason += " (" + std::to_string(index) + ")";
    return false;
  }

  // A C-API call failed: an Exception is a miss (the plan made afresh raises
  // it properly), anything else (KeyboardInterrupt, SystemExit) propagates.
  bool py_failed(const char* what) {
    if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_Exception)) throw PlanGuard::py_error_pending{};
    PyErr_Clear();
    return fail(what);
  }

  const Names& n;
  std::vector<at::Tensor> slots;
  std::vector<Source> sources;  // by slot: read with the checks (read_source)
  std::vector<DirtyLeaf> dirty;
  std::string reason;
  std::vector<std::pair<PyTypeObject*, bool>> stock_types;  // checked in this call
};

struct Node {
  virtual ~Node() = default;
  virtual bool check(PyObject* v, Ctx& c) = 0;
};

using NodePtr = std::unique_ptr<Node>;

// Equal dict keys (str or int, as the walk allows): the same object, or the
// same exact type and equal.
bool same_key(PyObject* k, PyObject* want, Ctx& c, bool* ok) {
  if (k == want) return true;
  if (Py_TYPE(k) != Py_TYPE(want)) return false;
  const int eq = PyObject_RichCompareBool(k, want, Py_EQ);
  if (eq < 0) {
    *ok = c.py_failed("a key could not be compared");
    return false;
  }
  return eq == 1;
}

// A Python object's identity, without keeping it alive when it can be
// referenced weakly (modules, optimizers: a replaced model is not held).
class Identity {
 public:
  explicit Identity(PyObject* obj) {
    if (PyType_SUPPORTS_WEAKREFS(Py_TYPE(obj))) {
      PyObject* w = PyWeakref_NewRef(obj, nullptr);
      if (w != nullptr) {
        ref_ = Ref::steal(w);
        weak_ = true;
        return;
      }
      PyErr_Clear();
    }
    ref_ = Ref::borrow(obj);
  }
  bool is(PyObject* v) const {
    if (!weak_) return ref_.get() == v;
#if PY_VERSION_HEX >= 0x030D0000
    PyObject* o = nullptr;
    if (PyWeakref_GetRef(ref_.get(), &o) != 1) {
      PyErr_Clear();
      return false;
    }
    const bool same = o == v;
    Py_DECREF(o);
    return same;
#else
    return PyWeakref_GET_OBJECT(ref_.get()) == v;
#endif
  }

 private:
  Ref ref_;
  bool weak_ = false;
};

// One tensor leaf: the Python type, dtype, device, shape, strides and
// conj/neg bits it had when recorded, and its slot.
struct TensorNode final : Node {
  TensorNode(int64_t slot_, PyObject* obj) : slot(slot_) {
    TORCH_CHECK(py_is_tensor(obj), "PlanGuard: slot ", slot_, " is not a tensor");
    type = Ref::borrow(reinterpret_cast<PyObject*>(Py_TYPE(obj)));
    const at::Tensor& t = py_unpack_tensor(obj);
    TORCH_CHECK(t.defined() && t.layout() == at::kStrided, "PlanGuard: slot ", slot_,
                " is not a dense tensor");
    dtype = t.scalar_type();
    device = t.device();
    sizes = t.sizes().vec();
    strides = t.strides().vec();
    conj = t.is_conj();
    neg = t.is_neg();
    numel = t.numel();
    ptr = numel > 0 ? reinterpret_cast<uintptr_t>(t.data_ptr()) : 0;
    itemsize = static_cast<int64_t>(t.itemsize());
    nbytes = static_cast<uint64_t>(t.nbytes());
    for (size_t d = 0; d < sizes.size(); ++d) span += (sizes[d] - 1) * strides[d];
    span += 1;
    plain = t.is_contiguous() && !conj && !neg;
    cuda = device.is_cuda();
  }

  bool check(PyObject* v, Ctx& c) override {
    if (Py_TYPE(v) != reinterpret_cast<PyTypeObject*>(type.get())) {
      return c.fail("a tensor's Python type changed, slot", slot);
    }
    return take(py_unpack_tensor(v), c);
  }

  bool same_meta(const at::Tensor& t) const {
    if (!t.defined()) return false;
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    if (impl->layout() != at::kStrided || impl->is_nested() || impl->is_python_dispatch() ||
        t.is_quantized()) {
      return false;
    }
    if (t.scalar_type() != dtype || t.device() != device) return false;
    const auto s = t.sizes();
    const auto st = t.strides();
    if (s.size() != sizes.size() || !std::equal(s.begin(), s.end(), sizes.begin()) ||
        !std::equal(st.begin(), st.end(), strides.begin())) {
      return false;
    }
    if (t.is_conj() != conj || t.is_neg() != neg) return false;
    // storage_covers(t), with the extent of the recorded shape and strides (equal, checked above)
    if (numel == 0) return true;
    if (!impl->has_storage()) return false;
    const int64_t off = impl->storage_offset();
    return off >= 0 && impl->unsafe_storage().nbytes() >= static_cast<uint64_t>(off + span) * itemsize;
  }

  // read_source(t): what depends on the shape, strides, dtype, device and conj/neg bits was
  // computed when recorded (same_meta found them equal); the data pointer and version are read.
  bool take(const at::Tensor& t, Ctx& c) {
    if (!same_meta(t)) return c.fail("a tensor's dtype, shape, strides or device changed, slot", slot);
    c.slots[slot] = t;
    Source& s = c.sources[slot];
    s.nbytes = nbytes;
    s.from = nbytes > 0 ? static_cast<const uint8_t*>(t.const_data_ptr()) : nullptr;
    s.version = version_of(t);
    s.plain = plain;
    s.cuda = cuda;
    return true;
  }

  int64_t slot;
  Ref type;
  c10::ScalarType dtype;
  c10::Device device{c10::kCPU};
  std::vector<int64_t> sizes, strides;
  bool conj = false, neg = false;
  int64_t numel = 0;
  uintptr_t ptr = 0;  // data pointer when recorded
  int64_t itemsize = 0;
  uint64_t nbytes = 0;
  int64_t span = 0;  // elements from the storage offset to past the last one (when numel > 0)
  bool plain = false, cuda = false;
};

enum class LeafMode { None, Bool, Int, Float, Str, Other };

// Whether a changed leaf is still a leaf of the walk (not a container, tensor,
// array or object with state_dict(): those change the structure).
bool still_a_leaf(PyObject* v, Ctx& c, bool* ok) {
  if (v == Py_None || PyBool_Check(v) || PyLong_CheckExact(v) || PyFloat_CheckExact(v) ||
      PyUnicode_CheckExact(v)) {
    return true;
  }
  if (py_is_tensor(v) || PyDict_Check(v) || PyList_Check(v) || PyTuple_Check(v)) return false;
  if (c.n.ndarray_type.get() != nullptr &&
      Py_TYPE(v) == reinterpret_cast<PyTypeObject*>(c.n.ndarray_type.get())) {
    return false;
  }
  // hasattr(v, "state_dict"), as the walk asks it
  PyObject* a = PyObject_GetAttr(v, c.n.state_dict.get());
  if (a != nullptr) {
    Py_DECREF(a);
    return false;
  }
  if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
    PyErr_Clear();
    return true;
  }
  *ok = c.py_failed("a leaf's attributes could not be read");
  return false;
}

// A non-tensor leaf: equal to the value recorded (same exact type; floats
// bit for bit, so -0.0 is not 0.0) or reported as changed.
struct LeafNode final : Node {
  LeafNode(int64_t index_, PyObject* value) : index(index_) { set(value); }

  void set(PyObject* value) {
    cached = Ref::borrow(value);
    if (value == Py_None) {
      mode = LeafMode::None;
    } else if (PyBool_Check(value)) {
      mode = LeafMode::Bool;
    } else if (PyLong_CheckExact(value)) {
      mode = LeafMode::Int;
    } else if (PyFloat_CheckExact(value)) {
      mode = LeafMode::Float;
    } else if (PyUnicode_CheckExact(value)) {
      mode = LeafMode::Str;
    } else {
      mode = LeafMode::Other;  // re-encoded every time (dtype, complex, bytes, pickled, ...)
    }
  }

  bool equal(PyObject* v, Ctx& c, bool* ok) const {
    PyObject* want = cached.get();
    switch (mode) {
      case LeafMode::None:
      case LeafMode::Bool:
        return v == want;
      case LeafMode::Int: {
        if (!PyLong_CheckExact(v)) return false;
        if (v == want) return true;
        const int eq = PyObject_RichCompareBool(v, want, Py_EQ);
        if (eq < 0) *ok = c.py_failed("an int could not be compared");
        return eq == 1;
      }
      case LeafMode::Float: {
        if (!PyFloat_CheckExact(v)) return false;
        const double a = PyFloat_AS_DOUBLE(v), b = PyFloat_AS_DOUBLE(want);
        return std::memcmp(&a, &b, sizeof a) == 0;
      }
      case LeafMode::Str:
        return PyUnicode_CheckExact(v) && (v == want || PyUnicode_Compare(v, want) == 0);
      case LeafMode::Other:
        return false;
    }
    return false;
  }

  bool check(PyObject* v, Ctx& c) override {
    bool ok = true;
    if (equal(v, c, &ok)) return true;
    if (!ok) return false;
    if (!still_a_leaf(v, c, &ok)) return ok ? c.fail("a leaf became a container or tensor, leaf", index) : false;
    Py_INCREF(v);
    c.dirty.emplace_back(index, v);
    return true;
  }

  int64_t index;
  Ref cached;
  LeafMode mode = LeafMode::Other;
};

// A value that must stay equal (torch.Size).
struct ConstNode final : Node {
  explicit ConstNode(PyObject* value) : value(Ref::borrow(value)) {}
  bool check(PyObject* v, Ctx& c) override {
    if (Py_TYPE(v) != Py_TYPE(value.get())) return c.fail("a torch.Size changed");
    const int eq = PyObject_RichCompareBool(v, value.get(), Py_EQ);
    if (eq < 0) return c.py_failed("a torch.Size could not be compared");
    return eq == 1 || c.fail("a torch.Size changed");
  }
  Ref value;
};

// Iterate a dict's items in the walk's order: PyDict_Next for dict and
// defaultdict (insertion order), items() for any other subclass
// (OrderedDict keeps an order of its own).
template <typename F>
bool for_items(PyObject* d, bool fast, Ctx& c, F&& each) {
  if (fast) {
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    size_t i = 0;
    while (PyDict_Next(d, &pos, &k, &v)) {
      // the value may run Python code (state_dict() of an object in it): hold both
      Ref hk = Ref::borrow(k), hv = Ref::borrow(v);
      if (!each(i++, k, v)) return false;
    }
    return true;
  }
  Ref items = Ref::steal(PyObject_CallMethodNoArgs(d, c.n.items.get()));
  if (items.get() == nullptr) return c.py_failed("a dict's items() raised");
  Ref it = Ref::steal(PyObject_GetIter(items.get()));
  if (it.get() == nullptr) return c.py_failed("a dict's items() is not iterable");
  size_t i = 0;
  for (;;) {
    Ref item = Ref::steal(PyIter_Next(it.get()));
    if (item.get() == nullptr) break;
    if (!PyTuple_Check(item.get()) || PyTuple_GET_SIZE(item.get()) != 2) {
      return c.fail("a dict's items() gave something else than pairs");
    }
    if (!each(i++, PyTuple_GET_ITEM(item.get(), 0), PyTuple_GET_ITEM(item.get(), 1))) return false;
  }
  return PyErr_Occurred() ? c.py_failed("a dict's items() raised") : true;
}

struct DictNode final : Node {
  bool check(PyObject* v, Ctx& c) override {
    if (Py_TYPE(v) != reinterpret_cast<PyTypeObject*>(type.get())) return c.fail("a dict's type changed");
    if (fast && PyDict_GET_SIZE(v) != static_cast<Py_ssize_t>(keys.size())) {
      return c.fail("a dict's keys changed");
    }
    size_t seen = 0;
    const bool ok = for_items(v, fast, c, [&](size_t i, PyObject* k, PyObject* val) {
      if (i >= keys.size()) return c.fail("a dict's keys changed");
      bool good = true;
      if (!same_key(k, keys[i].get(), c, &good)) return good ? c.fail("a dict's keys changed") : false;
      ++seen;
      return values[i]->check(val, c);
    });
    return ok && (seen == keys.size() || c.fail("a dict's keys changed"));
  }
  Ref type;
  bool fast = false;
  std::vector<Ref> keys;
  std::vector<NodePtr> values;
};

struct SeqNode final : Node {
  bool check(PyObject* v, Ctx& c) override {
    if (Py_TYPE(v) != reinterpret_cast<PyTypeObject*>(type.get())) return c.fail("a list or tuple's type changed");
    Ref seq = Ref::steal(PySequence_Fast(v, "not a sequence"));
    if (seq.get() == nullptr) return c.py_failed("a list could not be read");
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.get());
    if (n != static_cast<Py_ssize_t>(items.size())) return c.fail("a list or tuple's length changed");
    for (Py_ssize_t i = 0; i < n; ++i) {
      Ref item = Ref::borrow(PySequence_Fast_GET_ITEM(seq.get(), i));
      if (!items[static_cast<size_t>(i)]->check(item.get(), c)) return false;
    }
    return true;
  }
  Ref type;
  std::vector<NodePtr> items;
};

// A NumPy array: copied into a new tensor now (the walk stores a copy taken at
// the call), which must have the dtype code and shape recorded.
struct NdarrayNode final : Node {
  NdarrayNode(int64_t slot, PyObject* code_, PyObject* copy) : code(Ref::borrow(code_)), tensor(slot, copy) {}
  bool check(PyObject* v, Ctx& c) override {
    if (c.n.ndarray_copy.get() == nullptr ||
        Py_TYPE(v) != reinterpret_cast<PyTypeObject*>(c.n.ndarray_type.get())) {
      return c.fail("a NumPy array was replaced");
    }
    Ref res = Ref::steal(PyObject_CallOneArg(c.n.ndarray_copy.get(), v));
    if (res.get() == nullptr) return c.py_failed("copying a NumPy array raised");
    if (!PyTuple_Check(res.get()) || PyTuple_GET_SIZE(res.get()) != 2) return c.fail("a NumPy array's dtype changed");
    PyObject* got = PyTuple_GET_ITEM(res.get(), 0);
    PyObject* t = PyTuple_GET_ITEM(res.get(), 1);
    if (!PyUnicode_Check(got) || PyUnicode_Compare(got, code.get()) != 0 || !py_is_tensor(t)) {
      return c.fail("a NumPy array's dtype changed");
    }
    return tensor.take(py_unpack_tensor(t), c);
  }
  Ref code;
  TensorNode tensor;
};

// An object with state_dict() read by calling it (schedulers, GradScaler,
// modules and optimizers that change state_dict()).
struct CallNode final : Node {
  explicit CallNode(PyObject* obj) : self(obj), type(Ref::borrow(reinterpret_cast<PyObject*>(Py_TYPE(obj)))) {}
  bool check(PyObject* v, Ctx& c) override {
    if (Py_TYPE(v) != reinterpret_cast<PyTypeObject*>(type.get()) || !self.is(v)) {
      return c.fail("an object with state_dict() was replaced");
    }
    Ref res = Ref::steal(PyObject_CallMethodNoArgs(v, c.n.state_dict.get()));
    if (res.get() == nullptr) return c.py_failed("state_dict() raised");
    return child->check(res.get(), c);
  }
  Identity self;
  Ref type;
  NodePtr child;
};

// The value of `key` in an instance dict (borrowed), or nullptr (reason set).
PyObject* item(PyObject* d, const Ref& key, Ctx& c, const char* what) {
  PyObject* v = PyDict_GetItemWithError(d, key.get());
  if (v == nullptr) {
    if (PyErr_Occurred()) {
      c.py_failed(what);
    } else {
      c.fail(what);
    }
  }
  return v;
}

bool attr_is(PyTypeObject* t, const Ref& name, const Ref& want, Ctx& c, bool* ok) {
  Ref a = Ref::steal(PyObject_GetAttr(reinterpret_cast<PyObject*>(t), name.get()));
  if (a.get() == nullptr) {
    if (PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_AttributeError)) {
      PyErr_Clear();
      return false;
    }
    *ok = c.py_failed("a class attribute could not be read");
    return false;
  }
  return a.get() == want.get();
}

// Whether instances of `t` save through PyTorch's own state_dict(): module
// (state_dict, _save_to_state_dict, get_extra_state) or optimizer
// (state_dict). Asked once per class per check.
bool stock_class(PyTypeObject* t, bool optimizer, Ctx& c, bool* ok) {
  for (const auto& p : c.stock_types) {
    if (p.first == t) return p.second;
  }
  // state_dict() reads the registries through plain attribute access
  bool yes = attr_is(t, c.n.getattribute, c.n.object_getattribute, c, ok);
  if (yes && *ok && optimizer) {
    yes = attr_is(t, c.n.state_dict, c.n.stock_optimizer_sd, c, ok);
  } else if (yes && *ok) {
    yes = attr_is(t, c.n.state_dict, c.n.stock_module_sd, c, ok) && *ok &&
          attr_is(t, c.n.save_to_state_dict, c.n.stock_module_save, c, ok) && *ok &&
          attr_is(t, c.n.get_extra_state, c.n.stock_module_extra, c, ok);
  }
  if (!*ok) return false;
  c.stock_types.emplace_back(t, yes);
  return yes;
}

// The instance dict of a stock module / optimizer (class checked), or null (reason set).
Ref stock_dict(PyObject* v, bool optimizer, Ctx& c) {
  bool ok = true;
  if (!stock_class(Py_TYPE(v), optimizer, c, &ok)) {
    if (ok) c.fail(optimizer ? "an optimizer's class changed state_dict()" : "a module's class changed state_dict()");
    return Ref();
  }
  Ref d = Ref::steal(PyObject_GenericGetDict(v, nullptr));
  if (d.get() == nullptr) c.py_failed("an instance dict could not be read");
  return d;
}

// The instance dict of a stock module / optimizer, checked for instance-level
// overrides of state_dict() and for state-dict hooks (which must be empty;
// hooks[0], hooks[1]: the pre- and post-hook dicts, borrowed, when given).
Ref stock_instance_dict(PyObject* v, bool optimizer, Ctx& c, PyObject** hooks_out = nullptr) {
  Ref d = stock_dict(v, optimizer, c);
  if (d.get() == nullptr) return Ref();
  const Ref* own[] = {&c.n.state_dict, &c.n.save_to_state_dict};
  for (int i = 0; i < (optimizer ? 1 : 2); ++i) {
    PyObject* o = PyDict_GetItemWithError(d.get(), own[i]->get());
    if (o != nullptr || PyErr_Occurred()) {
      if (PyErr_Occurred()) {
        c.py_failed("an instance dict could not be read");
      } else {
        c.fail("an instance overrides state_dict()");
      }
      return Ref();
    }
  }
  const Ref& pre = optimizer ? c.n.opt_pre_hooks : c.n.sd_pre_hooks;
  const Ref& post = optimizer ? c.n.opt_post_hooks : c.n.sd_hooks;
  int h = 0;
  for (const Ref* k : {&pre, &post}) {
    PyObject* hooks = item(d.get(), *k, c, "state-dict hooks are missing");
    if (hooks == nullptr) return Ref();
    if (!PyDict_Check(hooks) || PyDict_GET_SIZE(hooks) != 0) {
      c.fail("a state-dict hook is registered");
      return Ref();
    }
    if (hooks_out != nullptr) hooks_out[h++] = hooks;
  }
  return d;
}

#if PY_VERSION_HEX < 0x030C0000
#define NEBULA_DICT_STAMPS 1
// A dict as a check that passed found it: its address and version tag. CPython 3.11 gives a
// dict a new tag at every change of its items and at its creation, from one global counter: the
// same address and tag are the same dict, alive and unchanged (a dict made later at that address
// has another tag). (3.12 deprecates the tag: there every check reads everything.)
struct Stamp {
  PyObject* d = nullptr;
  uint64_t tag = 0;
  bool same(PyObject* x) const {
    return x != nullptr && x == d && reinterpret_cast<PyDictObject*>(x)->ma_version_tag == tag;
  }
  void take(PyObject* x) {
    d = x;
    tag = reinterpret_cast<PyDictObject*>(x)->ma_version_tag;
  }
};
#endif

struct ModuleEntry {
  Ref name;
  int kind = 0;  // parameter: 0 None, 1 tensor; buffer: 0 None, 1 persistent, 2 not persistent
  std::unique_ptr<TensorNode> tensor;
};

// A module whose state_dict() is PyTorch's: read through _parameters,
// _buffers (persistent ones) and _modules, exactly as state_dict() reads them.
struct ModuleNode final : Node {
  explicit ModuleNode(PyObject* obj) : self(obj), type(Ref::borrow(reinterpret_cast<PyObject*>(Py_TYPE(obj)))) {}

  // The registries state_dict() reads (borrowed from the instance dict) and its hook dicts.
  struct Registries {
    PyObject *ps = nullptr, *bs = nullptr, *np = nullptr, *ms = nullptr;
    PyObject* hooks[2] = {nullptr, nullptr};
  };

  bool check(PyObject* v, Ctx& c) override {
    if (Py_TYPE(v) != reinterpret_cast<PyTypeObject*>(type.get()) || !self.is(v)) {
      return c.fail("a module was replaced");
    }
    Ref d;  // holds the registries
    Registries r;
    if (!registries(v, c, &d, &r)) return false;
#ifdef NEBULA_DICT_STAMPS
    // An unchanged registry has the keys, values and order a check found right: only the tensors
    // (whose storage, shape or dtype may change in place) are checked. A buffer's persistence is
    // its name in _non_persistent_buffers_set (a set has no tag): read unless that set is empty and
    // the plan has no non-persistent buffer.
    const bool np_fixed = PySet_GET_SIZE(r.np) == 0 && !any_non_persistent;
    const bool ok = (ps_stamp.same(r.ps) ? values(r.ps, params, c) : tensors(r.ps, params, nullptr, c)) &&
                    (np_fixed && bs_stamp.same(r.bs) ? values(r.bs, buffers, c) : tensors(r.bs, buffers, r.np, c)) &&
                    (ms_stamp.same(r.ms) ? children_of(r.ms, c) : submodules(r.ms, c));
    if (ok) {
      ps_stamp.take(r.ps);
      bs_stamp.take(r.bs);
      ms_stamp.take(r.ms);
    }
    return ok;
#else
    return tensors(r.ps, params, nullptr, c) && tensors(r.bs, buffers, r.np, c) && submodules(r.ms, c);
#endif
  }

  // The registries of stock module v, checked (the class, no instance override, no hooks, the
  // registries' types); read from the instance dict unless it is the one checked last time.
  bool registries(PyObject* v, Ctx& c, Ref* d, Registries* r) {
#ifdef NEBULA_DICT_STAMPS
    *d = stock_dict(v, false, c);
    if (d->get() == nullptr) return false;
    if (inst_stamp.same(d->get())) {  // the same registries and hook dicts: hooks may be added to those
      *r = cached;
      return (PyDict_GET_SIZE(r->hooks[0]) == 0 && PyDict_GET_SIZE(r->hooks[1]) == 0) ||
             c.fail("a state-dict hook is registered");
    }
#endif
    *d = stock_instance_dict(v, false, c, r->hooks);
    if (d->get() == nullptr) return false;
    r->ps = item(d->get(), c.n.parameters, c, "a module has no _parameters");
    r->bs = r->ps ? item(d->get(), c.n.buffers, c, "a module has no _buffers") : nullptr;
    r->np = r->bs ? item(d->get(), c.n.non_persistent, c, "a module has no _non_persistent_buffers_set") : nullptr;
    r->ms = r->np ? item(d->get(), c.n.modules, c, "a module has no _modules") : nullptr;
    if (r->ms == nullptr) return false;
    if (!PyDict_CheckExact(r->ps) || !PyDict_CheckExact(r->bs) || !PyDict_CheckExact(r->ms) || !PyAnySet_Check(r->np)) {
      return c.fail("a module's registries changed type");
    }
#ifdef NEBULA_DICT_STAMPS
    inst_stamp.take(d->get());
    cached = *r;
#endif
    return true;
  }

#ifdef NEBULA_DICT_STAMPS
  // The tensors of a registry whose keys and kinds a check found right (unchanged since).
  bool values(PyObject* d, std::vector<ModuleEntry>& want, Ctx& c) {
    Py_ssize_t pos = 0;
    PyObject *k, *val;
    for (size_t i = 0; PyDict_Next(d, &pos, &k, &val); ++i) {
      if (want[i].kind == 1 && !want[i].tensor->check(val, c)) return false;
    }
    return true;
  }

  bool children_of(PyObject* d, Ctx& c) {
    Py_ssize_t pos = 0;
    PyObject *k, *val;
    for (size_t i = 0; PyDict_Next(d, &pos, &k, &val); ++i) {
      Ref hv = Ref::borrow(val);  // a submodule's check may run Python code (a class attribute read)
      if (children[i].second && !children[i].second->check(val, c)) return false;
    }
    return true;
  }
#endif

  bool tensors(PyObject* d, std::vector<ModuleEntry>& want, PyObject* non_persistent, Ctx& c) {
    if (PyDict_GET_SIZE(d) != static_cast<Py_ssize_t>(want.size())) {
      return c.fail("a module's parameters or buffers changed");
    }
    return for_items(d, true, c, [&](size_t i, PyObject* k, PyObject* val) {
      ModuleEntry& e = want[i];
      bool ok = true;
      if (!same_key(k, e.name.get(), c, &ok)) return ok ? c.fail("a module's parameters or buffers changed") : false;
      int kind = val == Py_None ? 0 : 1;
      if (kind == 1 && non_persistent != nullptr) {
        const int in = PySet_Contains(non_persistent, k);
        if (in < 0) return c.py_failed("_non_persistent_buffers_set could not be read");
        kind = in ? 2 : 1;
      }
      if (kind != e.kind) return c.fail("a module's parameter or buffer was set, removed or made (non-)persistent");
      if (kind != 1) return true;  // None, or a buffer state_dict() leaves out
      return e.tensor->check(val, c);
    });
  }

  bool submodules(PyObject* d, Ctx& c) {
    if (PyDict_GET_SIZE(d) != static_cast<Py_ssize_t>(children.size())) return c.fail("a module's submodules changed");
    return for_items(d, true, c, [&](size_t i, PyObject* k, PyObject* val) {
      bool ok = true;
      if (!same_key(k, children[i].first.get(), c, &ok)) return ok ? c.fail("a module's submodules changed") : false;
      if (val == Py_None || !children[i].second) {
        return (val == Py_None && !children[i].second) || c.fail("a submodule was set or removed");
      }
      return children[i].second->check(val, c);
    });
  }

  Identity self;
  Ref type;
  std::vector<ModuleEntry> params, buffers;
  std::vector<std::pair<Ref, std::unique_ptr<ModuleNode>>> children;
  bool any_non_persistent = false;  // a buffer of kind 2
#ifdef NEBULA_DICT_STAMPS
  Stamp inst_stamp, ps_stamp, bs_stamp, ms_stamp;  // as the last check that passed them found them
  Registries cached;                               // of the instance dict of inst_stamp
#endif
};

struct OptimGroup {
  std::vector<Ref> keys;
  std::vector<NodePtr> values;  // null at the "params" key
  size_t params_at = 0;
  std::vector<Ref> params;
};

// An optimizer whose state_dict() is PyTorch's: param_groups (the parameters
// by identity, the other entries as values) and state (per parameter, by
// identity and in order), which fix the indices state_dict() packs.
struct OptimNode final : Node {
  explicit OptimNode(PyObject* obj) : self(obj), type(Ref::borrow(reinterpret_cast<PyObject*>(Py_TYPE(obj)))) {}

  bool check(PyObject* v, Ctx& c) override {
    if (Py_TYPE(v) != reinterpret_cast<PyTypeObject*>(type.get()) || !self.is(v)) {
      return c.fail("an optimizer was replaced");
    }
    Ref d = stock_instance_dict(v, true, c);
    if (d.get() == nullptr) return false;
    PyObject* pg = item(d.get(), c.n.param_groups, c, "an optimizer has no param_groups");
    PyObject* st = pg ? item(d.get(), c.n.state, c, "an optimizer has no state") : nullptr;
    if (st == nullptr) return false;
    if (!PyList_CheckExact(pg) || PyList_GET_SIZE(pg) != static_cast<Py_ssize_t>(groups.size())) {
      return c.fail("an optimizer's param groups changed");
    }
    for (size_t g = 0; g < groups.size(); ++g) {
      Ref group = Ref::borrow(PyList_GET_ITEM(pg, static_cast<Py_ssize_t>(g)));
      if (!check_group(groups[g], group.get(), c)) return false;
    }
    if (Py_TYPE(st) != reinterpret_cast<PyTypeObject*>(state_type.get()) ||
        PyDict_GET_SIZE(st) != static_cast<Py_ssize_t>(state.size())) {
      return c.fail("an optimizer's state was created or dropped");
    }
    return for_items(st, true, c, [&](size_t i, PyObject* k, PyObject* val) {
      if (k != state[i].first.get()) return c.fail("an optimizer's state was created or dropped");
      return state[i].second->check(val, c);
    });
  }

  bool check_group(OptimGroup& g, PyObject* gd, Ctx& c) {
    if (!PyDict_CheckExact(gd) || PyDict_GET_SIZE(gd) != static_cast<Py_ssize_t>(g.keys.size())) {
      return c.fail("an optimizer's param group changed");
    }
    return for_items(gd, true, c, [&](size_t i, PyObject* k, PyObject* val) {
      bool ok = true;
      if (!same_key(k, g.keys[i].get(), c, &ok)) return ok ? c.fail("an optimizer's param group changed") : false;
      if (i != g.params_at) return g.values[i]->check(val, c);
      if (!PyList_CheckExact(val) || PyList_GET_SIZE(val) != static_cast<Py_ssize_t>(g.params.size())) {
        return c.fail("an optimizer's parameters changed");
      }
      for (size_t j = 0; j < g.params.size(); ++j) {
        if (PyList_GET_ITEM(val, static_cast<Py_ssize_t>(j)) != g.params[j].get()) {
          return c.fail("an optimizer's parameters changed");
        }
      }
      return true;
    });
  }

  Identity self;
  Ref type;
  std::vector<OptimGroup> groups;
  Ref state_type;
  std::vector<std::pair<Ref, NodePtr>> state;  // parameter (held) -> its state
};

// ---------------------------------------------------------------------------
// Compiling the program (plan_record.py builds it; see there for the shapes)

struct Compiler {
  std::vector<Node*>* leaves;
  std::vector<Node*>* tensors;
  int64_t n_slots;
  PyObject* defaultdict;  // collections.defaultdict (iterated like dict)

  static PyObject* at(PyObject* tup, Py_ssize_t i) {
    TORCH_CHECK(PyTuple_Check(tup) && i < PyTuple_GET_SIZE(tup), "PlanGuard: malformed program");
    return PyTuple_GET_ITEM(tup, i);
  }
  static int64_t integer(PyObject* o) {
    const long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      TORCH_CHECK(false, "PlanGuard: malformed program (an index is not an int)");
    }
    return v;
  }
  static Py_ssize_t size(PyObject* tup) {
    TORCH_CHECK(PyTuple_Check(tup), "PlanGuard: malformed program (a tuple was expected)");
    return PyTuple_GET_SIZE(tup);
  }

  std::unique_ptr<TensorNode> tensor(PyObject* spec) {
    const int64_t slot = integer(at(spec, 1));
    TORCH_CHECK(slot >= 0 && slot < n_slots, "PlanGuard: slot ", slot, " out of range");
    TORCH_CHECK((*tensors)[slot] == nullptr, "PlanGuard: slot ", slot, " appears twice");
    auto n = std::make_unique<TensorNode>(slot, at(spec, 2));
    (*tensors)[slot] = n.get();
    return n;
  }

  NodePtr node(PyObject* spec) {
    PyObject* tag = at(spec, 0);
    TORCH_CHECK(PyUnicode_Check(tag) && PyUnicode_GET_LENGTH(tag) == 1, "PlanGuard: malformed program");
    switch (PyUnicode_READ_CHAR(tag, 0)) {
      case 'T':
        return tensor(spec);
      case 'L': {
        const int64_t idx = integer(at(spec, 1));
        TORCH_CHECK(idx >= 0 && idx < static_cast<int64_t>(leaves->size()) && (*leaves)[idx] == nullptr,
                    "PlanGuard: bad leaf index ", idx);
        auto n = std::make_unique<LeafNode>(idx, at(spec, 2));
        (*leaves)[idx] = n.get();
        return n;
      }
      case 'C':
        return std::make_unique<ConstNode>(at(spec, 1));
      case 'D':
        return dict(spec);
      case 'S': {
        auto n = std::make_unique<SeqNode>();
        n->type = Ref::borrow(at(spec, 1));
        PyObject* items = at(spec, 2);
        for (Py_ssize_t i = 0; i < size(items); ++i) n->items.push_back(node(at(items, i)));
        return n;
      }
      case 'N': {
        const int64_t slot = integer(at(spec, 1));
        TORCH_CHECK(slot >= 0 && slot < n_slots && (*tensors)[slot] == nullptr, "PlanGuard: bad slot ", slot);
        auto n = std::make_unique<NdarrayNode>(slot, at(spec, 2), at(spec, 3));
        (*tensors)[slot] = &n->tensor;
        return n;
      }
      case 'F': {
        auto n = std::make_unique<CallNode>(at(spec, 1));
        n->child = node(at(spec, 2));
        return n;
      }
      case 'M':
        return module(spec);
      case 'O':
        return optimizer(spec);
      default:
        TORCH_CHECK(false, "PlanGuard: malformed program (unknown node)");
    }
  }

  NodePtr dict(PyObject* spec) {
    auto n = std::make_unique<DictNode>();
    PyObject* type = at(spec, 1);
    n->type = Ref::borrow(type);
    n->fast = type == reinterpret_cast<PyObject*>(&PyDict_Type) || type == defaultdict;
    PyObject* keys = at(spec, 2);
    PyObject* values = at(spec, 3);
    TORCH_CHECK(size(keys) == size(values), "PlanGuard: malformed dict node");
    for (Py_ssize_t i = 0; i < size(keys); ++i) {
      n->keys.push_back(Ref::borrow(at(keys, i)));
      n->values.push_back(node(at(values, i)));
    }
    return n;
  }

  std::unique_ptr<ModuleNode> module(PyObject* spec) {
    auto n = std::make_unique<ModuleNode>(at(spec, 1));
    PyObject* params = at(spec, 2);
    for (Py_ssize_t i = 0; i < size(params); ++i) {
      PyObject* e = at(params, i);
      ModuleEntry me;
      me.name = Ref::borrow(at(e, 0));
      me.kind = at(e, 1) == Py_None ? 0 : 1;
      if (me.kind == 1) me.tensor = tensor(at(e, 1));
      n->params.push_back(std::move(me));
    }
    PyObject* buffers = at(spec, 3);
    for (Py_ssize_t i = 0; i < size(buffers); ++i) {
      PyObject* e = at(buffers, i);
      ModuleEntry me;
      me.name = Ref::borrow(at(e, 0));
      me.kind = static_cast<int>(integer(at(e, 1)));
      TORCH_CHECK(me.kind >= 0 && me.kind <= 2, "PlanGuard: bad buffer kind");
      if (me.kind == 1) me.tensor = tensor(at(e, 2));
      n->any_non_persistent = n->any_non_persistent || me.kind == 2;
      n->buffers.push_back(std::move(me));
    }
    PyObject* children = at(spec, 4);
    for (Py_ssize_t i = 0; i < size(children); ++i) {
      PyObject* e = at(children, i);
      std::unique_ptr<ModuleNode> child;
      if (at(e, 1) != Py_None) child = module(at(e, 1));
      n->children.emplace_back(Ref::borrow(at(e, 0)), std::move(child));
    }
    return n;
  }

  NodePtr optimizer(PyObject* spec) {
    auto n = std::make_unique<OptimNode>(at(spec, 1));
    PyObject* groups = at(spec, 2);
    for (Py_ssize_t g = 0; g < size(groups); ++g) {
      PyObject* e = at(groups, g);
      OptimGroup og;
      PyObject* keys = at(e, 0);
      PyObject* values = at(e, 1);
      og.params_at = static_cast<size_t>(integer(at(e, 2)));
      TORCH_CHECK(size(keys) == size(values) && og.params_at < static_cast<size_t>(size(keys)),
                  "PlanGuard: malformed param group");
      for (Py_ssize_t i = 0; i < size(keys); ++i) {
        og.keys.push_back(Ref::borrow(at(keys, i)));
        og.values.push_back(static_cast<size_t>(i) == og.params_at ? nullptr : node(at(values, i)));
      }
      PyObject* params = at(e, 3);
      for (Py_ssize_t j = 0; j < size(params); ++j) og.params.push_back(Ref::borrow(at(params, j)));
      n->groups.push_back(std::move(og));
    }
    n->state_type = Ref::borrow(at(spec, 3));
    PyObject* state = at(spec, 4);
    for (Py_ssize_t i = 0; i < size(state); ++i) {
      PyObject* e = at(state, i);
      n->state.emplace_back(Ref::borrow(at(e, 0)), node(at(e, 1)));
    }
    return n;
  }
};

Ref intern(const char* s) {
  PyObject* o = PyUnicode_InternFromString(s);
  TORCH_CHECK(o != nullptr, "PlanGuard: out of memory");
  return Ref::steal(o);
}

Ref stock(PyObject* d, const char* key) {
  PyObject* v = PyDict_GetItemString(d, key);
  TORCH_CHECK(v != nullptr, "PlanGuard: stock['", key, "'] is missing");
  return Ref::borrow(v);
}

std::vector<int64_t> ints(PyObject* tup, const char* what) {
  TORCH_CHECK(PyTuple_Check(tup), "PlanGuard: ", what, " must be a tuple");
  std::vector<int64_t> out(static_cast<size_t>(PyTuple_GET_SIZE(tup)));
  for (size_t i = 0; i < out.size(); ++i) out[i] = Compiler::integer(PyTuple_GET_ITEM(tup, static_cast<Py_ssize_t>(i)));
  return out;
}

}  // namespace guard

// ---------------------------------------------------------------------------
// PlanGuard

using guard::Ctx;
using guard::Ref;

namespace {

// The walk's identity of a tied key: the same memory seen the same way.
bool same_view(const guard::TensorNode& a, const guard::TensorNode& b) {
  return a.dtype == b.dtype && a.sizes == b.sizes && a.strides == b.strides && a.conj == b.conj &&
         a.neg == b.neg;
}

}  // namespace

PlanGuard::PlanGuard(PyObject* program, PyObject* slot_layout, PyObject* alias_of, PyObject* offsets,
                     PyObject* stock, PyObject* ndarray_type, PyObject* ndarray_copy)
    : names_(std::make_unique<guard::Names>()) {
  slot_layout_ = guard::ints(slot_layout, "slot_layout");
  alias_of_ = guard::ints(alias_of, "alias_of");
  offsets_ = std::make_shared<const std::vector<int64_t>>(guard::ints(offsets, "offsets"));
  const auto n_slots = static_cast<int64_t>(slot_layout_.size());
  TORCH_CHECK(static_cast<int64_t>(alias_of_.size()) == n_slots, "PlanGuard: alias_of has the wrong length");
  std::vector<char> placed(offsets_->size(), 0);
  for (int64_t s = 0; s < n_slots; ++s) {
    const int64_t li = slot_layout_[s], a = alias_of_[s];
    TORCH_CHECK((li >= 0) != (a >= 0), "PlanGuard: slot ", s, " must be stored or tied, not both");
    if (li >= 0) {
      TORCH_CHECK(li < static_cast<int64_t>(placed.size()) && !placed[li], "PlanGuard: bad layout position ", li);
      placed[li] = 1;
    } else {
      TORCH_CHECK(a < n_slots && slot_layout_[a] >= 0, "PlanGuard: slot ", s, " is tied to a slot not stored");
    }
  }
  TORCH_CHECK(std::all_of(placed.begin(), placed.end(), [](char p) { return p != 0; }),
              "PlanGuard: a layout position has no slot");
  TORCH_CHECK(PyDict_Check(stock), "PlanGuard: stock must be a dict");

  guard::Names& n = *names_;
  n.getattribute = guard::intern("__getattribute__");
  n.object_getattribute = Ref::steal(PyObject_GetAttr(reinterpret_cast<PyObject*>(&PyBaseObject_Type),
                                                      n.getattribute.get()));
  TORCH_CHECK(n.object_getattribute.get() != nullptr, "PlanGuard: object.__getattribute__ is missing");
  n.parameters = guard::intern("_parameters");
  n.buffers = guard::intern("_buffers");
  n.modules = guard::intern("_modules");
  n.non_persistent = guard::intern("_non_persistent_buffers_set");
  n.sd_hooks = guard::intern("_state_dict_hooks");
  n.sd_pre_hooks = guard::intern("_state_dict_pre_hooks");
  n.state_dict = guard::intern("state_dict");
  n.save_to_state_dict = guard::intern("_save_to_state_dict");
  n.get_extra_state = guard::intern("get_extra_state");
  n.param_groups = guard::intern("param_groups");
  n.state = guard::intern("state");
  n.opt_pre_hooks = guard::intern("_optimizer_state_dict_pre_hooks");
  n.opt_post_hooks = guard::intern("_optimizer_state_dict_post_hooks");
  n.items = guard::intern("items");
  n.stock_module_sd = guard::stock(stock, "module_state_dict");
  n.stock_module_save = guard::stock(stock, "module_save_to_state_dict");
  n.stock_module_extra = guard::stock(stock, "module_get_extra_state");
  n.stock_optimizer_sd = guard::stock(stock, "optimizer_state_dict");
  if (ndarray_type != Py_None) n.ndarray_type = Ref::borrow(ndarray_type);
  if (ndarray_copy != Py_None) n.ndarray_copy = Ref::borrow(ndarray_copy);

  PyObject* n_leaves_obj = guard::Compiler::at(program, 0);
  const int64_t n_leaves = guard::Compiler::integer(n_leaves_obj);
  TORCH_CHECK(n_leaves >= 0, "PlanGuard: bad leaf count");
  leaves_.assign(static_cast<size_t>(n_leaves), nullptr);
  tensor_nodes_.assign(static_cast<size_t>(n_slots), nullptr);
  Ref collections = Ref::steal(PyImport_ImportModule("collections"));
  TORCH_CHECK(collections.get() != nullptr, "PlanGuard: collections does not import");
  Ref defaultdict = Ref::steal(PyObject_GetAttrString(collections.get(), "defaultdict"));
  TORCH_CHECK(defaultdict.get() != nullptr, "PlanGuard: collections.defaultdict is missing");
  guard::Compiler comp{&leaves_, &tensor_nodes_, n_slots, defaultdict.get()};
  root_ = comp.node(guard::Compiler::at(program, 1));
  for (int64_t s = 0; s < n_slots; ++s) {
    TORCH_CHECK(tensor_nodes_[s] != nullptr, "PlanGuard: slot ", s, " has no node");
  }
  // (a leaf may have no node: the parameter indices of an optimizer's groups are fixed by the
  // parameters' identities, which are checked instead)
  for (int64_t s = 0; s < n_slots; ++s) {
    auto* t = static_cast<guard::TensorNode*>(tensor_nodes_[s]);
    if (alias_of_[s] >= 0) {
      auto* a = static_cast<guard::TensorNode*>(tensor_nodes_[alias_of_[s]]);
      TORCH_CHECK(t->ptr != 0 && t->ptr == a->ptr && same_view(*t, *a),
                  "PlanGuard: tied slot ", s, " is not the same view as slot ", alias_of_[s]);
    } else if (t->numel > 0) {
      recorded_ptrs_.emplace_back(t->ptr, s);
    }
  }
  std::sort(recorded_ptrs_.begin(), recorded_ptrs_.end());
}

PlanGuard::~PlanGuard() = default;

bool PlanGuard::check_aliases(Ctx& c) const {
  const auto n_slots = slot_layout_.size();
  std::vector<std::pair<uintptr_t, int64_t>> moved;  // stored slots not where they were recorded
  for (size_t s = 0; s < n_slots; ++s) {
    const auto* node = static_cast<const guard::TensorNode*>(tensor_nodes_[s]);
    if (node->numel == 0) continue;
    const auto ptr = reinterpret_cast<uintptr_t>(c.sources[s].from);
    if (alias_of_[s] >= 0) {
      const auto target = reinterpret_cast<uintptr_t>(c.sources[alias_of_[s]].from);
      if (ptr != target) return c.fail("tied tensors no longer share their memory, slot", static_cast<int64_t>(s));
    } else if (ptr != node->ptr) {
      moved.emplace_back(ptr, static_cast<int64_t>(s));
    }
  }
  if (moved.empty()) return true;
  // A moved tensor must not now be the same view as another stored one:
  // against those still where they were recorded (pairwise distinct then) ...
  for (const auto& [ptr, s] : moved) {
    const auto* node = static_cast<const guard::TensorNode*>(tensor_nodes_[s]);
    auto it = std::lower_bound(recorded_ptrs_.begin(), recorded_ptrs_.end(), std::make_pair(ptr, int64_t{-1}));
    for (; it != recorded_ptrs_.end() && it->first == ptr; ++it) {
      const int64_t u = it->second;
      const auto* other = static_cast<const guard::TensorNode*>(tensor_nodes_[u]);
      const bool u_in_place = reinterpret_cast<uintptr_t>(c.sources[u].from) == other->ptr;
      if (u != s && u_in_place && same_view(*node, *other)) {
        return c.fail("two tensors became the same view of one memory, slot", s);
      }
    }
  }
  // ... and against each other.
  std::sort(moved.begin(), moved.end());
  for (size_t i = 0; i < moved.size(); ++i) {
    for (size_t j = i + 1; j < moved.size() && moved[j].first == moved[i].first; ++j) {
      if (same_view(*static_cast<const guard::TensorNode*>(tensor_nodes_[moved[i].second]),
                    *static_cast<const guard::TensorNode*>(tensor_nodes_[moved[j].second]))) {
        return c.fail("two tensors became the same view of one memory, slot", moved[j].second);
      }
    }
  }
  return true;
}

bool PlanGuard::check(PyObject* root, std::unique_ptr<SourceSet>* sources, std::vector<DirtyLeaf>* dirty) {
  Ctx c(*names_, slot_layout_.size());
  bool hit = false;
  try {
    hit = root_->check(root, c) && check_aliases(c);
  } catch (const std::bad_alloc&) {
    throw;
  } catch (const std::exception&) {
    // c10::Error (a tensor in a state the checks do not expect), or torch's python_error (which
    // holds the Python exception it took): a miss; planning again meets the same problem and
    // reports it properly.
    PyErr_Clear();
    hit = c.fail("a tensor could not be read");
  }
  if (!hit) {
    reason_ = c.reason;
    return false;
  }
  std::vector<at::Tensor> out(offsets_->size());
  std::vector<Source> read(offsets_->size());
  for (size_t s = 0; s < slot_layout_.size(); ++s) {
    if (slot_layout_[s] >= 0) {
      out[slot_layout_[s]] = std::move(c.slots[s]);
      read[slot_layout_[s]] = c.sources[s];
    }
  }
  *sources = std::make_unique<SourceSet>(std::move(out), std::move(read), offsets_);
  dirty->swap(c.dirty);  // the caller owns the references now
  reason_.clear();
  return true;
}

void PlanGuard::commit(const std::vector<std::pair<int64_t, PyObject*>>& leaves) {
  for (const auto& [idx, value] : leaves) {
    TORCH_CHECK(idx >= 0 && idx < static_cast<int64_t>(leaves_.size()) && leaves_[idx] != nullptr,
                "PlanGuard: leaf ", idx, " is not checked");
    static_cast<guard::LeafNode*>(leaves_[idx])->set(value);
  }
}

}  // namespace nebula
