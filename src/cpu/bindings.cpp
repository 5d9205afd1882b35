// nanobind module `_cpu`. Tensors arrive as raw host addresses and element counts (taken from
// tensor.data_ptr() in Python), so the module never touches torch's C++ ABI and one wheel serves
// every torch release.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "dispatch.h"
#include "step.h"
#include "thread_pool.h"
#include "zenflow_ctrl.h"
#include "torch_openmp.h"

namespace nb = nanobind;
using namespace mfa;

namespace mfa {
void register_adam8bit(nb::module_& m);  // adam8bit.cpp: the 8-bit block-wise Adam step
void register_adam4bit(nb::module_& m);  // adam4bit.cpp: the 4-bit block-wise Adam step
}
void register_step_plan(nb::module_& m);  // step_plan.cpp

namespace {

Combo combo_of(int param_dtype, int state_dtype, bool sr) {
  // dtype codes: 0 float32, 1 float16, 2 bfloat16 (backends._DTYPE_CODES)
  if (sr && param_dtype == 2 && state_dtype == 0) return Combo::BF16SR_F32;
  if (sr && param_dtype == 2 && state_dtype == 2) return Combo::BF16SR_BF16;
  if (sr) throw std::invalid_argument("stochastic rounding (sr_keys) needs bfloat16 params");
  if (param_dtype == 0 && state_dtype == 0) return Combo::F32_F32;
  if (param_dtype == 1 && state_dtype == 0) return Combo::F16_F32;
  if (param_dtype == 1 && state_dtype == 1) return Combo::F16_F16;
  if (param_dtype == 2 && state_dtype == 0) return Combo::BF16_F32;
  if (param_dtype == 2 && state_dtype == 2) return Combo::BF16_BF16;
  throw std::invalid_argument("unsupported (param dtype, state dtype) codes (" + std::to_string(param_dtype) +
                              ", " + std::to_string(state_dtype) + "); states are float32 or the param dtype");
}

struct RuleInfo {
  const char* name;
  RuleId id;
  int states;
  size_t scalar_bytes;
};
// From the one list of rules (adam_types.h): names as contract.RULES spells them.
constexpr RuleInfo kRules[] = {
#define MFA_RULE_INFO(id, name, functor, scalars, states) {name, RuleId::id, states, sizeof(scalars)},
    MFA_RULES(MFA_RULE_INFO)
#undef MFA_RULE_INFO
};

const RuleInfo& rule_info(const std::string& name) {
  for (const RuleInfo& r : kRules)
    if (name == r.name) return r;
  std::string known;
  for (const RuleInfo& r : kRules) known += std::string(known.empty() ? "" : ", ") + r.name;
  throw std::invalid_argument("unknown update rule '" + name + "'; the CPU kernel has: " + known);
}

// A list item that must be a plain int (an address, a count, a key): exact ints only, so that no
// Python code (an __index__) runs while the lists are read, and none can change them under us.
uint64_t exact_u64(PyObject* o, const char* what) {
  if (!PyLong_CheckExact(o)) throw nb::type_error((std::string(what) + " must be plain ints").c_str());
  unsigned long long v = PyLong_AsUnsignedLongLong(o);
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) throw nb::python_error();
  return v;
}

int64_t exact_i64(PyObject* o, const char* what) {
  if (!PyLong_CheckExact(o)) throw nb::type_error((std::string(what) + " must be plain ints").c_str());
  long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) throw nb::python_error();
  return v;
}

// One step of `rule` over tensors given as host addresses; `states` holds one list of addresses
// per state of the rule; `scalars` is the rule's scalar struct (contract.Rule.pack).
void step(const std::string& rule, nb::list params, nb::list grads, nb::list states, nb::list numels,
          int param_dtype, int state_dtype, nb::bytes scalars, int num_threads, nb::object sr_keys) {
  const bool sr = !sr_keys.is_none();
  const RuleInfo& info = rule_info(rule);
  size_t n = nb::len(params);
  if (nb::len(states) != size_t(info.states))
    throw std::invalid_argument("rule '" + rule + "' has " + std::to_string(info.states) + " states; got " +
                                std::to_string(nb::len(states)) + " state lists");
  nb::list state_lists[kMaxStates];
  for (int k = 0; k < info.states; ++k) {
    state_lists[k] = nb::cast<nb::list>(states[k]);
    if (nb::len(state_lists[k]) != n)
      throw std::invalid_argument("params, grads, every state list and numels must have the same length");
  }
  if (nb::len(grads) != n || nb::len(numels) != n)
    throw std::invalid_argument("params, grads, every state list and numels must have the same length");
  if (scalars.size() != info.scalar_bytes)
    throw std::invalid_argument("rule '" + rule + "' takes a " + std::to_string(info.scalar_bytes) +
                                "-byte scalar struct; got " + std::to_string(scalars.size()) + " bytes");
  Combo combo = combo_of(param_dtype, state_dtype, sr);
  nb::list keys;
  if (sr) {
    keys = nb::cast<nb::list>(sr_keys);
    if (nb::len(keys) != n) throw std::invalid_argument("sr_keys must have one key per param");
  }
  thread_local std::vector<Span> spans;  // reused across steps: no allocation once warmed up
  spans.resize(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t count = exact_i64(PyList_GET_ITEM(numels.ptr(), i), "numels");
    if (count < 0) throw std::invalid_argument("negative element count");
    Span& sp = spans[i];
    sp.param = reinterpret_cast<void*>(exact_u64(PyList_GET_ITEM(params.ptr(), i), "addresses"));
    sp.grad = reinterpret_cast<const void*>(exact_u64(PyList_GET_ITEM(grads.ptr(), i), "addresses"));
    bool null = sp.param == nullptr || sp.grad == nullptr;
    for (int k = 0; k < kMaxStates; ++k) {
      sp.state[k] = k < info.states
          ? reinterpret_cast<void*>(exact_u64(PyList_GET_ITEM(state_lists[k].ptr(), i), "addresses")) : nullptr;
      null = null || (k < info.states && sp.state[k] == nullptr);
    }
    // A tensor without memory (torch's ZeroTensor has address 0): refused, not dereferenced.
    if (null && count > 0) throw std::invalid_argument("tensor " + std::to_string(i) + " has address 0");
    sp.n = count;
    if (sr) {
      uint64_t key = exact_u64(PyList_GET_ITEM(keys.ptr(), i), "sr_keys");
      if (key > 0xffffffffu) throw std::invalid_argument("sr_keys are 32-bit");
      sp.sr_key = static_cast<uint32_t>(key);
    } else {
      sp.sr_key = 0u;
    }
  }
  // An aligned copy: the rules read the struct as floats and ints.
  alignas(16) unsigned char blob[256];
#define MFA_FITS(id, name, functor, scalars, states) static_assert(sizeof(scalars) <= sizeof(blob), name);
  MFA_RULES(MFA_FITS)
#undef MFA_FITS
  std::memcpy(blob, scalars.c_str(), scalars.size());
  SpanFn fn = active_isa().fn[static_cast<int>(info.id)][static_cast<int>(combo)];
  nb::gil_scoped_release release;
  run_step(spans, fn, blob, num_threads);
}

// ZenFlow's control block (zenflow_ctrl.h). Everything that can block releases the GIL, as
// DeepSpeed's bindings do, so the training thread keeps running while the optimizer process works.
void register_zenflow(nb::module_& m) {
  namespace zf = mfa::zenflow;
  m.def("zenflow_supported", &zf::supported, "Whether ZenFlow's cross-process control block exists here (Linux).");
  m.def("zenflow_ctrl_size", &zf::ctrl_size);
  m.def("zenflow_ctrl_init", &zf::ctrl_init, nb::arg("ctrl"), nb::arg("num_groups"));
  m.def("zenflow_submit", &zf::submit, nb::call_guard<nb::gil_scoped_release>());
  m.def("zenflow_wait", &zf::wait_done, nb::arg("ctrl"), nb::arg("timeout_s"), nb::call_guard<nb::gil_scoped_release>());
  m.def("zenflow_ctrl_exit", &zf::ctrl_exit, nb::call_guard<nb::gil_scoped_release>());
  m.def("zenflow_wait_command", [](uintptr_t ctrl) {
    zf::Command c;
    {
      nb::gil_scoped_release release;
      c = zf::wait_command(ctrl);
    }
    return nb::make_tuple(c.cmd == zf::kCmdExit, c.now_state, c.step, c.hp, c.bias_correction);
  }, "Optimizer process: block until the next command; (exit, now_state, step, hp, bias_correction), hp holding "
     "lr, beta1, beta2, eps, weight_decay per group.");
  m.def("zenflow_post_done", &zf::post_done);
  m.def("zenflow_steps_done", &zf::steps_done);
  m.def("zenflow_backend", &zf::backend_name);
}

}  // namespace

NB_MODULE(_cpu, m) {
  m.doc() = "The CPU optimizer kernels of mps_fused_adam (SIMD C++, persistent thread pool, no OpenMP).";
  // A step plan (GroupPlan, DictSnapshot) lives as long as its optimizer, and an optimizer that
  // autograd hooks hold (PyTorch's optimizer-in-backward pattern) is still alive when the
  // interpreter tears this module down: nanobind then printed "leaked N instances ... likely a
  // reference counting issue" at the exit of a correct program. Reference counts are tested
  // directly instead (tests/test_step_plan.py).
  nb::set_leak_warnings(false);
  m.def("step", &step, nb::arg("rule"), nb::arg("params"), nb::arg("grads"), nb::arg("states"),
        nb::arg("numels"), nb::arg("param_dtype"), nb::arg("state_dtype"), nb::arg("scalars"),
        nb::arg("num_threads"), nb::arg("sr_keys") = nb::none(),
        "One step of update rule `rule` (contract.RULES, or 'floor': the benchmark's memory floor), in\n"
        "place, over tensors given as host addresses (tensor.data_ptr()): `states` holds one address\n"
        "list per state; `scalars` is contract.Rule.pack(hyper); `sr_keys` (bf16 params only): one\n"
        "lowbit.sr_key per param, storing the params by stochastic rounding. The GIL is released.");
  m.def("rules", [] {
    std::vector<std::string> names;
    for (const RuleInfo& r : kRules) names.emplace_back(r.name);
    return names;
  }, "The update rules this build has.");
  m.def("simd_path", [] { return std::string(active_isa().name); }, "The SIMD build in use.");
  m.def("simd_paths", [] {
    std::vector<std::string> names;
    for (const auto& t : supported_isas()) names.emplace_back(t.name);
    return names;
  }, "The SIMD builds this CPU can run, best first.");
  m.def("set_simd_path", [](const std::string& name) { set_active_isa(name); }, "Select a SIMD build by name.");
  m.def("prefetch_bytes", [](int param_size, int state_size) { return prefetch_bytes(param_size, state_size); },
        nb::arg("param_size"), nb::arg("state_size"),
        "How far ahead (bytes) the kernel prefetches each stream for params and states of these\n"
        "element sizes (4: fp32, 2: fp16/bf16); 0: the hardware prefetchers alone.");
  m.def("set_prefetch_bytes", [](std::optional<int> bytes) { set_prefetch_bytes(bytes ? *bytes : -1); },
        nb::arg("bytes").none(),
        "One prefetch distance (0 to 65536 bytes) for every dtype, or None: the per-vendor choice.");
  m.def("far_prefetch_bytes",
        [](int param_size, int state_size) { return far_prefetch_bytes(param_size, state_size); },
        nb::arg("param_size"), nb::arg("state_size"),
        "How far ahead (bytes) the kernel's second prefetch of each stream brings lines into L2 for\n"
        "params and states of these element sizes; 0: no second prefetch.");
  m.def("set_far_prefetch_bytes", [](std::optional<int> bytes) { set_far_prefetch_bytes(bytes ? *bytes : -1); },
        nb::arg("bytes").none(),
        "One far prefetch distance (0 to 1048576 bytes, 0: none) for every dtype, or None: the\n"
        "per-vendor choice.");
  m.def("bf16_pairs", [] { return bf16_pairs(); },
        "Whether the x86 kernels take bf16 params and states as even and odd lanes (the default).");
  m.def("set_bf16_pairs", [](bool on) { set_bf16_pairs(on); }, nb::arg("on"),
        "Turn the bf16 even/odd-lane loads off or on again; no bit changes, only the speed\n"
        "(measured both ways in one process: diag_bf16_pairs.py, docs/experiments.md).");
  m.def("q8_permute_dequant", [] { return q8_permute_dequant(); },
        "Whether the 8-bit kernel dequantizes blocks by byte permutes where the SIMD path has them\n"
        "(AVX512_VBMI: the avx512bf16 path; the default), not by a gather per vector.");
  m.def("set_q8_permute_dequant", [](bool on) { set_q8_permute_dequant(on); }, nb::arg("on"),
        "Turn the 8-bit kernel's permute dequantization off or on again; no bit changes, only the\n"
        "speed (measured both ways in one process: diag_q8_dequant.py, docs/experiments.md).");
  register_adam8bit(m);
  register_adam4bit(m);
  register_step_plan(m);
  m.def("pool_size", [] { return ThreadPool::instance().size(); }, "Threads in the pool, the caller included.");
  m.def("pin_pool", [](const std::vector<int>& cores, bool one_per_thread) {
    return ThreadPool::instance().pin(cores, one_per_thread);
  }, "pin_pool(cores, one_per_thread): pin the pool's threads, the calling thread as thread 0 (Linux; "
     "False where the platform cannot pin or a core was refused).");
  m.def("thread_cores", [] { return current_thread_cores(); }, "The cores the calling thread may run on (Linux).");
  register_zenflow(m);
  m.def("thread_pool", [] {
    std::string path = torch_openmp_path();
    return torch_openmp_enabled() ? "torch's OpenMP (" + path + ")" : std::string("own");
  }, "Whose threads run a step: torch's OpenMP runtime (borrowed, not linked) or our own pool.");
  m.def("use_torch_openmp", [](bool on) { set_torch_openmp(on); },
        "Run steps on torch's OpenMP threads where available (default), or on our own pool.");
}
