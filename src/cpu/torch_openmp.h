// Borrowing the OpenMP runtime that torch already loaded, so that our kernel runs on the same
// worker threads as torch's own operators. Those threads spin for milliseconds after each torch
// operator (libgomp's default wait policy); a second pool of ours woken in that time would share
// the cores with them (measured on a 16-core Xeon: docs/benchmarks.md, "Figures behind the code"). Nothing is linked: the runtime is found among the loaded libraries and its
// GOMP_parallel entry point (the stable ABI of `#pragma omp parallel`, also exported by LLVM's and
// Intel's runtimes) is looked up by name, so no second OpenMP runtime ever enters the process.
#pragma once

namespace mfa {

using ParallelTask = void (*)(void* ctx, int index);

// Runs task(ctx, i) for every i in [0, n) on the borrowed runtime, the caller taking part, and
// returns true; returns false (having run nothing) where there is no runtime to borrow, it is
// switched off, or the process is a fork child of the one that loaded the extension.
bool run_on_torch_openmp(int n, ParallelTask task, void* ctx);

// The runtime's path, or "" when none is borrowed.
const char* torch_openmp_path();

// Switches borrowing on (the default) or off (then ThreadPool's own threads run every step).
void set_torch_openmp(bool on);
bool torch_openmp_enabled();

}  // namespace mfa
