// A persistent worker pool with no OpenMP runtime: torch ships its own libomp on macOS and a
// second OpenMP runtime in the process aborts (the README's "The CPU kernel").
#pragma once
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace mfa {

class ThreadPool {
 public:
  using Task = void (*)(void* ctx, int index);
  static ThreadPool& instance();
  // Runs task(ctx, i) for i in [0, n), the caller taking i = 0; returns when all have finished.
  // Calls from different threads are serialized.
  void run(int n, Task task, void* ctx);
  int size() const { return static_cast<int>(workers_.size()) + 1; }

 private:
  ThreadPool() = default;
  ~ThreadPool();
  void grow(int workers);
  void worker_loop(int index, uint64_t seen);
  void forget_after_fork();

  std::mutex run_mu_;  // one run at a time
  std::mutex mu_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  uint64_t generation_ = 0;
  int active_ = 0, remaining_ = 0;
  bool stopping_ = false;
  Task task_ = nullptr;
  void* ctx_ = nullptr;
  long owner_pid_ = 0;
};

}  // namespace mfa
