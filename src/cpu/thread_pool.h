// A persistent worker pool with no OpenMP runtime: torch ships its own libomp on macOS and a
// second OpenMP runtime in the process aborts (docs/cpu-kernel.md).
#pragma once
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace mfa {

// The cores the calling thread may run on (Linux; empty elsewhere).
std::vector<int> current_thread_cores();

class ThreadPool {
 public:
  using Task = void (*)(void* ctx, int index);
  static ThreadPool& instance();
  // Runs task(ctx, i) for i in [0, n), the caller taking i = 0; returns when all have finished.
  // Calls from different threads are serialized.
  void run(int n, Task task, void* ctx);
  int size() const { return static_cast<int>(workers_.size()) + 1; }
  // Pins the pool's threads to `cores` (Linux; elsewhere returns false and changes nothing):
  // with one_per_thread, pool thread i >= 1 to cores[i % n] alone, for ZenFlow's optimizer
  // process, whose pool owns its cores, and the calling thread (thread 0 of run()) to the whole
  // list, since the threads it starts later inherit its mask; otherwise every thread to the whole
  // list (how the previous placement is restored). Workers started later get the same placement.
  // Returns false if the platform cannot pin or the kernel refused a core.
  bool pin(const std::vector<int>& cores, bool one_per_thread);

 private:
  ThreadPool() = default;
  ~ThreadPool();
  void grow(int workers);
  void worker_loop(int index, uint64_t seen);
  void forget_after_fork();
  bool apply_pin(std::thread::native_handle_type thread, int index);

  std::mutex run_mu_;  // one run at a time
  std::mutex mu_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  uint64_t generation_ = 0;
  int active_ = 0, remaining_ = 0;
  bool stopping_ = false;
  Task task_ = nullptr;
  void* ctx_ = nullptr;
  std::vector<int> pin_cores_;  // empty: never pinned
  bool pin_one_per_thread_ = false;
};

}  // namespace mfa
