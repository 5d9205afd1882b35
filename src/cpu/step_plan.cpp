// The per-step checks of the optimizer's cached step plans (python/mps_fused_adam/optimizers/step_plan.py).
//
// A plan remembers, for every parameter of a group, what its step looked like when the full
// validation last passed: the param object and its dtype, shape, device and address; its state
// dict, state tensors (Adam's moments) and their addresses; its step count. Each later step only has to prove
// that nothing of that changed and that the new grads fit. The checks read the tensors through
// their ordinary Python attributes (grad, dtype, shape, layout, device, is_contiguous(),
// data_ptr()), called from this loop instead of the interpreter's: the module still never touches
// torch's C++ ABI, and a getter that raises only means "not the planned case" (the caller then
// runs the full validation, which names the parameter and the problem).
#include <Python.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "tensor_handles.h"
#include "thread_pool.h"
#include "torch_openmp.h"

namespace nb = nanobind;
using mfa::HandleBatch;
using mfa::TensorHandles;
using mfa::TensorMeta;

namespace {

// One attribute (a property such as `dtype`, or a method without arguments such as `data_ptr`)
// read the way the interpreter would, minus its lookup: per tensor type, the type's descriptor is
// found once and its C function called directly. A type whose descriptor is of another kind (a
// Python-level override) goes through the ordinary, generic call.
class Accessor {
 public:
  Accessor(const char* name, bool method) : name_(PyUnicode_InternFromString(name)), method_(method) {}

  PyObject* name() const { return name_; }

  // A new reference, or null with a Python error set.
  PyObject* operator()(PyObject* obj) {
    PyTypeObject* tp = Py_TYPE(obj);
    for (int i = 0; i < count_; ++i)
      if (types_[i] == tp) return method_ ? meth_[i](obj, nullptr) : get_[i](obj, closure_[i]);
    if (count_ < kTypes) learn(tp);
    for (int i = 0; i < count_; ++i)
      if (types_[i] == tp) return method_ ? meth_[i](obj, nullptr) : get_[i](obj, closure_[i]);
    return method_ ? PyObject_CallMethodNoArgs(obj, name_) : PyObject_GetAttr(obj, name_);
  }

 private:
  static constexpr int kTypes = 4;

  void learn(PyTypeObject* tp) {
    // A type's attribute lookup hands back the descriptor itself (public API, no private lookup).
    PyObject* d = PyObject_GetAttr(reinterpret_cast<PyObject*>(tp), name_);
    if (d == nullptr) { PyErr_Clear(); return; }
    if (!method_ && Py_IS_TYPE(d, &PyGetSetDescr_Type)) {
      PyGetSetDef* def = reinterpret_cast<PyGetSetDescrObject*>(d)->d_getset;
      if (def->get != nullptr) { get_[count_] = def->get; closure_[count_] = def->closure; add(tp); }
    } else if (method_ && Py_IS_TYPE(d, &PyMethodDescr_Type)) {
      PyMethodDef* def = reinterpret_cast<PyMethodDescrObject*>(d)->d_method;
      if ((def->ml_flags & ~METH_COEXIST) == METH_NOARGS) { meth_[count_] = def->ml_meth; add(tp); }
    }
    Py_DECREF(d);
  }

  void add(PyTypeObject* tp) {
    Py_INCREF(tp);  // kept alive: its address must not come back as another type
    types_[count_++] = tp;
  }

  PyObject* name_;
  bool method_;
  int count_ = 0;
  PyTypeObject* types_[kTypes] = {};
  getter get_[kTypes] = {};
  void* closure_[kTypes] = {};
  PyCFunction meth_[kTypes] = {};
};

struct Names {
  Accessor grad{"grad", false}, dtype{"dtype", false}, shape{"shape", false}, is_cpu{"is_cpu", false},
      is_mps{"is_mps", false}, device{"device", false}, data_ptr{"data_ptr", true},
      is_contiguous{"is_contiguous", true}, numel{"numel", true};
  PyObject* step = PyUnicode_InternFromString("step");
};

// Used with the GIL held only, like everything here.
Names& names() {
  static Names* n = new Names();  // never destroyed: it holds Python objects past interpreter exit
  return *n;
}

// A strong reference that survives copies of the owning vectors.
class Ref {
 public:
  Ref() = default;
  explicit Ref(PyObject* o) : o_(o) { Py_XINCREF(o_); }
  Ref(const Ref& r) : o_(r.o_) { Py_XINCREF(o_); }
  Ref& operator=(Ref r) { std::swap(o_, r.o_); return *this; }
  ~Ref() { Py_XDECREF(o_); }
  PyObject* get() const { return o_; }

 private:
  PyObject* o_ = nullptr;
};

// Every helper returns false on a mismatch or on any Python error (which it clears).
bool attr_is(PyObject* obj, Accessor& a, PyObject* expected) {
  PyObject* r = a(obj);
  if (r == nullptr) { PyErr_Clear(); return false; }
  bool same = r == expected;
  Py_DECREF(r);
  return same;
}

bool attr_eq(PyObject* obj, Accessor& a, PyObject* expected) {
  PyObject* r = a(obj);
  if (r == nullptr) { PyErr_Clear(); return false; }
  int eq = r == expected ? 1 : PyObject_RichCompareBool(r, expected, Py_EQ);
  Py_DECREF(r);
  if (eq < 0) { PyErr_Clear(); return false; }
  return eq == 1;
}

bool attr_u64(PyObject* obj, Accessor& a, uint64_t* out) {
  PyObject* r = a(obj);
  if (r == nullptr) { PyErr_Clear(); return false; }
  if (!PyLong_Check(r)) { Py_DECREF(r); return false; }
  unsigned long long v = PyLong_AsUnsignedLongLong(r);
  Py_DECREF(r);
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) { PyErr_Clear(); return false; }
  *out = v;
  return true;
}

uint64_t to_u64(nb::handle h) { return nb::cast<uint64_t>(h); }

static std::vector<Ref> interned_names(nb::handle names) {
  std::vector<Ref> keys;
  for (nb::handle name : names) {
    PyObject* key = name.ptr();
    if (!PyUnicode_Check(key)) throw std::invalid_argument("GroupPlan: state names are strings");
    Py_INCREF(key);
    PyUnicode_InternInPlace(&key);
    keys.push_back(Ref(key));
    Py_DECREF(key);
  }
  return keys;
}

// One group's plan. Entries are in the order of the kernel calls they feed.
class GroupPlan {
 public:
  // params: the group's param list. state_names: the state keys of the group's state format
  // (contract.RULES' names of the rule, in kernel order). active: tuples (index, param, dtype,
  // shape, device, param address, state dict, state tensors, their addresses, step[, names]), the
  // tensors and addresses as tuples in the order of the entry's state names: `names` where the
  // entry has an 11th field (a param of another state format: an 8-bit optimizer's small tensors
  // keep fp32 moments), else state_names. Each state tensor keeps the dtype and shape it had when
  // planned (the full validation proved them). idle: indices of the params the step skipped:
  // those without a grad, and (index, True) for empty params without state, which are skipped
  // whatever their grad.
  GroupPlan(nb::list params, nb::list state_names, nb::list active, nb::list idle) {
    size_ = PyList_GET_SIZE(params.ptr());
    const std::vector<Ref> group_keys = interned_names(state_names);
    for (nb::handle t : active) {
      if (!nb::isinstance<nb::tuple>(t)) throw std::invalid_argument("GroupPlan: an active entry is a tuple");
      nb::tuple e = nb::borrow<nb::tuple>(t);
      if (e.size() != 10 && e.size() != 11) throw std::invalid_argument("GroupPlan: an active entry has 10 or 11 fields");
      if (!nb::isinstance<nb::tuple>(e[7]) || !nb::isinstance<nb::tuple>(e[8]))
        throw std::invalid_argument("GroupPlan: an entry's state tensors and addresses are tuples");
      Entry x;
      x.keys = e.size() == 11 ? interned_names(e[10]) : group_keys;
      const size_t k = x.keys.size();
      x.sbegin = states_.size();
      x.index = nb::cast<Py_ssize_t>(e[0]);
      x.p = Ref(e[1].ptr()); x.dtype = Ref(e[2].ptr()); x.shape = Ref(e[3].ptr()); x.device = Ref(e[4].ptr());
      x.pptr = to_u64(e[5]);
      x.st = Ref(e[6].ptr());
      nb::tuple tensors = nb::borrow<nb::tuple>(e[7]), addrs = nb::borrow<nb::tuple>(e[8]);
      if (tensors.size() != k || addrs.size() != k)
        throw std::invalid_argument("GroupPlan: an entry has one tensor and one address per state");
      for (size_t j = 0; j < k; ++j) {
        states_.push_back(Ref(tensors[j].ptr()));
        state_addrs_.push_back(to_u64(addrs[j]));
        state_dtypes_.push_back(Ref(nb::getattr(tensors[j], "dtype").ptr()));
        state_shapes_.push_back(Ref(nb::getattr(tensors[j], "shape").ptr()));
      }
      x.step = Ref(e[9].ptr());
      // The device test: a bool property where there is one (no torch.device object to build).
      std::string type = nb::cast<std::string>(nb::getattr(e[4], "type"));
      x.on = type == "cpu" ? &names().is_cpu : type == "mps" ? &names().is_mps : nullptr;
      if (x.index < 0 || x.index >= size_ || PyList_GET_ITEM(params.ptr(), x.index) != x.p.get())
        throw std::invalid_argument("GroupPlan: an entry's index does not point at its param");
      if (!PyDict_Check(x.st.get())) throw std::invalid_argument("GroupPlan: a state is not a dict");
      entries_.push_back(std::move(x));
    }
    for (nb::handle t : idle) {
      bool empty = nb::isinstance<nb::tuple>(t);
      Py_ssize_t i = nb::cast<Py_ssize_t>(empty ? nb::borrow<nb::tuple>(t)[0] : t);
      if (i < 0 || i >= size_) throw std::invalid_argument("GroupPlan: idle index out of range");
      idle_.push_back(Idle{i, Ref(PyList_GET_ITEM(params.ptr(), i)), empty});
    }
    make_handles();
  }

  ~GroupPlan() {
    for (void* h : handles_) TensorHandles::release(h);
  }
  GroupPlan(const GroupPlan&) = delete;
  GroupPlan& operator=(const GroupPlan&) = delete;

  // The param list has its planned length, and each param the step skipped is still in its place
  // and still skipped: without a grad, or empty (and without state: the state snapshot says so).
  bool idle_unchanged(PyObject* plist) const {
    if (PyList_GET_SIZE(plist) != size_) return false;
    Names& n = names();
    for (const Idle& x : idle_) {
      PyObject* p = x.p.get();
      if (PyList_GET_ITEM(plist, x.index) != p) return false;
      if (x.empty) {
        uint64_t numel;
        if (!attr_u64(p, n.numel, &numel) || numel != 0) return false;
        continue;
      }
      PyObject* g = n.grad(p);
      if (g == nullptr) { PyErr_Clear(); return false; }
      bool none = g == Py_None;
      Py_DECREF(g);
      if (!none) return false;  // a grad appeared: a new kind of step, re-plan
    }
    return true;
  }

  // Entry i's state: the same dict entries, the same tensors and, if `metadata` (the shim path
  // reads it in shim_planned() instead), each still at its planned address with its planned dtype
  // and shape, contiguous (an in-place resize_, t_ or unsqueeze_ keeps the object and the
  // address); and the planned step.
  bool state_unchanged(size_t i, bool metadata) const {
    const Entry& e = entries_[i];
    const size_t k = e.keys.size();
    PyObject* st = e.st.get();
    Names& n = names();
    for (size_t j = 0; j < k; ++j) {
      const size_t s = e.sbegin + j;
      PyObject* t = PyDict_GetItemWithError(st, e.keys[j].get());  // borrowed
      if (t != states_[s].get()) { PyErr_Clear(); return false; }
      uint64_t addr = 0;
      if (metadata && (!attr_u64(t, n.data_ptr, &addr) || addr != state_addrs_[s] ||
                       !attr_is(t, n.dtype, state_dtypes_[s].get()) || !attr_eq(t, n.shape, state_shapes_[s].get()) ||
                       !attr_is(t, n.is_contiguous, Py_True)))
        return false;
    }
    PyObject* s = PyDict_GetItemWithError(st, names().step);
    if (s == nullptr) { PyErr_Clear(); return false; }
    int same_step = s == entries_[i].step.get() ? 1 : PyObject_RichCompareBool(s, entries_[i].step.get(), Py_EQ);
    if (same_step != 1) { PyErr_Clear(); return false; }
    return true;
  }

  // True when the plan still describes `params` and every planned param has a grad that fits;
  // then `grads` and `grad_addresses` hold those grads and their addresses, in entry order.
  // Writes nothing else, so a false answer leaves everything as it was.
  bool check(nb::list params, nb::list grads, nb::list grad_addresses, int threads) const {
    const bool ok = !handles_.empty() && TensorHandles::active() ? check_handles(params, grads, grad_addresses, threads)
                                                                 : check_attributes(params, grads, grad_addresses);
    if (!ok) {  // hand back nothing, not the grads read before the mismatch
      if (PyList_SetSlice(grads.ptr(), 0, PyList_GET_SIZE(grads.ptr()), nullptr) != 0 ||
          PyList_SetSlice(grad_addresses.ptr(), 0, PyList_GET_SIZE(grad_addresses.ptr()), nullptr) != 0)
        PyErr_Clear();
    }
    return ok;
  }

  // check() through the tensors' Python attributes.
  bool check_attributes(nb::list params, nb::list grads, nb::list grad_addresses) const {
    Names& n = names();
    PyObject* plist = params.ptr();
    if (!idle_unchanged(plist)) return false;
    for (size_t i = 0; i < entries_.size(); ++i) {
      const Entry& e = entries_[i];
      PyObject* p = e.p.get();
      if (PyList_GET_ITEM(plist, e.index) != p) return false;
      uint64_t addr;
      // The param: nothing that validation looked at may have moved (.data assignment, resize).
      if (!attr_u64(p, n.data_ptr, &addr) || addr != e.pptr) return false;
      if (!attr_is(p, n.dtype, e.dtype.get()) || !attr_eq(p, n.shape, e.shape.get()) ||
          !attr_is(p, n.is_contiguous, Py_True))
        return false;
      // The grad: a new tensor every step, so every property the kernel relies on is read anew.
      PyObject* g = n.grad(p);
      if (g == nullptr) { PyErr_Clear(); return false; }
      // No layout test: data_ptr() raises for sparse and mkldnn tensors (and is_contiguous() is
      // false for sparse COO ones).
      bool ok = g != Py_None && attr_is(g, n.dtype, e.dtype.get()) &&
                (e.on != nullptr ? attr_is(g, *e.on, Py_True) : attr_eq(g, n.device, e.device.get())) &&
                attr_eq(g, n.shape, e.shape.get()) && attr_is(g, n.is_contiguous, Py_True) &&
                attr_u64(g, n.data_ptr, &addr) && addr != 0;  // 0: no memory (a ZeroTensor)
      if (ok) {
        PyObject* a = PyLong_FromUnsignedLongLong(addr);
        ok = a != nullptr && PyList_Append(grads.ptr(), g) == 0 && PyList_Append(grad_addresses.ptr(), a) == 0;
        Py_XDECREF(a);
        if (!ok) PyErr_Clear();
      }
      Py_DECREF(g);
      if (!ok) return false;
      if (!state_unchanged(i, true)) return false;
    }
    return true;
  }

  // Entries [begin, end) took a step: record `step` in their state dicts and in the plan.
  void set_steps(size_t begin, size_t end, nb::handle step) {
    if (begin > end || end > entries_.size()) throw std::out_of_range("GroupPlan.set_steps: bad range");
    Names& n = names();
    for (size_t i = begin; i < end; ++i) {
      if (PyDict_SetItem(entries_[i].st.get(), n.step, step.ptr()) != 0) throw nb::python_error();
      entries_[i].step = Ref(step.ptr());
    }
  }

  size_t size() const { return entries_.size(); }
  bool uses_handles() const { return !handles_.empty(); }

 private:
  struct Planned {  // a tensor's metadata when the plan was made
    int32_t dtype, device_type, device_index;
    std::vector<int64_t> sizes;
  };

  static Planned planned_of(const TensorMeta& m) {
    return Planned{m.dtype, m.device_type, m.device_index, std::vector<int64_t>(m.sizes, m.sizes + m.dim)};
  }

  // Handles of every planned param and state tensor (entry i's param at i + its sbegin, then its
  // states), and each one's metadata as planned (params in planned_, states in planned_states_).
  // None where the shim is unavailable or anything fails: check() then reads the Python attributes.
  void make_handles() {
    if (!TensorHandles::active() || entries_.empty()) return;
    nb::list tensors;
    for (size_t i = 0; i < entries_.size(); ++i) {
      tensors.append(nb::borrow(entries_[i].p.get()));
      for (size_t j = 0; j < entries_[i].keys.size(); ++j) tensors.append(nb::borrow(states_[entries_[i].sbegin + j].get()));
    }
    std::vector<void*> hs;
    if (!TensorHandles::alloc(tensors.ptr(), hs)) return;
    handles_ = std::move(hs);
    if (handles_.size() != entries_.size() + states_.size()) {  // one handle per tensor passed, or none used
      drop_handles();
      return;
    }
    planned_.resize(entries_.size());
    planned_states_.resize(states_.size());
    for (size_t i = 0; i < entries_.size(); ++i) {
      const Entry& e = entries_[i];
      TensorMeta m;
      if (!TensorHandles::meta(handles_[i + e.sbegin], &m) || m.data != reinterpret_cast<void*>(e.pptr) ||
          !m.contiguous) {
        drop_handles();
        return;
      }
      planned_[i] = planned_of(m);
      for (size_t j = 0; j < e.keys.size(); ++j) {
        TensorMeta sm;
        if (!TensorHandles::meta(handles_[i + e.sbegin + 1 + j], &sm) ||
            sm.data != reinterpret_cast<void*>(state_addrs_[e.sbegin + j]) || !sm.contiguous ||
            sm.device_type != m.device_type || sm.device_index != m.device_index) {
          drop_handles();
          return;
        }
        planned_states_[e.sbegin + j] = planned_of(sm);
      }
    }
  }

  void drop_handles() {
    for (void* h : handles_) TensorHandles::release(h);
    handles_.clear();
    planned_.clear();
    planned_states_.clear();
  }

  // The planned tensor's dtype, device and sizes.
  static bool same_as_planned(const TensorMeta& m, const Planned& p) {
    if (m.dtype != p.dtype || m.device_type != p.device_type || m.device_index != p.device_index ||
        m.dim != int64_t(p.sizes.size()))
      return false;
    for (int64_t d = 0; d < m.dim; ++d)
      if (m.sizes[d] != p.sizes[size_t(d)]) return false;
    return true;
  }

  // check() with the planned tensors' metadata read through their handles, and the new grads'
  // through handles made for this call: the same conditions, a few Python calls per tensor
  // instead of about a dozen. The Python part (list, state dicts, grad attributes) runs on the
  // caller, with the GIL. The shim part, mostly cache misses on each tensor's TensorImpl and
  // storage after a kernel pass has flushed the caches, goes to pool threads in large groups:
  // the planned params and states while the caller does the Python part (they do not depend on
  // this step's grads), then the new grads.
  bool check_handles(nb::list params, nb::list grads, nb::list grad_addresses, int threads) const {
    PyObject* plist = params.ptr();
    if (!idle_unchanged(plist)) return false;
    const size_t count = entries_.size();
    // Each pool thread takes at least kShimChunk entries: below that, waking it costs more than
    // its share of the misses.
    constexpr size_t kShimChunk = 128;
    const int parts = int(std::max<size_t>(1, std::min<size_t>(size_t(std::max(threads, 1)), count / kShimChunk)));
    ShimCheck job{this, plist, nb::list(), std::vector<uintptr_t>(count), {}, {}, {}, count, parts, {}};
    job.python_ok = true;
    // On torch's OpenMP threads, thread 0 is the caller, which holds the GIL: it alone touches
    // Python objects. Not on our own pool (macOS, MPS_FUSED_ADAM_POOL=own): its run() holds a
    // lock, and Python code (a finalizer run by an allocation here) may let another thread take
    // the GIL and start a step, which would wait for that lock while holding the GIL.
    if (parts == 1 || !mfa::run_on_torch_openmp(parts, &ShimCheck::run_planned, &job)) {
      job.python_ok = python_reads(plist, job.gs);
      if (!job.python_ok) return false;
      mfa::ThreadPool::instance().run(parts, &ShimCheck::run_chunks, &job);
    }
    if (!job.python_ok || job.failed.load(std::memory_order_relaxed)) return false;
    HandleBatch batch;
    if (!TensorHandles::alloc(job.gs.ptr(), batch.handles) || batch.handles.size() != count) return false;
    job.grad_handles = batch.handles.data();
    if (parts > 1) mfa::ThreadPool::instance().run(parts, &ShimCheck::run_grads, &job);
    else ShimCheck::run_grads(&job, 0);
    if (job.failed.load(std::memory_order_relaxed)) return false;
    for (size_t i = 0; i < count; ++i) {
      PyObject* a = PyLong_FromUnsignedLongLong(job.grad_addrs[i]);
      bool ok = a != nullptr && PyList_Append(grads.ptr(), PyList_GET_ITEM(job.gs.ptr(), i)) == 0 &&
                PyList_Append(grad_addresses.ptr(), a) == 0;
      Py_XDECREF(a);
      if (!ok) { PyErr_Clear(); return false; }
    }
    return true;
  }

  // The Python reads of check_handles(): each entry's param in its place, its state dict as
  // planned, and its grad (appended to `gs`, in entry order). With the GIL.
  bool python_reads(PyObject* plist, nb::list& gs) const {
    Names& n = names();
    for (size_t i = 0; i < entries_.size(); ++i) {
      const Entry& e = entries_[i];
      PyObject* p = e.p.get();
      if (PyList_GET_ITEM(plist, e.index) != p || !state_unchanged(i, /*metadata=*/false)) return false;
      PyObject* g = n.grad(p);
      if (g == nullptr) { PyErr_Clear(); return false; }
      const bool none = g == Py_None;
      if (!none && PyList_Append(gs.ptr(), g) != 0) { Py_DECREF(g); PyErr_Clear(); return false; }
      Py_DECREF(g);
      if (none) return false;
    }
    return true;
  }

  // The shim reads of the planned tensors for entries [begin, end): no Python, so pool threads
  // run it while the caller holds the GIL. Each param and each of its states: nothing that
  // validation looked at may have changed (.data assignment, resize_, t_: address, dtype, device,
  // sizes, contiguity).
  bool shim_planned(size_t begin, size_t end) const {
    for (size_t i = begin; i < end; ++i) {
      const Entry& e = entries_[i];
      TensorMeta m;
      if (!TensorHandles::meta(handles_[i + e.sbegin], &m) || m.data != reinterpret_cast<void*>(e.pptr) ||
          !m.contiguous || !same_as_planned(m, planned_[i]))
        return false;
      for (size_t j = 0; j < e.keys.size(); ++j) {
        const size_t s = e.sbegin + j;
        TensorMeta sm;  // an in-place resize_, t_ or unsqueeze_ keeps the object and the address
        if (!TensorHandles::meta(handles_[i + s + 1], &sm) || reinterpret_cast<uintptr_t>(sm.data) != state_addrs_[s] ||
            !sm.contiguous || !same_as_planned(sm, planned_states_[s]))
          return false;
      }
    }
    return true;
  }

  // The new grads of entries [begin, end), a new tensor every step: every property the kernel
  // relies on. Their handles are released by the caller, with the GIL: in torch 2.13, dropping a
  // tensor's second-to-last C++ reference releases its Python object (c10/util/intrusive_ptr.h).
  bool shim_grads(size_t begin, size_t end, void* const* grad_handles, uintptr_t* grad_addrs) const {
    for (size_t i = begin; i < end; ++i) {
      TensorMeta m;
      if (!TensorHandles::meta(grad_handles[i], &m) || !m.contiguous || !same_as_planned(m, planned_[i]) ||
          m.data == nullptr)  // no memory (a ZeroTensor): the full validation names it
        return false;
      grad_addrs[i] = reinterpret_cast<uintptr_t>(m.data);
    }
    return true;
  }

  struct ShimCheck {
    const GroupPlan* plan;
    PyObject* plist;
    nb::list gs;  // this step's grads, in entry order (thread 0 only)
    std::vector<uintptr_t> grad_addrs;
    std::atomic<bool> failed;
    bool python_ok;
    void* const* grad_handles;
    size_t count;
    int parts;
    // Phase 1: thread 0 (the caller) the Python reads, the others the planned tensors, in chunks
    // taken in turn; thread 0 joins them when its Python part is done.
    static constexpr size_t kChunk = 32;
    std::atomic<size_t> next_chunk;
    void planned_chunks() {
      for (;;) {
        const size_t begin = next_chunk.fetch_add(kChunk, std::memory_order_relaxed);
        if (begin >= count || failed.load(std::memory_order_relaxed)) return;
        if (!plan->shim_planned(begin, std::min(count, begin + kChunk))) failed.store(true, std::memory_order_relaxed);
      }
    }
    static void run_planned(void* ctx, int part) {
      auto* j = static_cast<ShimCheck*>(ctx);
      if (part == 0) {
        j->python_ok = j->plan->python_reads(j->plist, j->gs);
        if (!j->python_ok) j->failed.store(true, std::memory_order_relaxed);  // the others may stop
      }
      j->planned_chunks();
    }
    static void run_chunks(void* ctx, int) { static_cast<ShimCheck*>(ctx)->planned_chunks(); }
    // Phase 2: the grads, split over every thread.
    static void run_grads(void* ctx, int part) {
      auto* j = static_cast<ShimCheck*>(ctx);
      const size_t begin = j->count * size_t(part) / size_t(j->parts), end = j->count * size_t(part + 1) / size_t(j->parts);
      if (!j->plan->shim_grads(begin, end, j->grad_handles, j->grad_addrs.data()))
        j->failed.store(true, std::memory_order_relaxed);
    }
  };

  std::vector<void*> handles_;
  std::vector<Planned> planned_;
  std::vector<Planned> planned_states_;  // as states_

  struct Entry {
    Py_ssize_t index = 0;
    Ref p, dtype, shape, device, st, step;
    std::vector<Ref> keys;  // its state names
    size_t sbegin = 0;      // its state tensors are states_[sbegin, sbegin + keys.size())
    Accessor* on = nullptr;  // is_cpu or is_mps, or null: compare devices
    uint64_t pptr = 0;
  };
  Py_ssize_t size_ = 0;
  std::vector<Entry> entries_;
  std::vector<Ref> states_;           // every entry's state tensors, entry by entry
  std::vector<uint64_t> state_addrs_;  // their addresses
  std::vector<Ref> state_dtypes_, state_shapes_;  // and their dtypes and shapes as planned
  struct Idle {
    Py_ssize_t index;
    Ref p;
    bool empty;
  };
  std::vector<Idle> idle_;
};

// The optimizer's whole `state` dict as it was when the plans were made: its keys and values in
// order. Comparing them walks the dict without hashing a tensor (torch's Tensor.__hash__ runs in
// Python), and notices any param's state dict being replaced, added or removed.
class DictSnapshot {
 public:
  explicit DictSnapshot(nb::dict d) : dict_(d.ptr()) {
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(d.ptr(), &pos, &k, &v)) items_.emplace_back(Ref(k), Ref(v));
  }

  bool unchanged(nb::handle d) const {
    if (d.ptr() != dict_.get() || !PyDict_Check(d.ptr()) || PyDict_GET_SIZE(d.ptr()) != (Py_ssize_t)items_.size())
      return false;
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    size_t i = 0;
    while (PyDict_Next(d.ptr(), &pos, &k, &v)) {
      if (i >= items_.size() || items_[i].first.get() != k || items_[i].second.get() != v) return false;
      ++i;
    }
    return i == items_.size();
  }

 private:
  Ref dict_;
  std::vector<std::pair<Ref, Ref>> items_;
};

}  // namespace

void register_step_plan(nb::module_& m) {
  nb::class_<GroupPlan>(m, "GroupPlan", "One param group's cached step plan (see step_plan.py).")
      .def(nb::init<nb::list, nb::list, nb::list, nb::list>(), nb::arg("params"), nb::arg("state_names"),
           nb::arg("active"), nb::arg("idle"))
      .def("check", &GroupPlan::check, nb::arg("params"), nb::arg("grads"), nb::arg("grad_addresses"),
           nb::arg("threads") = 1,
           "True when nothing planned changed; fills grads and grad_addresses in entry order (emptied\n"
           "when False).\n"
           "`threads`: pool threads that may share the tensor reads of a large group.")
      .def("set_steps", &GroupPlan::set_steps, nb::arg("begin"), nb::arg("end"), nb::arg("step"),
           "Write `step` into the state dicts of entries [begin, end).")
      .def("__len__", &GroupPlan::size)
      .def_prop_ro("uses_handles", &GroupPlan::uses_handles,
                   "Whether check() reads tensors through torch's C shim (tensor_handles.h).");
  m.def("enable_tensor_handles", [](const std::string& libtorch, nb::handle alloc) {
          return TensorHandles::enable(libtorch, alloc.ptr());
        }, nb::arg("libtorch"), nb::arg("alloc"),
        "Find torch's C shim in the loaded libtorch_cpu at `libtorch`; `alloc` is\n"
        "torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors. True when the step plans can use it.");
  m.def("set_tensor_handles_active", &TensorHandles::set_active, nb::arg("on"),
        "Let plans made from now on read tensors through the shim (the default where enabled) or not.");
  nb::class_<DictSnapshot>(m, "DictSnapshot", "A dict's keys and values by identity, in order.")
      .def(nb::init<nb::dict>(), nb::arg("d"))
      .def("unchanged", &DictSnapshot::unchanged, nb::arg("d"),
           "True when `d` is the same dict holding the same keys and values (by identity), in order.");
}
