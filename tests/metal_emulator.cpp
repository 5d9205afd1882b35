// Host emulator: runs the kernels of metal/fused_adam.metal over a whole dispatch on the CPU,
// threadgroup by threadgroup, as dispatchThreads:threadsPerThreadgroup: does (threads past the grid
// size of the last, partial threadgroup are not launched). Built by the tests with
//   g++ -std=c++17 -O2 -ffp-contract=off -fno-strict-aliasing -shared -fPIC -I<metal dir>
// and loaded with ctypes; every entry point is extern "C".
#include "metal_compat.h"
#include "fused_adam.metal"

namespace {

typedef void (*GridRunner)(void*, const void*, void*, void*, const AdamParams&, ulong, ulong,
                           uint64_t, uint64_t, int);

template <typename P, typename S>
void run_grid(void* param, const void* grad, void* exp_avg, void* exp_avg_sq, const AdamParams& hp,
              ulong base, ulong n, uint64_t threads, uint64_t group, int reverse) {
  // Threads of one dispatch are independent on a GPU; running the groups (and the threads in
  // them) backwards in some tests shows the results do not depend on an order.
  const uint64_t groups = (threads + group - 1) / group;
  for (uint64_t gi = 0; gi < groups; ++gi) {
    const uint64_t g = reverse ? groups - 1 - gi : gi;
    for (uint64_t ti = 0; ti < group; ++ti) {
      const uint64_t t = reverse ? group - 1 - ti : ti;
      const uint64_t gid = g * group + t;
      if (gid >= threads) {
        continue;
      }
      fused_adam<P, S>(static_cast<P*>(param), static_cast<const P*>(grad),
                       static_cast<S*>(exp_avg), static_cast<S*>(exp_avg_sq), hp, base, n,
                       static_cast<uint>(gid));
    }
  }
}

struct Entry {
  const char* name;  // the [[host_name]] of the kernel in fused_adam.metal
  GridRunner run;
};

const Entry kKernels[] = {
    {"fused_adam_float_float", run_grid<float, float>},
    {"fused_adam_half_float", run_grid<half, float>},
    {"fused_adam_half_half", run_grid<half, half>},
    {"fused_adam_bfloat_float", run_grid<bfloat, float>},
    {"fused_adam_bfloat_bfloat", run_grid<bfloat, bfloat>},
};

}  // namespace

#ifdef EMU_COVERAGE
extern "C" void __gcov_dump(void);
#endif

extern "C" {

uint64_t emu_params_size(void) { return sizeof(AdamParams); }

int emu_kernel_count(void) { return static_cast<int>(sizeof kKernels / sizeof kKernels[0]); }

const char* emu_kernel_name(int k) { return kKernels[k].name; }

// One dispatch. Returns 0, or a negative code for what a Metal dispatch would refuse:
// -1 unknown kernel, -2 parameter bytes shorter than the struct, -3 a grid or threadgroup size
// Metal cannot express (0 threads per group, or more than 2^32 threads in a 1-D grid).
int emu_dispatch(const char* name, void* param, const void* grad, void* exp_avg, void* exp_avg_sq,
                 const void* hp_bytes, uint64_t hp_len, uint64_t base, uint64_t n,
                 uint64_t threads, uint64_t group, int reverse) {
  if (hp_len < sizeof(AdamParams)) {
    return -2;
  }
  if (group == 0 || threads > (uint64_t(1) << 32)) {
    return -3;
  }
  AdamParams hp;
  std::memcpy(&hp, hp_bytes, sizeof hp);
  for (const Entry& e : kKernels) {
    if (std::strcmp(e.name, name) == 0) {
      e.run(param, grad, exp_avg, exp_avg_sq, hp, base, n, threads, group, reverse);
      return 0;
    }
  }
  return -1;
}

// The header's conversions, so a test can hold them against torch's own rounding.
void emu_round_half(const float* in, uint16_t* out, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) {
    const half h = static_cast<half>(in[i]);
    std::memcpy(out + i, &h, 2);
  }
}

void emu_round_bfloat(const float* in, uint16_t* out, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) {
    out[i] = bfloat(in[i]).bits;
  }
}

void emu_coverage_dump(void) {
#ifdef EMU_COVERAGE
  __gcov_dump();
#endif
}

}  // extern "C"
