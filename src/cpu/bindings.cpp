// nanobind module `_cpu`. Tensors arrive as raw host addresses and element counts (taken from
// tensor.data_ptr() in Python), so the module never touches torch's C++ ABI and one wheel serves
// every torch release.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "dispatch.h"
#include "step.h"
#include "thread_pool.h"

namespace nb = nanobind;
using namespace mfa;

void register_step_plan(nb::module_& m);  // step_plan.cpp

namespace {

Combo combo_of(int param_dtype, int state_dtype) {
  // dtype codes: 0 float32, 1 float16, 2 bfloat16 (backends._DTYPE_CODES)
  if (param_dtype == 0 && state_dtype == 0) return Combo::F32_F32;
  if (param_dtype == 1 && state_dtype == 0) return Combo::F16_F32;
  if (param_dtype == 1 && state_dtype == 1) return Combo::F16_F16;
  if (param_dtype == 2 && state_dtype == 0) return Combo::BF16_F32;
  if (param_dtype == 2 && state_dtype == 2) return Combo::BF16_BF16;
  throw std::invalid_argument("unsupported (param dtype, state dtype) codes (" + std::to_string(param_dtype) +
                              ", " + std::to_string(state_dtype) + "); states are float32 or the param dtype");
}

void step(bool floor, nb::list params, nb::list grads, nb::list exp_avgs, nb::list exp_avg_sqs,
          nb::list numels, int param_dtype, int state_dtype, float lr, float beta1, float beta2,
          float omb1, float omb2, float eps, float wd, float bc1, float bc2, int adam_w_mode,
          int maximize, int num_threads) {
  size_t n = nb::len(params);
  if (nb::len(grads) != n || nb::len(exp_avgs) != n || nb::len(exp_avg_sqs) != n || nb::len(numels) != n)
    throw std::invalid_argument("params, grads, exp_avgs, exp_avg_sqs and numels must have the same length");
  Combo combo = combo_of(param_dtype, state_dtype);
  thread_local std::vector<Span> spans;  // reused across steps: no allocation once warmed up
  spans.resize(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t count = nb::cast<int64_t>(numels[i]);
    if (count < 0) throw std::invalid_argument("negative element count");
    spans[i] = Span{reinterpret_cast<void*>(nb::cast<uintptr_t>(params[i])),
                    reinterpret_cast<const void*>(nb::cast<uintptr_t>(grads[i])),
                    reinterpret_cast<void*>(nb::cast<uintptr_t>(exp_avgs[i])),
                    reinterpret_cast<void*>(nb::cast<uintptr_t>(exp_avg_sqs[i])), count};
  }
  const IsaTable& isa = active_isa();
  SpanFn fn = (floor ? isa.floor : isa.adam)[static_cast<int>(combo)];
  Scalars s{lr, beta1, beta2, omb1, omb2, eps, wd, bc1, bc2, adam_w_mode != 0, maximize != 0};
  nb::gil_scoped_release release;
  run_step(spans, fn, s, num_threads);
}

}  // namespace

NB_MODULE(_cpu, m) {
  m.doc() = "The CPU Adam kernel of mps_fused_adam (SIMD C++, persistent thread pool, no OpenMP).";
  m.def("adam_step", [](nb::list p, nb::list g, nb::list ma, nb::list va, nb::list ne, int pd, int sd, float lr,
                        float b1, float b2, float omb1, float omb2, float eps, float wd, float bc1, float bc2,
                        int aw, int mx, int nt) { step(false, p, g, ma, va, ne, pd, sd, lr, b1, b2, omb1, omb2, eps, wd, bc1, bc2, aw, mx, nt); },
        "adam_step(params, grads, exp_avgs, exp_avg_sqs, numels, param_dtype, state_dtype, lr, beta1, beta2, "
        "one_minus_beta1, one_minus_beta2, eps, weight_decay, bc1, bc2, adam_w_mode, maximize, num_threads)\n\n"
        "One Adam step, in place, over tensors given as host addresses (tensor.data_ptr()). "
        "Scalars are contract.kernel_scalars(); the GIL is released while it runs.");
  m.def("memory_floor", [](nb::list p, nb::list g, nb::list ma, nb::list va, nb::list ne, int pd, int sd, float lr,
                           float b1, float b2, float omb1, float omb2, float eps, float wd, float bc1, float bc2,
                           int aw, int mx, int nt) { step(true, p, g, ma, va, ne, pd, sd, lr, b1, b2, omb1, omb2, eps, wd, bc1, bc2, aw, mx, nt); },
        "Same arguments as adam_step; runs Adam's memory access pattern with trivial math (benchmark floor).");
  m.def("simd_path", [] { return std::string(active_isa().name); }, "The SIMD build in use.");
  m.def("simd_paths", [] {
    std::vector<std::string> names;
    for (const auto& t : supported_isas()) names.emplace_back(t.name);
    return names;
  }, "The SIMD builds this CPU can run, best first.");
  m.def("set_simd_path", [](const std::string& name) { set_active_isa(name); }, "Select a SIMD build by name.");
  register_step_plan(m);
  m.def("pool_size", [] { return ThreadPool::instance().size(); }, "Threads in the pool, the caller included.");
}
