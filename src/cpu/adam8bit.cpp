// 8-bit block-wise Adam (contract: python/mps_fused_adam/numerics/lowbit.py, reference_lowbit.py) on the
// CPU, optionally with bf16 stochastic rounding of the parameter: the driver. The block math is
// adam8bit_kernel.h, built per SIMD path like the span loop and chosen with it (dispatch.h);
// batching, threads and the argument checks are block_batch.h's, shared with the 4-bit driver.
//
// The block (256 elements, one fp32 scale per moment) is the unit of work: a thread owns whole
// blocks, so the new scale of a block is known before any of its codes is written.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam_types.h"
#include "block_batch.h"
#include "dispatch.h"
#include "q8_tables.h"

namespace mfa {
namespace {

namespace nb = nanobind;

// The maps are lowbit's two fixed ones; their tables are built once per distinct content.
const Q8Tables& tables_for(const float* kernel_table) {
  static std::mutex mu;
  static std::vector<std::unique_ptr<Q8Tables>> cache;
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& t : cache)
    if (!std::memcmp(t->table.data(), kernel_table, kKtSize * 4)) return *t;
  cache.push_back(build_q8_tables(kernel_table));
  return *cache.back();
}

template <class T>
T* ptr(uintptr_t a) {
  return reinterpret_cast<T*>(a);
}

// Appends one tensor's job (its arguments already checked).
void add_job(BlockBatch<Q8Job>& b, const LowbitTensor& t, const Q8Map& map1, const Q8Map& map2, bool floor) {
  if (t.n == 0) return;
  if (!map1.is_signed || map2.is_signed)
    throw std::invalid_argument("adam8bit: map1 must be lowbit.kernel_table(True) (signed), map2 kernel_table(False)");
  Q8Job q = lowbit_job<Q8Job>(t);
  q.map1 = map1;
  q.map2 = map2;
  b.add(q, (floor ? active_isa().adam8bit_floor : active_isa().adam8bit)[int(lowbit_param(t.param_dtype, t.sr))]);
}

Q8Map map_at(uintptr_t table) {
  if (table == 0) throw std::invalid_argument("adam8bit: the map table's address is null");
  const float* m = ptr<const float>(table);
  return tables_for(m).view();
}

void adam8bit_step(uintptr_t param, uintptr_t grad, uintptr_t codes1, uintptr_t absmax1, uintptr_t codes2,
                   uintptr_t absmax2, int64_t n, int param_dtype, uintptr_t map1, uintptr_t map2,
                   nb::bytes scalars, uint32_t sr_key, bool sr, int num_threads, bool floor) {
  check_lowbit_args("", "adam8bit", n, param_dtype, scalars);
  if (n == 0) return;
  BlockBatch<Q8Job> b(kQ8Block);
  add_job(b, {param, grad, codes1, absmax1, codes2, absmax2, n, param_dtype, &scalars, sr_key, sr}, map_at(map1),
          map_at(map2), floor);
  b.run(num_threads);
}

// One call for many tensors: each argument a list with one entry per tensor (scalars may repeat
// one bytes object). Everything is checked before anything runs.
void adam8bit_step_many(const std::vector<uintptr_t>& params, const std::vector<uintptr_t>& grads,
                        const std::vector<uintptr_t>& codes1, const std::vector<uintptr_t>& absmax1,
                        const std::vector<uintptr_t>& codes2, const std::vector<uintptr_t>& absmax2,
                        const std::vector<int64_t>& numels, const std::vector<int>& param_dtypes, uintptr_t map1,
                        uintptr_t map2, const std::vector<nb::bytes>& scalars, const std::vector<uint32_t>& sr_keys,
                        const std::vector<int>& sr, int num_threads) {
  const std::vector<LowbitTensor> tensors = lowbit_tensors("adam8bit", params, grads, codes1, absmax1, codes2, absmax2,
                                                           numels, param_dtypes, scalars, sr_keys, sr);
  if (tensors.empty()) return;
  const Q8Map m1 = map_at(map1), m2 = map_at(map2);
  BlockBatch<Q8Job> b(kQ8Block);
  b.jobs.reserve(tensors.size());
  for (const LowbitTensor& t : tensors) add_job(b, t, m1, m2, false);
  b.run(num_threads);
}

}  // namespace

void register_adam8bit(nb::module_& m) {
  m.def(
      "q8_quantize",
      [](uintptr_t x, int64_t n, uintptr_t map, bool positive_floor, uintptr_t out) {
        if (n < 0) throw std::invalid_argument("q8_quantize: n must be >= 0");
        if (n && (x == 0 || out == 0)) throw std::invalid_argument("q8_quantize: null address");
        const Q8Map m = map_at(map);
        active_isa().q8_quantize(ptr<const float>(x), n, m, positive_floor, ptr<uint8_t>(out));
      },
      nb::arg("x"), nb::arg("n"), nb::arg("map"), nb::arg("positive_floor"), nb::arg("out"),
      "The 8-bit step's nearest-code search alone on the active SIMD path (for tests): codes of n fp32\n"
      "values at x on map (a lowbit.kernel_table) into n uint8 at out.");
  m.def("adam8bit_step_many", &adam8bit_step_many, nb::arg("params"), nb::arg("grads"), nb::arg("codes1"),
        nb::arg("absmax1"), nb::arg("codes2"), nb::arg("absmax2"), nb::arg("numels"), nb::arg("param_dtypes"),
        nb::arg("map1"), nb::arg("map2"), nb::arg("scalars"), nb::arg("sr_keys"), nb::arg("sr"),
        nb::arg("num_threads"),
        "adam8bit_step over many tensors in one call: one list entry per tensor for each argument but\n"
        "the maps and the thread count; the tensors' blocks are shared among the threads as one range.\n"
        "Every entry is checked before any tensor is written. Releases the GIL.");
  m.def("adam8bit_step", &adam8bit_step, nb::arg("param"), nb::arg("grad"), nb::arg("codes1"),
        nb::arg("absmax1"), nb::arg("codes2"), nb::arg("absmax2"), nb::arg("n"), nb::arg("param_dtype"),
        nb::arg("map1"), nb::arg("map2"), nb::arg("scalars"), nb::arg("sr_key"), nb::arg("sr"),
        nb::arg("num_threads"), nb::arg("floor") = false,
        "One 8-bit block-wise Adam step over one contiguous tensor given as host addresses: codes\n"
        "(uint8) and block scales (fp32) of both moments; map1/map2 are lowbit.kernel_table(True/False)\n"
        "(code values, midpoints, the quantizer's region constants), checked once per distinct table;\n"
        "scalars is lowbit.pack_adam8bit(hyper); with sr, a bf16 param is stored by stochastic\n"
        "rounding with sr_key. With floor, the benchmark's memory\n"
        "floor instead: the same bytes read and written, trivial math. Releases the GIL.");
}

}  // namespace mfa
