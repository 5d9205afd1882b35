// 4-bit block-wise Adam (contract: python/mps_fused_adam/numerics/lowbit4.py and its reference) on
// the CPU, optionally with bf16 stochastic rounding of the parameter: the driver. The block math
// is adam4bit_kernel.h, built per SIMD path like the span loop and chosen with it (dispatch.h);
// batching, threads and the argument checks are the 8-bit driver's (block_batch.h).
//
// The block (128 elements, one fp32 scale per moment, 64 code bytes) is the unit of work: a thread
// owns whole blocks, so the new scale of a block is known before any of its codes is written, and
// no two threads write one code byte.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam_types.h"
#include "block_batch.h"
#include "dispatch.h"

namespace mfa {
namespace {

namespace nb = nanobind;

template <class T>
T* ptr(uintptr_t a) {
  return reinterpret_cast<T*>(a);
}

// A lowbit4.kernel_table4 (16 code values ascending, 15 midpoints, a 0 pad), checked: the binary
// search needs midpoints strictly ascending, each between its two codes; the first moment's map is
// signed with 0 at code 7, the second's positive with the linear map's midpoints; both end at 1.
void read_table(uintptr_t address, bool is_signed, float* out) {
  const char* which = is_signed ? "map1 (lowbit4.kernel_table4(True))" : "map2 (lowbit4.kernel_table4(False))";
  if (address == 0) throw std::invalid_argument(std::string("adam4bit: ") + which + ": null address");
  std::memcpy(out, ptr<const float>(address), kQ4Table * sizeof(float));
  const float* v = out;
  const float* mid = out + 16;
  auto require = [&](bool ok, const char* what) {
    if (!ok) throw std::invalid_argument(std::string("adam4bit: ") + which + ": " + what);
  };
  for (int k = 0; k < 15; ++k) {
    require(v[k] < v[k + 1], "code values not strictly ascending");
    require(v[k] <= mid[k] && mid[k] <= v[k + 1] && (k == 0 || mid[k - 1] < mid[k]),
            "midpoints not strictly ascending between their codes");
  }
  require(out[31] == 0.0f, "pad word not 0");
  require(v[15] == 1.0f, "last code value not 1");
  if (is_signed)
    require(v[0] < 0.0f && v[7] == 0.0f, "not a signed map (0.0 at code 7)");
  else {
    require(v[0] > 0.0f, "not the zero-free unsigned map");
    // The kernels count the midpoints below x by arithmetic on this structure (linear_code_of).
    for (int k = 0; k < 15; ++k) require(mid[k] == (float(k) + 1.5f) / 16.0f, "midpoints not (k + 3/2) / 16");
  }
}

// Appends one tensor's job (its arguments already checked).
void add_job(BlockBatch<Q4Job>& b, const LowbitTensor& t, const float* map1, const float* map2, bool floor) {
  if (t.n == 0) return;
  Q4Job q = lowbit_job<Q4Job>(t);
  std::memcpy(q.map1, map1, sizeof q.map1);
  std::memcpy(q.map2, map2, sizeof q.map2);
  b.add(q, (floor ? active_isa().adam4bit_floor : active_isa().adam4bit)[int(lowbit_param(t.param_dtype, t.sr))]);
}

void adam4bit_step(uintptr_t param, uintptr_t grad, uintptr_t codes1, uintptr_t absmax1, uintptr_t codes2,
                   uintptr_t absmax2, int64_t n, int param_dtype, uintptr_t map1, uintptr_t map2,
                   nb::bytes scalars, uint32_t sr_key, bool sr, int num_threads, bool floor) {
  check_lowbit_args("", "adam4bit", n, param_dtype, scalars);
  if (n == 0) return;
  float m1[kQ4Table], m2[kQ4Table];
  read_table(map1, true, m1);
  read_table(map2, false, m2);
  BlockBatch<Q4Job> b(kQ4Block);
  add_job(b, {param, grad, codes1, absmax1, codes2, absmax2, n, param_dtype, &scalars, sr_key, sr}, m1, m2, floor);
  b.run(num_threads);
}

// One call for many tensors: each argument a list with one entry per tensor (scalars may repeat
// one bytes object). Everything is checked before anything runs.
void adam4bit_step_many(const std::vector<uintptr_t>& params, const std::vector<uintptr_t>& grads,
                        const std::vector<uintptr_t>& codes1, const std::vector<uintptr_t>& absmax1,
                        const std::vector<uintptr_t>& codes2, const std::vector<uintptr_t>& absmax2,
                        const std::vector<int64_t>& numels, const std::vector<int>& param_dtypes, uintptr_t map1,
                        uintptr_t map2, const std::vector<nb::bytes>& scalars, const std::vector<uint32_t>& sr_keys,
                        const std::vector<int>& sr, int num_threads) {
  const std::vector<LowbitTensor> tensors = lowbit_tensors("adam4bit", params, grads, codes1, absmax1, codes2, absmax2,
                                                           numels, param_dtypes, scalars, sr_keys, sr);
  if (tensors.empty()) return;
  float m1[kQ4Table], m2[kQ4Table];
  read_table(map1, true, m1);
  read_table(map2, false, m2);
  BlockBatch<Q4Job> b(kQ4Block);
  b.jobs.reserve(tensors.size());
  for (const LowbitTensor& t : tensors) add_job(b, t, m1, m2, false);
  b.run(num_threads);
}

}  // namespace

void register_adam4bit(nb::module_& m) {
  m.def(
      "q4_quantize",
      [](uintptr_t x, int64_t n, uintptr_t map, bool is_signed, uintptr_t out) {
        if (n < 0) throw std::invalid_argument("q4_quantize: n must be >= 0");
        if (n && (x == 0 || out == 0)) throw std::invalid_argument("q4_quantize: null address");
        float table[kQ4Table];
        read_table(map, is_signed, table);
        active_isa().q4_quantize(ptr<const float>(x), n, table, ptr<uint8_t>(out));
      },
      nb::arg("x"), nb::arg("n"), nb::arg("map"), nb::arg("signed"), nb::arg("out"),
      "The 4-bit step's nearest-code search alone on the active SIMD path (for tests): the packed\n"
      "codes of n fp32 values at x on map (lowbit4.kernel_table4(signed), checked) into\n"
      "ceil(n / 2) bytes at out.");
  m.def("adam4bit_step_many", &adam4bit_step_many, nb::arg("params"), nb::arg("grads"), nb::arg("codes1"),
        nb::arg("absmax1"), nb::arg("codes2"), nb::arg("absmax2"), nb::arg("numels"), nb::arg("param_dtypes"),
        nb::arg("map1"), nb::arg("map2"), nb::arg("scalars"), nb::arg("sr_keys"), nb::arg("sr"),
        nb::arg("num_threads"),
        "adam4bit_step over many tensors in one call (adam8bit_step_many's arguments): one list entry\n"
        "per tensor for each argument but the maps and the thread count; the tensors' blocks are\n"
        "shared among the threads as one range. Every entry is checked before any tensor is written.\n"
        "Releases the GIL.");
  m.def("adam4bit_step", &adam4bit_step, nb::arg("param"), nb::arg("grad"), nb::arg("codes1"),
        nb::arg("absmax1"), nb::arg("codes2"), nb::arg("absmax2"), nb::arg("n"), nb::arg("param_dtype"),
        nb::arg("map1"), nb::arg("map2"), nb::arg("scalars"), nb::arg("sr_key"), nb::arg("sr"),
        nb::arg("num_threads"), nb::arg("floor") = false,
        "One 4-bit block-wise Adam step over one contiguous tensor given as host addresses: packed\n"
        "codes (uint8, two per byte, ceil(n / 2) bytes) and block scales (fp32, one per 128 elements)\n"
        "of both moments; map1/map2 are lowbit4.kernel_table4(True/False) (16 code values, 15\n"
        "midpoints, a 0 pad), checked on every call; scalars is lowbit.pack_adam8bit(hyper); with sr,\n"
        "a bf16 param is stored by stochastic rounding with sr_key. With floor, the benchmark's\n"
        "memory floor instead: the same bytes read and written, trivial math. Releases the GIL.");
}

}  // namespace mfa
