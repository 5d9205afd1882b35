// Host emulator: runs the kernels of metal/fused_adam.metal over a whole dispatch on the CPU,
// threadgroup by threadgroup, as dispatchThreads:threadsPerThreadgroup: does (threads past the grid
// size of the last, partial threadgroup are not launched). Built by the tests with
//   g++ -std=c++17 -O2 -ffp-contract=off -fno-strict-aliasing -shared -fPIC -I<metal dir>
// and loaded with ctypes; every entry point is extern "C".
#include "metal_compat.h"
#include "fused_adam.metal"

namespace {

// buffers: param, grad, then the rule's states.
typedef void (*GridRunner)(void* const* buffers, const void* hp, ulong base, ulong n, uint64_t threads,
                           uint64_t group, int reverse);

// The kernel of the two-state shape, as the GPU would launch it.
template <typename Rule, typename P, typename S>
void launch_fused_step_2(void* const* b, const void* hp, ulong base, ulong n, uint gid) {
  fused_step_2<Rule, P, S>(static_cast<P*>(b[0]), static_cast<const P*>(b[1]), static_cast<S*>(b[2]),
                           static_cast<S*>(b[3]), *static_cast<const typename Rule::Params*>(hp), base, n, gid);
}

// The kernel of the one-state shape.
template <typename Rule, typename P, typename S>
void launch_fused_step_1(void* const* b, const void* hp, ulong base, ulong n, uint gid) {
  fused_step_1<Rule, P, S>(static_cast<P*>(b[0]), static_cast<const P*>(b[1]), static_cast<S*>(b[2]),
                           *static_cast<const typename Rule::Params*>(hp), base, n, gid);
}

// The block-wise (8-bit and 4-bit) Adam kernels: param, grad, two code buffers, two scale
// buffers, two map tables.
template <typename Rule, typename P, typename S>
void launch_fused_step_blockwise(void* const* b, const void* hp, ulong base, ulong n, uint gid) {
  fused_step_blockwise<Rule, P, S>(static_cast<P*>(b[0]), static_cast<const P*>(b[1]), static_cast<S*>(b[2]),
                                   static_cast<S*>(b[3]), static_cast<float*>(b[4]), static_cast<float*>(b[5]),
                                   static_cast<const float*>(b[6]), static_cast<const float*>(b[7]),
                                   *static_cast<const typename Rule::Params*>(hp), base, n, gid);
}

template <void (*Launch)(void* const*, const void*, ulong, ulong, uint)>
void run_grid(void* const* buffers, const void* hp, ulong base, ulong n, uint64_t threads, uint64_t group,
              int reverse) {
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
      Launch(buffers, hp, base, n, static_cast<uint>(gid));
    }
  }
}

struct Entry {
  const char* name;  // the [[host_name]] of the kernel in fused_adam.metal
  GridRunner run;
  uint64_t params_size;  // bytes of the rule's Params struct
  int buffers;           // param, grad and the states
};

// Expanded from the kernel source's own instantiation lists, so the emulator has exactly its kernels.
#define EMU_ENTRY(SHAPE, RULE, NAME, P, S)                                                   \
  {"fused_" #NAME "_" #P "_" #S, run_grid<launch_##SHAPE<RULE, P, S>>, sizeof(RULE::Params), \
   2 + static_cast<int>(RULE::kStates)},
const Entry kKernels[] = {FUSED_KERNELS(EMU_ENTRY) FUSED_KERNELS_BFLOAT(EMU_ENTRY)};

const Entry* find(const char* name) {
  for (const Entry& e : kKernels) {
    if (std::strcmp(e.name, name) == 0) {
      return &e;
    }
  }
  return nullptr;
}

}  // namespace

#ifdef EMU_COVERAGE
extern "C" void __gcov_dump(void);
#endif

extern "C" {

int emu_kernel_count(void) { return static_cast<int>(sizeof kKernels / sizeof kKernels[0]); }

const char* emu_kernel_name(int k) { return kKernels[k].name; }

// Bytes of kernel `name`'s parameter struct and its buffer count (param, grad, states); 0 if unknown.
uint64_t emu_params_size(const char* name) {
  const Entry* e = find(name);
  return e ? e->params_size : 0;
}

int emu_buffer_count(const char* name) {
  const Entry* e = find(name);
  return e ? e->buffers : 0;
}

// One dispatch. Returns 0, or a negative code for what a Metal dispatch would refuse:
// -1 unknown kernel, -2 parameter bytes shorter than the struct, -3 a grid or threadgroup size
// Metal cannot express (0 threads per group, or more than 2^32 threads in a 1-D grid), -4 a
// buffer count other than the kernel's.
int emu_dispatch(const char* name, void* const* buffers, int nbuffers, const void* hp_bytes,
                 uint64_t hp_len, uint64_t base, uint64_t n, uint64_t threads, uint64_t group, int reverse) {
  const Entry* e = find(name);
  if (e == nullptr) {
    return -1;
  }
  if (hp_len < e->params_size) {
    return -2;
  }
  if (group == 0 || threads > (uint64_t(1) << 32)) {
    return -3;
  }
  if (nbuffers != e->buffers) {
    return -4;
  }
  alignas(16) unsigned char hp[256];
  std::memcpy(hp, hp_bytes, e->params_size);
  e->run(buffers, hp, base, n, threads, group, reverse);
  return 0;
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

// The 8-bit kernel's nearest-code search (code_of) alone, on a map's kernel table.
void emu_code_of(const float* x, const float* table, uint8_t* out, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) out[i] = uint8_t(code_of(x[i], table));
}

// The 4-bit kernel's nearest-code search (Nibbles4::code1) alone, on a kernel_table4 map.
void emu_code4_of(const float* x, const float* table, uint8_t* out, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) out[i] = uint8_t(Nibbles4::code1(x[i], table));
}

void emu_coverage_dump(void) {
#ifdef EMU_COVERAGE
  __gcov_dump();
#endif
}

}  // extern "C"
