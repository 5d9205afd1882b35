#include "tensor_handles.h"

#if defined(__linux__) || defined(__APPLE__)
#include <dlfcn.h>
#define MFA_HAVE_DLFCN 1
#endif

namespace mfa {
namespace {

using Handle = void*;
using Err = int32_t;  // AOTITorchError: 0 is success

struct Shim {
  Err (*data_ptr)(Handle, void**) = nullptr;
  Err (*dtype)(Handle, int32_t*) = nullptr;
  Err (*device_type)(Handle, int32_t*) = nullptr;
  Err (*device_index)(Handle, int32_t*) = nullptr;
  Err (*dim)(Handle, int64_t*) = nullptr;
  Err (*sizes)(Handle, int64_t**) = nullptr;
  Err (*is_contiguous)(Handle, bool*) = nullptr;
  Err (*layout)(Handle, int32_t*) = nullptr;
  int32_t strided = 0;  // aoti_torch_layout_strided()
  Err (*del)(Handle) = nullptr;
  PyObject* alloc = nullptr;  // strong reference, never released (interpreter lifetime)
  bool found = false;
  bool active = true;
};

Shim& shim() {
  static Shim s;
  return s;
}

template <class F>
bool lookup(void* lib, const char* name, F*& fn) {
#if MFA_HAVE_DLFCN
  fn = reinterpret_cast<F*>(dlsym(lib, name));
#else
  (void)lib;
  (void)name;
  fn = nullptr;
#endif
  return fn != nullptr;
}

}  // namespace

bool TensorHandles::enable(const std::string& libtorch_path, PyObject* alloc) {
  Shim& s = shim();
  if (s.found) return true;
#if MFA_HAVE_DLFCN
  void* lib = dlopen(libtorch_path.c_str(), RTLD_LAZY | RTLD_NOLOAD);
  if (lib == nullptr || !PyCallable_Check(alloc)) return false;
  bool ok = lookup(lib, "aoti_torch_get_data_ptr", s.data_ptr) && lookup(lib, "aoti_torch_get_dtype", s.dtype) &&
            lookup(lib, "aoti_torch_get_device_type", s.device_type) &&
            lookup(lib, "aoti_torch_get_device_index", s.device_index) && lookup(lib, "aoti_torch_get_dim", s.dim) &&
            lookup(lib, "aoti_torch_get_sizes", s.sizes) && lookup(lib, "aoti_torch_is_contiguous", s.is_contiguous) &&
            lookup(lib, "aoti_torch_delete_tensor_object", s.del) && lookup(lib, "aoti_torch_get_layout", s.layout);
  int32_t (*strided)() = nullptr;
  if (!ok || !lookup(lib, "aoti_torch_layout_strided", strided)) return false;
  s.strided = strided();
  Py_INCREF(alloc);
  s.alloc = alloc;
  s.found = true;
  return true;
#else
  (void)libtorch_path;
  (void)alloc;
  return false;
#endif
}

void TensorHandles::set_active(bool on) { shim().active = on; }

bool TensorHandles::active() { return shim().found && shim().active; }

bool TensorHandles::alloc(PyObject* tensors, std::vector<void*>& out) {
  Shim& s = shim();
  PyObject* caps = PyObject_CallOneArg(s.alloc, tensors);  // TypeError for a non-tensor element
  if (caps == nullptr) {
    PyErr_Clear();
    return false;
  }
  const size_t start = out.size();
  bool ok = PyList_Check(caps);
  for (Py_ssize_t i = 0; ok && i < PyList_GET_SIZE(caps); ++i) {
    void* h = PyCapsule_GetPointer(PyList_GET_ITEM(caps, i), nullptr);  // the capsules own nothing
    if (h == nullptr) ok = false;
    else out.push_back(h);
  }
  Py_DECREF(caps);
  if (!ok) {
    PyErr_Clear();
    for (size_t i = start; i < out.size(); ++i) release(out[i]);
    out.resize(start);
  }
  return ok;
}

bool TensorHandles::meta(void* h, TensorMeta* m) {
  Shim& s = shim();
  int64_t* sizes = nullptr;
  int32_t layout = -1;
  // The layout first: asking a sparse or mkldnn tensor for its data pointer raises inside torch.
  if (s.layout(h, &layout) || layout != s.strided) return false;
  if (s.data_ptr(h, &m->data) || s.dtype(h, &m->dtype) || s.device_type(h, &m->device_type) ||
      s.device_index(h, &m->device_index) || s.dim(h, &m->dim) || s.sizes(h, &sizes) ||
      s.is_contiguous(h, &m->contiguous))
    return false;
  m->sizes = sizes;
  return true;
}

void TensorHandles::release(void* h) {
  if (h != nullptr) shim().del(h);
}

}  // namespace mfa
