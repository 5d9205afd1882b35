// Tensor metadata through torch's AOTInductor C shim (`aoti_torch_*` in libtorch_cpu): a C ABI
// that torch keeps stable for compiled models, looked up at run time (nothing is linked), so the
// extension still builds and loads without torch's headers and works with any torch release.
// The step plans (step_plan.cpp) read a planned tensor's address, dtype, device, shape and
// contiguity here in a few nanoseconds instead of through its Python attributes.
//
// A handle is a new at::Tensor sharing the tensor's TensorImpl, so it sees every later change of
// that tensor's metadata (`.data` assignment, `resize_`, `t_`) and keeps the tensor alive until
// released. enable(), alloc() and release() need the GIL; meta() and address() are plain reads
// through torch's C functions, which pool threads make while the GIL holder waits for them
// (step_plan.cpp), each on tensors of its own.
#pragma once

#include <Python.h>

#include <cstdint>
#include <string>
#include <vector>

namespace mfa {

struct TensorMeta {
  void* data = nullptr;
  int32_t dtype = -1, device_type = -1, device_index = -1;
  bool contiguous = false;
  int64_t dim = 0;
  const int64_t* sizes = nullptr;  // borrowed from the tensor: dim entries
};

class TensorHandles {
 public:
  // Looks the shim up in the already loaded `libtorch_path` (never loads a second copy) and keeps
  // `alloc` (torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors). True when every function was found.
  static bool enable(const std::string& libtorch_path, PyObject* alloc);
  static void set_active(bool on);  // tests: run the plans' Python-attribute path instead
  static bool active();
  // Handles of the tensors of a Python sequence, appended to `out`; false with nothing appended
  // (and no Python error set) when any element is not a tensor or anything fails.
  static bool alloc(PyObject* tensors, std::vector<void*>& out);
  // False for tensors whose data cannot be addressed (sparse, mkldnn) or on any error.
  static bool meta(void* handle, TensorMeta* out);
  static void release(void* handle);
};

// Releases a batch of handles when it goes out of scope.
class HandleBatch {
 public:
  HandleBatch() = default;
  HandleBatch(const HandleBatch&) = delete;
  HandleBatch& operator=(const HandleBatch&) = delete;
  ~HandleBatch() {
    for (void* h : handles) TensorHandles::release(h);
  }
  std::vector<void*> handles;
};

}  // namespace mfa
