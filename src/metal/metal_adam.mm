// The `_metal` extension: runs fused_adam.metallib's kernels on PyTorch's MPS stream, knowing
// nothing of any update rule. load(metallib_path, kernel_names) loads the library and builds each
// named kernel's pipeline once, and returns {name: Metal's error} for those that failed (a device
// without bfloat fails only the bfloat kernels; the caller runs those elsewhere).
// step(kernel_name, tensors, scalars) encodes a group into one compute
// encoder on PyTorch's command buffer, on PyTorch's queue, without waiting for the GPU: tensors =
// [params, grads, state lists...], each tensor a (MTLBuffer handle, byte offset, numel) triple;
// list k binds to buffer k, then the scalar blob (the rule's struct), base and n. Stream: torch's
// default up to 2.14, the caller's current from 2.15 (HOOKS_CURRENT_STREAM_MIN_TORCH). Caller:
// backends/mps.py; stand-in: tests/support/emulated_mps.py. Untested on Apple hardware (checks:
// tests/test_apple_artifacts.py).
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <dlfcn.h>
#include <mach-o/dyld.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace nb = nanobind;

namespace {

// torch/mps.h (2.13): MTLCommandBuffer_t (= id<MTLCommandBuffer>) get_command_buffer(),
// DispatchQueue_t (= dispatch_queue_t) get_dispatch_queue() (not commit(): see step()). No torch
// at build time: looked up by their version-free C++ names in the libtorch `import torch` loaded.
struct TorchMps {
  id<MTLCommandBuffer> (*get_command_buffer)();
  dispatch_queue_t (*get_dispatch_queue)();
};
TorchMps g_torch;

constexpr uint64_t kElemsPerThread = 4;
constexpr uint64_t kMaxThreadsPerDispatch = uint64_t(1) << 30;  // see backends/mps.py
constexpr NSUInteger kGroupSize = 256;
constexpr size_t kMaxLists = 8;        // param, grad and up to 6 states
constexpr size_t kMaxScalarBytes = 4096;  // setBytes' limit

struct TensorRef {
  uintptr_t buffer[kMaxLists];  // id<MTLBuffer> as an integer
  uint64_t offset[kMaxLists];   // bytes
  uint64_t numel;
};

std::mutex g_load_mutex;
bool g_loaded = false;
std::unordered_map<std::string, id<MTLComputePipelineState>> g_pipelines;  // by host name
std::map<std::string, std::string> g_failed;  // host name -> why its pipeline was not built

std::string describe(const std::string& what, NSError* error) {
  std::string msg = "mps_fused_adam._metal: " + what;
  if (error != nil) {
    msg += ": ";
    msg += error.localizedDescription.UTF8String;
  }
  return msg;
}

[[noreturn]] void fail(const std::string& what, NSError* error) {
  throw std::runtime_error(describe(what, error));
}

template <typename Fn>
Fn torch_symbol(void* libtorch, const char* name) {
  void* sym = dlsym(libtorch, name);
  if (sym == nullptr) {
    fail(std::string("libtorch lacks ") + name + " (a torch build without MPS?)", nil);
  }
  return reinterpret_cast<Fn>(sym);
}

// The libtorch_cpu that `import torch` loaded, found among the process's images by name and
// opened with RTLD_NOLOAD, so a second copy can never be loaded.
void* loaded_libtorch() {
  static const char kName[] = "/libtorch_cpu.dylib";
  for (uint32_t i = 0; i < _dyld_image_count(); ++i) {
    const char* image = _dyld_get_image_name(i);  // NULL while images are being added/removed
    const size_t len = image != nullptr ? std::strlen(image) : 0;
    if (len >= sizeof kName - 1 && std::strcmp(image + len - (sizeof kName - 1), kName) == 0) {
      return dlopen(image, RTLD_LAZY | RTLD_NOLOAD);
    }
  }
  return nullptr;
}

std::map<std::string, std::string> load(const std::string& path, const std::vector<std::string>& kernel_names) {
  std::lock_guard<std::mutex> lock(g_load_mutex);
  if (g_loaded) {
    return g_failed;
  }
  void* libtorch = loaded_libtorch();
  if (libtorch == nullptr) {
    fail("libtorch_cpu is not loaded (import torch first)", nil);
  }
  g_torch.get_command_buffer = torch_symbol<id<MTLCommandBuffer> (*)()>(
      libtorch, "_ZN5torch3mps18get_command_bufferEv");
  g_torch.get_dispatch_queue = torch_symbol<dispatch_queue_t (*)()>(
      libtorch, "_ZN5torch3mps18get_dispatch_queueEv");
  @autoreleasepool {
    // PyTorch's own device (it picks among MTLCopyAllDevices; MTLCreateSystemDefaultDevice may be
    // nil without CoreGraphics): that of its command buffer, read on its queue.
    __block id<MTLDevice> device = nil;
    dispatch_sync(g_torch.get_dispatch_queue(), ^{ device = g_torch.get_command_buffer().device; });
    if (device == nil) fail("PyTorch's MPS command buffer has no device", nil);
    NSError* error = nil;
    NSURL* url = [NSURL fileURLWithPath:[NSString stringWithUTF8String:path.c_str()]];
    id<MTLLibrary> library = [device newLibraryWithURL:url error:&error];
    if (library == nil) {
      fail("cannot load " + path, error);
    }
    // One kernel at a time: a pipeline that fails costs that kernel only.
    for (const std::string& name : kernel_names) {
      id<MTLFunction> fn = [library newFunctionWithName:[NSString stringWithUTF8String:name.c_str()]];
      if (fn == nil) {
        g_failed[name] = describe(path + " has no kernel " + name, nil);
        continue;
      }
      error = nil;
      id<MTLComputePipelineState> pso = [device newComputePipelineStateWithFunction:fn error:&error];
      if (pso == nil) {
        g_failed[name] = describe("cannot build the pipeline of " + name, error);
        continue;
      }
      g_pipelines[name] = pso;
    }
    g_loaded = true;
  }
  return g_failed;
}

// Field k of the (handle, byte offset, numel) tuple at list[i], read with borrowed references.
uint64_t field(nb::list list, size_t i, Py_ssize_t k) {
  PyObject* triple = PyList_GET_ITEM(list.ptr(), static_cast<Py_ssize_t>(i));
  if (!PyTuple_Check(triple) || PyTuple_GET_SIZE(triple) != 3) {
    throw std::invalid_argument("mps_fused_adam._metal: expected (handle, byte offset, numel) tuples");
  }
  return nb::cast<uint64_t>(nb::handle(PyTuple_GET_ITEM(triple, k)));
}

void step(const std::string& kernel_name, nb::list tensors, nb::bytes scalars) {
  if (!g_loaded) {
    throw std::runtime_error("mps_fused_adam._metal: load() has not been called");
  }
  const auto found = g_pipelines.find(kernel_name);
  if (found == g_pipelines.end()) {
    throw std::invalid_argument("mps_fused_adam._metal: no kernel " + kernel_name + " was loaded");
  }
  const size_t lists = tensors.size();
  if (lists < 2 || lists > kMaxLists || scalars.size() == 0 || scalars.size() > kMaxScalarBytes) {
    throw std::invalid_argument("mps_fused_adam._metal: expected 2 to 8 tensor lists and 1 to 4096 scalar bytes");
  }
  nb::list by_list[kMaxLists];
  for (size_t k = 0; k < lists; ++k) {
    by_list[k] = nb::cast<nb::list>(tensors[k]);
    if (by_list[k].size() != by_list[0].size()) {
      throw std::invalid_argument("mps_fused_adam._metal: tensor lists differ in length");
    }
  }
  const size_t count = by_list[0].size();
  std::vector<unsigned char> blob(scalars.c_str(), scalars.c_str() + scalars.size());

  // Unpacked while holding the GIL; the buffer only grows, so steady-state steps allocate nothing.
  static thread_local std::vector<TensorRef> refs;
  refs.resize(count);
  for (size_t i = 0; i < count; ++i) {
    TensorRef& r = refs[i];
    r.numel = field(by_list[0], i, 2);
    for (size_t k = 0; k < lists; ++k) {
      r.buffer[k] = static_cast<uintptr_t>(field(by_list[k], i, 0));
      r.offset[k] = field(by_list[k], i, 1);
      if (field(by_list[k], i, 2) != r.numel) {
        throw std::invalid_argument("mps_fused_adam._metal: tensor sizes differ within a parameter");
      }
    }
  }

  // The block runs on PyTorch's queue thread: it captures plain values, never Python objects.
  const TensorRef* data = refs.data();
  id<MTLComputePipelineState> pso = found->second;
  const unsigned char* hp = blob.data();
  const NSUInteger hp_len = blob.size();
  const NSUInteger group = std::min<NSUInteger>(kGroupSize, pso.maxTotalThreadsPerThreadgroup);
  nb::gil_scoped_release no_gil;
  dispatch_queue_t queue = g_torch.get_dispatch_queue();  // this thread's stream (torch >= 2.15)
  __block bool other_stream = false;
  dispatch_sync(queue, ^{
    @autoreleasepool {
      // torch >= 2.15: a thread-local stream, and get_command_buffer() aborts off its queue; were
      // this block run on another thread (another stream), encode nothing and say so below.
      if ((other_stream = g_torch.get_dispatch_queue() != queue)) return;
      // Inside the queue: get_command_buffer() first closes PyTorch's own open encoder.
      id<MTLComputeCommandEncoder> encoder = [g_torch.get_command_buffer() computeCommandEncoder];
      [encoder setComputePipelineState:pso];
      [encoder setBytes:hp length:hp_len atIndex:lists];
      for (size_t i = 0; i < count; ++i) {
        const TensorRef& r = data[i];
        for (NSUInteger k = 0; k < lists; ++k) {
          [encoder setBuffer:(__bridge id<MTLBuffer>)reinterpret_cast<void*>(r.buffer[k])
                      offset:r.offset[k]
                     atIndex:k];
        }
        [encoder setBytes:&r.numel length:sizeof r.numel atIndex:lists + 2];
        for (uint64_t base = 0; base < r.numel; base += kMaxThreadsPerDispatch * kElemsPerThread) {
          const uint64_t elems = std::min(kMaxThreadsPerDispatch * kElemsPerThread, r.numel - base);
          const NSUInteger threads = (elems + kElemsPerThread - 1) / kElemsPerThread;
          [encoder setBytes:&base length:sizeof base atIndex:lists + 1];
          [encoder dispatchThreads:MTLSizeMake(threads, 1, 1)
             threadsPerThreadgroup:MTLSizeMake(std::min(group, threads), 1, 1)];
        }
      }
      [encoder endEncoding];
      // No commit, as PyTorch's own fused Adam: PyTorch commits its buffer at its next sync point,
      // and later work on the stream is ordered after ours; a commit adds no ordering, only a
      // command buffer per group (docs/torch-releases.md).
    }
  });
  if (other_stream) {
    throw std::runtime_error("mps_fused_adam._metal: PyTorch's queue ran the step on a thread of another MPS "
                             "stream; nothing was encoded");
  }
}

}  // namespace

NB_MODULE(_metal, m) {
  m.doc() = "Fused optimizer Metal kernels dispatched on PyTorch's MPS stream";
  m.def("load", &load, nb::arg("metallib_path"), nb::arg("kernel_names"));
  m.def("step", &step, nb::arg("kernel_name"), nb::arg("tensors"), nb::arg("scalars"));
}
