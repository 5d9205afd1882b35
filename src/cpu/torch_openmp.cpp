#include "torch_openmp.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#if defined(__linux__)
#include <dlfcn.h>
#include <link.h>
#endif

namespace mfa {
namespace {

struct Runtime {
  void (*parallel)(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags) = nullptr;
  int (*thread_num)() = nullptr;
  int (*num_threads)() = nullptr;
  int (*max_threads)() = nullptr;
  std::string path;
};

std::once_flag g_once;
Runtime g_rt;
std::atomic<bool> g_enabled{true};
// The process that loaded the extension. A fork child of it must not call into the OpenMP
// runtime it inherited (libgomp's team threads did not survive the fork; a parallel region can
// hang): it runs steps on our own pool, whether or not the parent looked the runtime up.
const long g_load_pid = static_cast<long>(getpid());

bool borrowable() { return g_enabled.load() && g_rt.parallel != nullptr && static_cast<long>(getpid()) == g_load_pid; }

#if defined(__linux__)
// Prefer the runtime in torch's own lib folder (its wheels bundle libgomp); another OpenMP
// runtime loaded by some other extension would be a different pool from torch's.
int find_runtime(struct dl_phdr_info* info, size_t, void* out) {
  const char* name = info->dlpi_name;
  if (name == nullptr || *name == '\0') return 0;
  const char* base = std::strrchr(name, '/');
  base = base ? base + 1 : name;
  bool omp = std::strncmp(base, "libgomp", 7) == 0 || std::strncmp(base, "libomp", 6) == 0 ||
             std::strncmp(base, "libiomp5", 8) == 0;
  if (!omp) return 0;
  auto* best = static_cast<std::string*>(out);
  bool in_torch = std::strstr(name, "/torch/lib/") != nullptr;
  if (best->empty() || in_torch) *best = name;
  return in_torch ? 1 : 0;
}
#endif

void resolve() {
  const char* env = std::getenv("MPS_FUSED_ADAM_POOL");
  if (env != nullptr && std::strcmp(env, "own") == 0) g_enabled.store(false);
#if defined(__linux__)
  std::string path;
  dl_iterate_phdr(find_runtime, &path);
  if (path.empty()) return;
  void* lib = dlopen(path.c_str(), RTLD_LAZY | RTLD_NOLOAD);  // never loads a second copy
  if (lib == nullptr) return;
  Runtime rt;
  rt.parallel = reinterpret_cast<decltype(rt.parallel)>(dlsym(lib, "GOMP_parallel"));
  rt.thread_num = reinterpret_cast<decltype(rt.thread_num)>(dlsym(lib, "omp_get_thread_num"));
  rt.num_threads = reinterpret_cast<decltype(rt.num_threads)>(dlsym(lib, "omp_get_num_threads"));
  rt.max_threads = reinterpret_cast<decltype(rt.max_threads)>(dlsym(lib, "omp_get_max_threads"));
  if (rt.parallel == nullptr || rt.thread_num == nullptr || rt.num_threads == nullptr || rt.max_threads == nullptr)
    return;
  rt.path = path;
  g_rt = rt;
#endif
  // macOS (torch's bundled libomp): not borrowed yet; untested on Apple hardware, so the own pool.
}

struct Job {
  int n;
  ParallelTask task;
  void* ctx;
};

void team_member(void* data) {
  const Job& job = *static_cast<const Job*>(data);
  // The team may be smaller than asked for (OMP_THREAD_LIMIT, nested regions): stride over it.
  const int team = g_rt.num_threads();
  for (int i = g_rt.thread_num(); i < job.n; i += team) job.task(job.ctx, i);
}

}  // namespace

bool run_on_torch_openmp(int n, ParallelTask task, void* ctx) {
  std::call_once(g_once, resolve);
  if (!borrowable()) return false;
  Job job{n, task, ctx};
  // The team is torch's own size even when fewer members have work (team_member leaves the rest
  // idle): a region of another size makes libgomp resize its team, and again at torch's next
  // region. Interleaved with autograd's kernels (step_in_backward: one small step per param)
  // that cost dearly per step on a 16-core Xeon (docs/experiments.md, "OpenMP team size").
  const unsigned team = static_cast<unsigned>(std::max(n, g_rt.max_threads()));
  g_rt.parallel(team_member, &job, team, 0);
  return true;
}

const char* torch_openmp_path() {
  std::call_once(g_once, resolve);
  return borrowable() ? g_rt.path.c_str() : "";
}

void set_torch_openmp(bool on) {
  std::call_once(g_once, resolve);
  g_enabled.store(on);
}

bool torch_openmp_enabled() {
  std::call_once(g_once, resolve);
  return borrowable();
}

}  // namespace mfa
