// 8-bit block-wise Adam (contract: python/mps_fused_adam/lowbit.py, reference_lowbit.py) on the
// CPU, optionally with bf16 stochastic rounding of the parameter: the driver. The block math is
// adam8bit_kernel.h, built per SIMD path like the span loop and chosen with it (dispatch.h).
//
// The block (256 elements, one fp32 scale per moment) is the unit of work: a thread owns whole
// blocks, so the new scale of a block is known before any of its codes is written.
#include <nanobind/nanobind.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam_types.h"
#include "dispatch.h"
#include "q8_tables.h"
#include "thread_pool.h"

namespace mfa {
namespace {

namespace nb = nanobind;

// The maps are lowbit's two fixed ones; their tables are built once per distinct content.
const Q8Tables& tables_for(const float* values, const float* mids) {
  static std::mutex mu;
  static std::vector<std::unique_ptr<Q8Tables>> cache;
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& t : cache)
    if (!std::memcmp(t->values.data(), values, kCodes * 4) && !std::memcmp(t->mid.data(), mids, (kCodes - 1) * 4))
      return *t;
  cache.push_back(build_q8_tables(values, mids));
  return *cache.back();
}

struct Job {
  Q8Job q;
  Q8Fn fn;
  int64_t blocks;
  int threads;
};

void run_range(void* ctx, int t) {
  const Job& job = *static_cast<const Job*>(ctx);
  // Whole blocks per thread: [blocks * t / T, blocks * (t + 1) / T).
  job.fn(job.q, job.blocks * t / job.threads, job.blocks * (t + 1) / job.threads);
}

template <class T>
T* ptr(uintptr_t a) {
  return reinterpret_cast<T*>(a);
}

void adam8bit_step(uintptr_t param, uintptr_t grad, uintptr_t codes1, uintptr_t absmax1, uintptr_t codes2,
                   uintptr_t absmax2, int64_t n, int param_dtype, uintptr_t map1, uintptr_t map2,
                   nb::bytes scalars, uint32_t sr_key, bool sr, int num_threads, bool floor) {
  if (n < 0) throw std::invalid_argument("negative element count");
  if (scalars.size() != sizeof(Adam8bitScalars))
    throw std::invalid_argument("adam8bit takes a " + std::to_string(sizeof(Adam8bitScalars)) +
                                "-byte scalar struct; got " + std::to_string(scalars.size()));
  if (param_dtype < 0 || param_dtype > 2)
    throw std::invalid_argument("param dtype code must be 0 (float32), 1 (float16) or 2 (bfloat16)");
  Job job{};
  job.blocks = (n + kQ8Block - 1) / kQ8Block;
  if (job.blocks == 0) return;
  const float* m1 = ptr<const float>(map1);
  const float* m2 = ptr<const float>(map2);
  job.q.map1 = tables_for(m1, m1 + kCodes).view();
  job.q.map2 = tables_for(m2, m2 + kCodes).view();
  job.q.param = ptr<void>(param);
  job.q.grad = ptr<const void>(grad);
  job.q.codes1 = ptr<uint8_t>(codes1);
  job.q.absmax1 = ptr<float>(absmax1);
  job.q.codes2 = ptr<uint8_t>(codes2);
  job.q.absmax2 = ptr<float>(absmax2);
  job.q.n = n;
  std::memcpy(&job.q.s, scalars.c_str(), sizeof job.q.s);
  job.q.sr_key = sr_key;
  const Q8Param kind = param_dtype == 0 ? Q8Param::F32
                       : param_dtype == 1 ? Q8Param::F16
                       : sr ? Q8Param::BF16SR : Q8Param::BF16;
  job.fn = (floor ? active_isa().adam8bit_floor : active_isa().adam8bit)[int(kind)];
  // Below 128 blocks (32K elements) per thread, waking another costs more than it saves.
  job.threads = int(std::max<int64_t>(1, std::min<int64_t>(std::max(num_threads, 1), job.blocks / 128)));
  nb::gil_scoped_release release;
  ThreadPool::instance().run(job.threads, run_range, &job);
}

}  // namespace

void register_adam8bit(nb::module_& m) {
  m.def("adam8bit_step", &adam8bit_step, nb::arg("param"), nb::arg("grad"), nb::arg("codes1"),
        nb::arg("absmax1"), nb::arg("codes2"), nb::arg("absmax2"), nb::arg("n"), nb::arg("param_dtype"),
        nb::arg("map1"), nb::arg("map2"), nb::arg("scalars"), nb::arg("sr_key"), nb::arg("sr"),
        nb::arg("num_threads"), nb::arg("floor") = false,
        "One 8-bit block-wise Adam step over one contiguous tensor given as host addresses: codes\n"
        "(uint8) and block scales (fp32) of both moments; map1/map2 hold the 256 code values followed\n"
        "by the 255 midpoints, a pad and the start counts (lowbit.kernel_table); scalars is lowbit.pack_adam8bit(hyper); with sr,\n"
        "a bf16 param is stored by stochastic rounding with sr_key. With floor, the benchmark's memory\n"
        "floor instead: the same bytes read and written, trivial math. Releases the GIL.");
}

}  // namespace mfa
